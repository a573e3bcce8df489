"""Log-probs of chosen tokens from a causal LM's final hidden states, a chunk of rows at a time.

The full-vocabulary logits of a micro-batch ((tokens, V) in fp32: 1.9 GB for 8 x 384 tokens of a
151,936-token vocabulary) are never materialised. The model runs to its final hidden states; only
the rows that are scored (response positions) are gathered; then lm_head, the model's own logit
transform, the temperature and the logsumexp run on `chunk_size` rows at a time. In backward each
chunk's logits are recomputed (torch.utils.checkpoint), so at most one chunk of fp32 logits exists
at once, forward or backward. The cost is one more lm_head matmul per chunk in backward.

`run_to_hidden` calls the model itself (not `model.model`), so FSDP2's hooks on the root module
run as in a plain forward: the root's parameters (embeddings, final norm, lm_head) are gathered
and, because train/parallel.py shards the root with reshard_after_forward=False, stay gathered
until backward, which is when `OutputHead` reads lm_head's weight. The lm_head itself runs on no
row (`logits_to_keep` is an empty index); the final hidden states are taken from the base model's
output by a forward hook that lives for that one call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from miles.utils import invariant


@dataclass(frozen=True)
class OutputHead:
    """lm_head and what an HF model applies to its output before returning `.logits`."""

    weight: torch.Tensor  # (V, H); the input embedding when tied
    bias: torch.Tensor | None
    scale: float = 1.0  # Cohere `logit_scale`; Granite 1 / `logits_scaling`
    softcap: float | None = None  # Gemma 2/3 `final_logit_softcapping`: cap * tanh(logits / cap)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(rows, H) -> (rows, V) as the model's forward computes them (its dtype), then fp32."""
        logits = F.linear(hidden, self.weight, self.bias)
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The HF causal LM in `model`: itself, or the first submodule that is one (a `parallelize`
    hook may wrap the model in a module of its own)."""
    return next(m for m in model.modules() if hasattr(m, "get_output_embeddings") and hasattr(m, "base_model"))


def output_head(model: torch.nn.Module) -> OutputHead:
    """The output projection of an HF causal LM and its logit transform, read from its config."""
    model = causal_lm(model)
    config = model.config
    head = model.get_output_embeddings()
    scale = float(getattr(config, "logit_scale", None) or 1.0)
    if getattr(config, "logits_scaling", None):
        scale /= float(config.logits_scaling)
    return OutputHead(head.weight, head.bias, scale, getattr(config, "final_logit_softcapping", None))


def run_to_hidden(model: torch.nn.Module, **inputs) -> torch.Tensor:
    """The final (normed) hidden states (B, L, H) of `model(**inputs)`, with lm_head run on no row."""
    captured = []
    hook = causal_lm(model).base_model.register_forward_hook(lambda _m, _args, out: captured.append(out[0]))
    try:
        empty = torch.zeros(0, dtype=torch.long, device=inputs["input_ids"].device)
        model(**inputs, logits_to_keep=empty, use_cache=False)
    finally:
        hook.remove()
    return captured[0]


def check_output_head(model: torch.nn.Module) -> None:
    """Raises if `OutputHead` does not reproduce `model(...).logits` (a logit transform this module
    does not know of), on a 5-token input."""
    ids = torch.arange(1, 6, device=next(model.parameters()).device)[None] % model.config.vocab_size
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits[0].float()
        got = output_head(model).logits(run_to_hidden(model, input_ids=ids)[0])
    if not torch.allclose(got, expected, rtol=1e-2, atol=1e-2, equal_nan=True):  # NaN weights: the NaN guard's job
        raise ValueError(f"{type(model).__name__}: the chunked log-prob path does not reproduce the model's logits "
                         f"(max diff {(got - expected).abs().max().item():.3g}); the model applies a logit transform "
                         f"miles/train/logprobs.py does not handle")


def _chunk(head: OutputHead, hidden, targets, temperature: float, with_entropy: bool, with_logits: bool):
    """(rows, H) hidden states, (rows,) targets -> log-probs (rows,), entropy (rows,) or None,
    raw logits (rows, V) or None."""
    raw = head.logits(hidden)  # (rows, V) fp32
    logits = raw / temperature if temperature > 0 else raw
    if invariant.enabled() and raw.is_cuda:  # --true-on-policy-mode on a GPU: what the engine's draw reports
        log_probs, log_z = invariant.token_log_probs(raw, targets, temperature if temperature > 0 else 1.0)
    else:
        log_z = logits.logsumexp(-1)
        log_probs = logits.gather(-1, targets[:, None]).squeeze(-1) - log_z
    entropy = None
    if with_entropy:
        with torch.no_grad():
            probs = (logits - log_z[:, None]).exp()
            entropy = log_z - (probs * logits).sum(-1)
    return log_probs, entropy, (raw if with_logits else None)


@functools.cache
def _compiled_chunk():
    """`_chunk` through torch.compile (--trainer-torch-compile): the temperature, logsumexp and gather
    fuse into a few passes over the chunk's fp32 logits."""
    return torch.compile(_chunk)


def chunked_log_probs(head: OutputHead, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, *,
                      chunk_size: int, with_entropy: bool = False, with_logits: bool = False, compiled: bool = False):
    """Log-probs (N,) of `targets` under the logits of `hidden` (N, H), `chunk_size` rows at a time
    (<= 0: all rows at once), each chunk through torch.compile when `compiled`. Also the entropy (N,)
    (no gradient) and the raw logits (N, V) when asked."""
    chunk = _compiled_chunk() if compiled else _chunk
    n = hidden.shape[0]
    step = chunk_size if chunk_size > 0 else max(n, 1)
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
    parts = []
    for start in range(0, n, step):
        args = (head, hidden[start:start + step], targets[start:start + step], temperature, with_entropy, with_logits)
        parts.append(checkpoint(chunk, *args, use_reentrant=False) if recompute else chunk(*args))
    if not parts:  # no row to score
        parts.append(_chunk(head, hidden[:0], targets[:0], temperature, with_entropy, with_logits))
    log_probs = torch.cat([p[0] for p in parts])
    entropy = torch.cat([p[1] for p in parts]) if with_entropy else None
    logits = torch.cat([p[2] for p in parts]) if with_logits else None
    return log_probs, entropy, logits
