"""Causal attention within each of several sequences packed into one row of tokens.

Shared by the trainer's packed micro-batches (miles/train/attention.py) and the engine's packed
prefill (miles/rollout/local/runner.py). Queries (T, Hq, D), keys and values (T, Hkv, D) hold the
sequences back to back; `cu_seq_lens` (N + 1,) int32 on their device gives where each starts, and
T. torch's `varlen_attn` (the FlashAttention varlen kernel) runs bf16/fp16 on CUDA; everything
else runs one `scaled_dot_product_attention(is_causal=True)` per sequence. Neither attends across
sequences.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_lens: torch.Tensor,
                            max_len: int, scale: float | None) -> torch.Tensor:
    """(T, Hq, D) attention outputs of the packed sequences."""
    flash = _flash_kwargs(q, scale)
    if flash is not None:
        groups = q.shape[1] // k.shape[1]
        if groups > 1 and "enable_gqa" not in flash:  # this torch's varlen_attn wants as many kv heads as q heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return _varlen_attn()(q, k, v.contiguous(), cu_seq_lens, cu_seq_lens, max_len, max_len, **flash)
    return per_sequence_attention(q, k, v, cu_seq_lens, scale)


def per_sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_lens: torch.Tensor,
                           scale: float | None) -> torch.Tensor:
    """The fallback: one `scaled_dot_product_attention(is_causal=True)` per sequence, (T, Hq, D)."""
    bounds = cu_seq_lens.tolist()
    gqa = q.shape[1] != k.shape[1]
    parts = [F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None],
                                            v[s:e].transpose(0, 1)[None], is_causal=True, scale=scale,
                                            enable_gqa=gqa)[0].transpose(0, 1)
             for s, e in zip(bounds[:-1], bounds[1:])]
    return torch.cat(parts)


@functools.cache
def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


@functools.cache
def _varlen_params() -> frozenset[str]:
    return frozenset(inspect.signature(_varlen_attn()).parameters) if _varlen_attn() else frozenset()


def _flash_kwargs(q: torch.Tensor, scale: float | None) -> dict | None:
    """The causal/GQA/scale keywords for this torch's `varlen_attn` (their names changed between
    releases), or None where it cannot run (CPU, fp32, no varlen_attn, a scale it cannot take)."""
    params = _varlen_params()
    if not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and params):
        return None
    extra = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "enable_gqa" in params:
        extra["enable_gqa"] = True
    if "scale" in params:
        extra["scale"] = scale
    elif scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        return None
    return extra
