"""Varlen attention for packed micro-batches (`--qkv-format thd`), as an HF attention implementation.

A packed micro-batch is one row of T tokens holding several sequences; `cu_seq_lens_q` (int32,
(N+1,), the sequences' start offsets and T; transformers' FlashAttentionKwargs name) says where each
starts. `packed_sdpa_attention` is registered with transformers' AttentionInterface as "miles_sdpa":

- with `cu_seq_lens_q` (a packed call from miles/train/batch.py): causal attention within each
  sequence (miles.utils.varlen: torch's `varlen_attn` for bf16/fp16 on CUDA, else one
  `scaled_dot_product_attention(is_causal=True)` per sequence), never across sequences or over padding;
- without (every other call: padded batches, generation with a KV cache): exactly transformers'
  own sdpa (same function, same `sdpa_mask`).

`use_packed_attention(model)` switches a model loaded with sdpa to it (others are left as they are:
transformers packs for them from the position_ids alone, building a block-diagonal mask for eager,
calling flash-attn's varlen kernel for flash).
"""

from __future__ import annotations

import functools

import torch

from miles.utils.varlen import packed_causal_attention

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
    if query.shape[0] != 1 or attention_mask is not None:
        raise ValueError("packed attention takes one row and no attention mask")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    return packed_causal_attention(q, k, v, cu_seq_lens, int(kwargs["max_length_q"]), scaling, dropout)[None], None
