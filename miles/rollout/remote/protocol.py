"""What an inference server's answers must look like before miles trusts them.

Both adapters (sglang.py, vllm.py) turn a server's JSON into `GenerationOutput`s here, so the same
checks hold for every backend: one output per request, token ids in the vocabulary, one finite
log-prob <= 0 per token, no more tokens than asked for, a known finish reason. Anything else is a
server answering garbage: `Garbage`, which the adapter reports as an `EngineError` naming the URL.
"""

from __future__ import annotations

import math
from typing import Any

from miles.rollout.engine import GenerationOutput

FINISH_REASONS = ("stop", "length")


class Garbage(ValueError):
    """The server's answer is not what its protocol promises."""


def checked_output(token_ids: Any, log_probs: Any, finish: Any, *, max_new_tokens: int, vocab_size: int,
                   weight_version: int | None) -> GenerationOutput:
    if not isinstance(token_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
        raise Garbage(f"token ids are not a list of ints ({_short(token_ids)})")
    if not isinstance(log_probs, list) or len(log_probs) != len(token_ids):
        raise Garbage(f"{_count(log_probs)} log-probs for {len(token_ids)} tokens")
    if len(token_ids) > max_new_tokens:
        raise Garbage(f"{len(token_ids)} tokens for a budget of {max_new_tokens}")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise Garbage(f"token id {bad} is outside the vocabulary ({vocab_size} tokens): the server runs another model")
    for lp in log_probs:
        if not isinstance(lp, (int, float)) or isinstance(lp, bool) or math.isnan(lp) or lp > 1e-3:
            raise Garbage(f"log-prob {_short(lp)} is not a number <= 0")
    if finish not in FINISH_REASONS:
        raise Garbage(f"finish reason {_short(finish)}; expected one of {', '.join(FINISH_REASONS)}")
    # vLLM writes a -inf log-prob as -9999.0; keep what the engine said, as a float
    return GenerationOutput([int(t) for t in token_ids], [float(x) for x in log_probs], finish,
                            weight_version=weight_version)


def decode_routes(value: Any, *, tokens: int, top_k: int, npy: bool = False):
    """A server's `routed_experts` as (tokens, layers, k) int16 numpy expert ids: SGLang's base64 of raw
    int32 bytes (reshaped here: the layer count follows from the size), or vLLM's base64 of a `.npy`
    file (`npy`, shaped already). `tokens`: prompt + output - 1, the tokens the engine fed."""
    import base64
    import io

    import numpy as np

    if not isinstance(value, str):
        raise Garbage(f"routed_experts is {_short(value)}, not a base64 string")
    try:
        raw = base64.b64decode(value.encode("ascii"), validate=True)
        routes = np.load(io.BytesIO(raw), allow_pickle=False) if npy else np.frombuffer(raw, dtype=np.int32)
    except (ValueError, EOFError, OSError) as e:  # binascii.Error is a ValueError; a bad .npy header too
        raise Garbage(f"routed_experts does not decode ({type(e).__name__}: {e})") from None
    if not npy:
        per_token = routes.size // tokens if tokens else 0
        if tokens == 0 or per_token == 0 or routes.size % (tokens * top_k):
            raise Garbage(f"routed_experts holds {routes.size} ids, not tokens ({tokens}) x layers x top-k ({top_k})")
        routes = routes.reshape(tokens, -1, top_k)
    if routes.ndim != 3 or routes.shape[0] != tokens or routes.shape[2] != top_k or routes.dtype.kind not in "iu":
        raise Garbage(f"routed_experts of shape {routes.shape} ({routes.dtype}); expected ({tokens}, layers, {top_k}) "
                      "integer ids")
    return routes.astype(np.int16)


def version_number(value: Any) -> int | None:
    """A server's weight_version ("3", 3, "default") as the step number miles sent, when it is one."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _count(value: Any) -> str:
    return str(len(value)) if isinstance(value, list) else f"no list of ({_short(value)})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
