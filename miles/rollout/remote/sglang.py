"""A server speaking SGLang's native API (SGLang itself, or `miles serve`).

Generation is one batched `POST /generate` per chunk of prompts: `input_ids` as a list of lists
and one `sampling_params` dict per prompt, each with the sample's `sampling_seed`, so a chunk's
samples draw from their own streams whatever else the server is running. Tokens and log-probs are
read from `meta_info.output_token_logprobs` (`[logprob, token_id, text]` triples), as slime does.

Weights: `pause_generation` -> `flush_cache` -> `update_weights_from_disk {model_path,
weight_version}` -> `continue_generation`, the sequence slime and Miles use.

MoE (`routed_top_k` set): each request asks for `return_routed_experts` and each output carries the
decoded `meta_info.routed_experts` (SGLang needs `--enable-return-routed-experts`; `miles serve`
always has them); a server that sends none leaves `routed_experts` None.

Memory: `release_memory_occupation {}` / `resume_memory_occupation {}` (no tags: weights, KV cache
and CUDA graphs alike). SGLang frees memory only when started with `--enable-memory-saver`, and
refuses a release while requests run.
"""

from __future__ import annotations

from typing import Any

import httpx

from miles.config import SamplingParams
from miles.rollout.engine import GenerationOutput
from miles.rollout.remote.http import EngineError, ServerClient
from miles.rollout.remote.protocol import (
    Garbage,
    checked_output,
    decode_routes,
    version_number,
)

FLAG = "--sglang-url"
_FINISH = {"stop": "stop", "length": "length"}


class SGLangServer:
    flag = FLAG
    health_path = "/health_generate"

    def __init__(self, client: ServerClient, *, eos_token_ids: list[int], vocab_size: int,
                 routed_top_k: int | None = None):
        """`routed_top_k`: an MoE model's experts per token (ask for the routes), None for a dense one."""
        self.client, self.eos_token_ids, self.vocab_size = client, eos_token_ids, vocab_size
        self.routed_top_k = routed_top_k

    def params(self, sampling: SamplingParams, seed: int) -> dict[str, Any]:
        return {"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                "top_p": sampling.top_p, "top_k": -1, "sampling_seed": seed, "stop_token_ids": self.eos_token_ids,
                "skip_special_tokens": False, "no_stop_trim": True, "spaces_between_special_tokens": False}

    async def generate(self, session: httpx.AsyncClient, prompts: list[list[int]], sampling: SamplingParams,
                       seeds: list[int]) -> list[GenerationOutput]:
        body = {"input_ids": prompts, "sampling_params": [self.params(sampling, s) for s in seeds],
                "return_logprob": True}
        if self.routed_top_k is not None:
            body["return_routed_experts"] = True
        answer = await self.client.call(session, "POST", "/generate", body)
        if not isinstance(answer, list) or len(answer) != len(prompts):
            raise self.client.fail(f"POST /generate answered {_what(answer)} for a batch of {len(prompts)}")
        try:
            return [self._output(item, sampling, len(p)) for item, p in zip(answer, prompts)]
        except Garbage as e:
            raise self.client.fail(f"POST /generate answered garbage: {e}") from None

    def _output(self, item: Any, sampling: SamplingParams, prompt_len: int) -> GenerationOutput:
        meta = item.get("meta_info") if isinstance(item, dict) else None
        if not isinstance(meta, dict) or not isinstance(meta.get("output_token_logprobs"), list):
            raise Garbage("no meta_info.output_token_logprobs (the server must honour return_logprob)")
        triples = meta["output_token_logprobs"]
        if not all(isinstance(t, list) and len(t) >= 2 for t in triples):
            raise Garbage("output_token_logprobs entries are not [logprob, token_id, text] triples")
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else finish
        if kind == "abort":
            raise Garbage(f"the server aborted the request "
                          f"({finish.get('message', '') if isinstance(finish, dict) else ''})")
        out = checked_output([t[1] for t in triples], [t[0] for t in triples], _FINISH.get(kind, kind),
                             max_new_tokens=sampling.max_new_tokens, vocab_size=self.vocab_size,
                             weight_version=version_number(meta.get("weight_version")))
        if self.routed_top_k is not None and meta.get("routed_experts") is not None:
            out.routed_experts = decode_routes(meta["routed_experts"], tokens=prompt_len + len(out.token_ids) - 1,
                                               top_k=self.routed_top_k)
        return out

    def load_weights(self, path: str, weight_version: int) -> None:
        c = self.client
        c.request("POST", "/pause_generation", {"mode": "abort"})
        try:
            c.request("POST", "/flush_cache")
            answer = c.request("POST", "/update_weights_from_disk",
                               {"model_path": path, "weight_version": str(weight_version)})
            if not (isinstance(answer, dict) and answer.get("success") is True):
                raise c.fail(f"update_weights_from_disk {path} did not succeed: {_what(answer)}")
        finally:
            c.request("POST", "/continue_generation", {})

    def release_memory(self) -> None:
        self.client.request("POST", "/release_memory_occupation", {})

    def resume_memory(self) -> None:
        self.client.request("POST", "/resume_memory_occupation", {})

    def weights_checksum(self) -> dict[str, dict] | None:
        """`miles serve`'s per-tensor digests; None from a server without the endpoint (SGLang)."""
        answer = self.checksum_answer()
        return None if answer is None else answer["tensors"]

    def checksum_answer(self) -> dict | None:
        """`GET /weights_checksum` whole ({"weight_version", "tensors"}); None when the server has none."""
        try:
            answer = self.client.request("GET", "/weights_checksum")
        except EngineError as e:
            if e.status == 404:
                return None
            raise
        if not (isinstance(answer, dict) and isinstance(answer.get("tensors"), dict)):
            raise self.client.fail(f"GET /weights_checksum answered {_what(answer)}")
        return answer

    def prompt_log_probs(self, tokens: list[int]) -> list[float]:
        """log p(tokens[i] | tokens[:i]) for i >= 1, temperature 1, from `input_token_logprobs`."""
        body = {"input_ids": tokens, "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
                "return_logprob": True, "logprob_start_len": 0}
        answer = self.client.request("POST", "/generate", body)
        triples = (answer.get("meta_info") or {}).get("input_token_logprobs") if isinstance(answer, dict) else None
        if not isinstance(triples, list) or len(triples) != len(tokens):
            raise self.client.fail(f"POST /generate (scoring) gave no input_token_logprobs for {len(tokens)} tokens")
        return [float(t[0]) for t in triples[1:]]


def _what(answer: Any) -> str:
    text = repr(answer)
    return text if len(text) <= 120 else text[:117] + "..."
