"""Varlen attention for packed micro-batches (`--qkv-format thd`), as an HF attention implementation.

A packed micro-batch is one row of T tokens holding several sequences; `cu_seq_lens_q` (int32,
(N+1,), the sequences' start offsets and T; transformers' FlashAttentionKwargs name) says where each
starts. `packed_sdpa_attention` is registered with transformers' AttentionInterface as "miles_sdpa":

- with `cu_seq_lens_q` (a packed call from miles/train/batch.py): causal attention within each
  sequence: torch's `varlen_attn` (FlashAttention varlen kernel) for bf16/fp16 on CUDA, else one
  `scaled_dot_product_attention(is_causal=True)` per sequence. Neither computes attention across
  sequences or over padding;
- without (every other call: padded batches, generation with a KV cache): exactly transformers'
  own sdpa (same function, same `sdpa_mask`).

`use_packed_attention(model)` switches a model loaded with sdpa to it (others are left as they are:
transformers packs for them from the position_ids alone, building a block-diagonal mask for eager,
calling flash-attn's varlen kernel for flash).
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

NAME = "miles_sdpa"


def use_packed_attention(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with its sdpa attention replaced by `packed_sdpa_attention` (other implementations kept)."""
    from miles.train.logprobs import causal_lm

    lm = causal_lm(model)
    if lm.config._attn_implementation == "sdpa":
        register()
        lm.set_attn_implementation(NAME)
    return model


@functools.cache
def register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, packed_sdpa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def packed_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """query (1, Hq, T, D), key/value (1, Hkv, T, D) -> (1, T, Hq, D) when packed; else transformers' sdpa."""
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    if cu_seq_lens is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1 or attention_mask is not None or dropout:
        raise ValueError("packed attention takes one row, no attention mask and no dropout")
    flash = _flash_varlen_kwargs(query, scaling)
    if flash is not None:
        out = _flash_varlen(query, key, value, cu_seq_lens, int(kwargs["max_length_q"]), flash)
    else:
        out = _per_sequence_sdpa(query, key, value, cu_seq_lens, scaling)
    return out, None


def _per_sequence_sdpa(query, key, value, cu_seq_lens, scaling):
    bounds = cu_seq_lens.tolist()
    gqa = query.shape[1] != key.shape[1]
    parts = [F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True,
                                            scale=scaling, enable_gqa=gqa)
             for s, e in zip(bounds[:-1], bounds[1:])]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()  # (1, T, Hq, D)


def _flash_varlen(query, key, value, cu_seq_lens, max_len: int, extra: dict):
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and "enable_gqa" not in extra:  # this torch's varlen_attn wants as many kv heads as q heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = _varlen_attn()(q, k, v, cu_seq_lens, cu_seq_lens, max_len, max_len, **extra)  # (T, Hq, D)
    return out[None]


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


def _flash_varlen_kwargs(query, scaling) -> dict | None:
    """The causal/GQA/scale keywords for this torch's `varlen_attn` (their names changed between
    releases), or None where it cannot run (CPU, fp32, no varlen_attn, a scale it cannot take)."""
    params = _varlen_params()
    if not (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and params):
        return None
    extra = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "enable_gqa" in params:
        extra["enable_gqa"] = True
    if "scale" in params:
        extra["scale"] = scaling
    elif scaling is not None and abs(scaling - query.shape[-1] ** -0.5) > 1e-12:
        return None
    return extra
