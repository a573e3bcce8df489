"""SGLang's native request and response shapes, for `miles serve`: parsing and validating a
`POST /generate` body into `SequenceRequest`s, and building the response objects back.

Shapes follow SGLang's `io_struct.GenerateReqInput` and `sampling_params.SamplingParams`
(notes: /work/notes/sglang_protocol.md §1): `input_ids` (flat: one prompt; a list of lists: a
batch) or `text` (a string or a list of them); `sampling_params` a dict shared by the batch or one
dict per item; `rid`, `return_logprob`, `logprob_start_len`, `return_text_in_logprobs`; `n > 1`
turns a prompt into n samples, prompt-major. Validation messages are SGLang's where it has one.

Where miles departs from SGLang, on purpose:
- Both `text` and `input_ids` is a 400 (SGLang silently uses `input_ids`).
- A feature miles does not implement, set to anything but its default (`stream`, penalties,
  `min_p`, `min_new_tokens`, grammars, `logit_bias`, top-logprobs, images, LoRA, routed experts),
  is a 400 naming the key, never silently ignored; an unknown `sampling_params` key is a 400 (as
  SGLang 0.5.23's schema gate). Unknown top-level keys are ignored (as SGLang).

Pure Python: no torch. A malformed body raises `BadRequest` (the app answers 400
`{"error": {"message": ...}}`, SGLang's ValueError shape).
"""

from __future__ import annotations

import base64
import math
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

from miles.serve.types import Finish, RowSampling, SequenceRequest, SequenceResult

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
INT64 = (-(2**63), 2**63 - 1)
MAX_STOP_STRINGS = 32

# sampling_params keys miles honours.
SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos",
                 "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n", "sampling_seed"}
# Keys accepted with any value and ignored: they do not change what is sampled.
SAMPLING_IGNORED = {"stream_interval", "custom_params"}
# Keys accepted only at their default: anything else changes the distribution in a way miles does not implement.
SAMPLING_DEFAULT_ONLY = {"min_new_tokens": 0, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                         "repetition_penalty": 1.0, "stop_regex": None, "logit_bias": None, "json_schema": None,
                         "regex": None, "ebnf": None, "structural_tag": None, "beam_width": None, "watermark": None,
                         "choice": None}
# Top-level keys accepted only when absent, null, false, zero or empty.
TOP_LEVEL_UNSUPPORTED = ("input_embeds", "stream", "top_logprobs_num", "token_ids_logprob", "custom_logit_processor",
                         "return_hidden_states", "image_data", "video_data", "audio_data", "lora_path",
                         "return_indexer_topk", "session_params")


class BadRequest(ValueError):
    """A request the server refuses; `status` is its HTTP status (400 unless said otherwise)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, kw_only=True)
class ModelLimits:
    """What a prompt is checked against."""

    vocab_size: int
    context_len: int  # the model's max positions
    max_total_tokens: int  # the server's KV budget, in tokens (--max-total-tokens)
    max_sequences: int = 4096  # sequences one request may ask for, n included (--max-queued-requests)
    moe: bool = False  # the model routes tokens to experts: return_routed_experts can be honoured


@dataclass(frozen=True)
class ParsedGenerate:
    sequences: list[SequenceRequest]
    batched: bool  # the response is a JSON array (a batch, or n > 1)


def _show(v) -> str:
    """A value for an error message, cut short (a fuzzer's 4,000-digit integer stays readable)."""
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_unset(v) -> bool:
    return v is None or v is False or v == 0 or v == [] or v == {} or v == ""


def _bool(v, name: str) -> bool:
    if not isinstance(v, bool):
        raise BadRequest(f"{name} must be a boolean, got {_show(v)}")
    return v


def _optional_bool(body: dict, key: str) -> bool:
    value = body.get(key)
    return False if value is None else _bool(value, key)


def _finite_float(v) -> float | None:
    """v as a float when it is a finite JSON number (not a bool); else None."""
    if not _is_number(v):
        return None
    try:
        f = float(v)
    except OverflowError:  # an integer too large for a float
        return None
    return f if math.isfinite(f) else None


# -- the body ------------------------------------------------------------------------------------


def parse_generate(body, limits: ModelLimits, tokenize: Callable[[str], list[int]],
                   rng: random.Random) -> ParsedGenerate:
    """The sequences a `/generate` body asks for, in response order; `rng` draws the seeds of
    sequences sent without a `sampling_seed`."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    for key in TOP_LEVEL_UNSUPPORTED:
        if not _is_unset(body.get(key)):
            raise BadRequest(f"{key} is not supported by miles serve")
    prompts, batched = _prompts(body, limits, tokenize)
    size = len(prompts)
    params = _per_item(body.get("sampling_params"), "sampling_params", size, batched, dict, default={})
    ns = {_n(p) for p in params}
    if len(ns) > 1:
        raise BadRequest("The parallel_sample_num should be the same for all samples in sample params.")
    n = ns.pop()
    if size * n > limits.max_sequences:
        raise BadRequest(f"the request asks for {size * n} sequences ({size} prompt(s) x n={n}); the server queues "
                         f"at most {limits.max_sequences} (--max-queued-requests)")
    return_logprob = _per_item(body.get("return_logprob"), "return_logprob", size, batched, bool, default=False,
                               list_allowed=n == 1)
    start_len = _per_item(body.get("logprob_start_len"), "logprob_start_len", size, batched, int, default=-1,
                          list_allowed=n == 1)
    text_in_logprobs = _optional_bool(body, "return_text_in_logprobs")
    prompt_ids = _optional_bool(body, "return_prompt_token_ids")
    routed = _optional_bool(body, "return_routed_experts")
    if routed and not limits.moe:
        raise BadRequest("return_routed_experts: the model has no MoE layers, so there are no routed experts")
    rids = _rids(body.get("rid"), size, batched, n)

    sequences = []
    for i, prompt in enumerate(prompts):
        sampling = parse_sampling(params[i], prompt_len=len(prompt), limits=limits, rng=rng)
        if start_len[i] < -1 or start_len[i] > len(prompt):
            raise BadRequest(f"logprob_start_len ({start_len[i]}) must be -1 or in [0, the input length "
                             f"({len(prompt)})]")
        for j in range(n):
            seed = sampling.seed if n == 1 or "sampling_seed" in params[i] else rng.getrandbits(63)
            sequences.append(SequenceRequest(
                rid=rids[i * n + j], input_ids=prompt,
                sampling=sampling if seed == sampling.seed else replace(sampling, seed=seed),
                return_logprob=return_logprob[i], logprob_start_len=start_len[i],
                return_text_in_logprobs=text_in_logprobs, return_prompt_token_ids=prompt_ids,
                return_routed_experts=routed))
    return ParsedGenerate(sequences, batched or n > 1)


def _prompts(body: dict, limits: ModelLimits, tokenize) -> tuple[list[list[int]], bool]:
    """The token prompts, and whether the body is a batch."""
    text, ids = body.get("text"), body.get("input_ids")
    if text is None and ids is None:
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    if text is not None and ids is not None:
        raise BadRequest("Either text or input_ids should be provided, not both.")
    if ids is not None:
        if not isinstance(ids, list):
            raise BadRequest(f"input_ids must be a list of token ids or a list of such lists, got {type(ids).__name__}")
        batched = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batched else [ids]
        for i, p in enumerate(prompts):
            where = f"input_ids[{i}]" if batched else "input_ids"
            if not isinstance(p, list):
                raise BadRequest(f"{where} must be a list of token ids (a batch holds only lists)")
            for t in p:
                if not _is_int(t):
                    raise BadRequest(f"{where} must hold integer token ids, got {_show(t)}")
                if not 0 <= t < limits.vocab_size:
                    raise BadRequest(f"{where} holds token id {t}, outside the vocabulary [0, {limits.vocab_size})")
    else:
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if not texts:
            raise BadRequest("text must be a string or a non-empty list of strings")
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise BadRequest(f"text{f'[{i}]' if batched else ''} must be a string, got {type(t).__name__}")
        prompts = [tokenize(t) for t in texts]
    if not prompts:
        raise BadRequest("input_ids must not be an empty batch")
    for i, p in enumerate(prompts):
        if not p:
            raise BadRequest(f"the input{f' #{i}' if batched else ''} is empty: at least one token is needed")
        if len(p) >= limits.context_len:
            raise BadRequest(f"The input ({len(p)} tokens) is longer than the model's context length "
                             f"({limits.context_len} tokens).")
    return prompts, batched


def _per_item(value, name: str, size: int, batched: bool, kind: type, *, default, list_allowed: bool = True) -> list:
    """A value given once for the batch, or as a list with one per item."""
    def check(v, where):
        if kind is dict and not isinstance(v, dict):
            raise BadRequest(f"{where} must be a JSON object, got {type(v).__name__}")
        if kind is bool and not isinstance(v, bool):
            raise BadRequest(f"{where} must be a boolean, got {_show(v)}")
        if kind is int and not _is_int(v):
            raise BadRequest(f"{where} must be an integer, got {_show(v)}")
        return v

    if value is None:
        return [default] * size
    if isinstance(value, list):
        if not list_allowed:
            raise BadRequest(f"Cannot use list {name} with parallel_sample_num > 1")
        if len(value) != size:
            raise BadRequest(f"{name} is a list of {len(value)}, but the batch has {size} item(s)")
        return [check(v, f"{name}[{i}]") for i, v in enumerate(value)]
    return [check(value, name)] * size


def _n(params: dict) -> int:
    n = params.get("n", 1)
    if n is None:
        return 1
    if not _is_int(n) or n < 1:
        raise BadRequest(f"sampling_params.n must be a positive integer, got {_show(n)}")
    return n


def _rids(rid, size: int, batched: bool, n: int) -> list[str]:
    """One request id per sequence; n > 1 gets fresh uuids (as SGLang)."""
    total = size * n
    if rid is None or n > 1:
        return [uuid.uuid4().hex for _ in range(total)]
    if isinstance(rid, str):
        rids = [rid] if not batched else [f"{rid}_{i}" for i in range(size)]
    elif isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if len(rid) != size:
            raise BadRequest(f"rid is a list of {len(rid)}, but the batch has {size} item(s)")
        rids = rid
    else:
        raise BadRequest(f"rid must be a string or a list of strings, got {_show(rid)}")
    if len(set(rids)) != len(rids):
        raise BadRequest("Duplicate request ID(s) detected within the request.")
    return rids


# -- sampling_params -----------------------------------------------------------------------------


def parse_sampling(p: dict, *, prompt_len: int, limits: ModelLimits, rng: random.Random) -> RowSampling:
    """One `sampling_params` dict, checked as SGLang's `SamplingParams.verify` does (same messages)."""
    for key, value in p.items():
        if key in SAMPLING_DEFAULT_ONLY:
            default = SAMPLING_DEFAULT_ONLY[key]
            if value is not None and value != default and not (default is None and _is_unset(value)):
                raise BadRequest(f"sampling_params.{key} is not supported by miles serve (only its default, "
                                 f"{_show(default)})")
        elif key not in SAMPLING_KEYS and key not in SAMPLING_IGNORED:
            raise BadRequest(f"unknown sampling_params key {_show(key)}; "
                             f"expected one of {', '.join(sorted(SAMPLING_KEYS))}")

    temperature = p.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if _finite_float(temperature) is None or temperature < 0:
        raise BadRequest(f"temperature must be a non-negative finite number, got {_show(temperature)}.")
    top_p = p.get("top_p", 1.0)
    top_p = 1.0 if top_p is None else top_p
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {_show(top_p)}.")
    top_k = p.get("top_k", -1)
    top_k = -1 if top_k is None else top_k
    if not _is_int(top_k) or (top_k != -1 and top_k < 1):
        raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {_show(top_k)}.")
    if temperature < 1e-6:  # SGLang: a temperature this small is greedy
        temperature, top_p, top_k = 0.0, 1.0, -1

    room = min(limits.context_len, limits.max_total_tokens) - prompt_len
    max_new = p.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if max_new is None:  # SGLang: no cap but the context
        max_new = max(room, 0)
    if not _is_int(max_new):
        raise BadRequest(f"max_new_tokens must be an integer, got {_show(max_new)}.")
    if max_new < 0:
        raise BadRequest(f"max_new_tokens must be at least 0, got {max_new}.")
    if prompt_len + max_new > limits.context_len:
        raise BadRequest(f"Requested token count exceeds the model's maximum context length of {limits.context_len} "
                         f"tokens. You requested a total of {prompt_len + max_new} tokens: {prompt_len} tokens from "
                         f"the input messages and {max_new} tokens for the completion. Please reduce the number of "
                         f"tokens in the input messages or the completion to fit within the limit.")
    if prompt_len + max_new > limits.max_total_tokens:
        raise BadRequest(f"the request needs {prompt_len + max_new} tokens of KV cache ({prompt_len} input + "
                         f"{max_new} new), more than the server's --max-total-tokens ({limits.max_total_tokens})")

    seed = p.get("sampling_seed")
    if seed is None:
        seed = rng.getrandbits(63)
    elif not _is_int(seed) or not INT64[0] <= seed <= INT64[1]:
        raise BadRequest(f"sampling_seed must be an integer in [-2^63, 2^63 - 1], got {_show(seed)}.")

    return RowSampling(
        max_new_tokens=max_new, temperature=float(temperature), top_p=float(top_p),
        top_k=None if top_k == -1 or top_k >= limits.vocab_size else top_k, seed=seed,
        stop_token_ids=_stop_token_ids(p.get("stop_token_ids")), stop=_stop_strings(p.get("stop")),
        ignore_eos=_flag(p, "ignore_eos", False), skip_special_tokens=_flag(p, "skip_special_tokens", True),
        spaces_between_special_tokens=_flag(p, "spaces_between_special_tokens", True),
        no_stop_trim=_flag(p, "no_stop_trim", False))


def _flag(p: dict, key: str, default: bool) -> bool:
    value = p.get(key, default)
    return default if value is None else _bool(value, f"sampling_params.{key}")


def _stop_token_ids(value) -> frozenset[int]:
    if value is None:
        return frozenset()
    if not isinstance(value, list):
        raise BadRequest(f"stop_token_ids must be a list of token ids, got {_show(value)}")
    ids = [v for v in value if v is not None]  # SGLang drops null entries
    if not all(_is_int(v) for v in ids):
        raise BadRequest(f"stop_token_ids must hold integer token ids, got {_show(value)}")
    return frozenset(ids)


def _stop_strings(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadRequest(f"stop must be a string or a list of strings, got {_show(value)}")
    if len(stops) > MAX_STOP_STRINGS:
        raise BadRequest(f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed")
    return tuple(s for s in stops if s)


# -- responses -----------------------------------------------------------------------------------


def finish_reason(finish: Finish, length: int) -> dict:
    """SGLang's `meta_info.finish_reason`."""
    if finish.kind == "stop":
        return {"type": "stop", "matched": finish.matched}
    if finish.kind == "length":
        return {"type": "length", "length": length}
    reason = {"type": "abort", "message": finish.message or "Aborted"}
    if not finish.in_waiting_queue:
        reason.update(status_code=None, err_type=None)
    return reason


def _finite(x: float | None) -> float | None:
    """orjson writes -inf and NaN as null; so does this server."""
    return x if x is not None and math.isfinite(x) else None


def generate_response(req: SequenceRequest, res: SequenceResult, decode: Callable[..., str]) -> dict:
    """One `/generate` response object. `decode(ids, skip_special_tokens=..., spaces_between_special_tokens=...)`."""
    s = req.sampling
    ids = res.output_ids
    text_ids = ids
    if res.finish.kind == "stop" and isinstance(res.finish.matched, int) and not s.no_stop_trim:
        text_ids = ids[:-1]  # the matched stop token leaves the text, not output_ids
    text = decode(text_ids, skip_special_tokens=s.skip_special_tokens,
                  spaces_between_special_tokens=s.spaces_between_special_tokens)
    if res.finish.kind == "stop" and isinstance(res.finish.matched, str):
        cut = text.find(res.finish.matched)
        if cut >= 0:
            text = text[:cut + (len(res.finish.matched) if s.no_stop_trim else 0)]
    meta = {"id": req.rid, "finish_reason": finish_reason(res.finish, len(ids))}
    if not res.finish.in_waiting_queue:
        meta.update(prompt_tokens=len(req.input_ids), cached_tokens=0, reasoning_tokens=0,
                    num_retractions=res.retractions)
    meta.update(completion_tokens=len(ids), weight_version=res.weight_version, e2e_latency=res.e2e_latency)
    if req.return_logprob:
        def token_text(t):
            return decode([t], skip_special_tokens=False) if req.return_text_in_logprobs else None

        meta["output_token_logprobs"] = [[_finite(lp), t, token_text(t)] for lp, t in zip(res.output_logprobs, ids)]
        start = len(req.input_ids) if req.logprob_start_len < 0 else req.logprob_start_len
        prompt_part = req.input_ids[start:]
        logps = res.input_logprobs or [None] * len(prompt_part)
        meta["input_token_logprobs"] = [[_finite(lp), t, token_text(t)] for lp, t in zip(logps, prompt_part)]
        meta["output_token_logprobs_length"] = len(ids)
    if req.return_routed_experts and res.routed_experts is not None:  # as SGLang: base64 of int32 bytes
        meta["routed_experts"] = base64.b64encode(res.routed_experts).decode("ascii")
    out = {"text": text, "output_ids": list(ids), "meta_info": meta}
    if req.return_prompt_token_ids:
        out["prompt_token_ids"] = list(req.input_ids)
    return out


def error_body(message: str) -> dict:
    """SGLang's ValueError body (`http_server._create_error_response`)."""
    return {"error": {"message": message}}
