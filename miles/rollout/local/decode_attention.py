"""The fast engine's decode attention on a GPU: a Triton kernel over the slot KV cache.

One program per (slot, KV head): the group's query heads as the rows of one tile, the slot's cached keys and
values read once, in blocks of KEYS columns, and only up to the slot's own position (SDPA reads the whole width
bucket under a mask), with an online softmax in fp32. On the H200 at the Qwen2.5-0.5B shape (14 query heads,
2 KV heads, head dim 64, bf16, positions 128-384) a call takes 0.33-0.38x of the SDPA call it replaces
(`benchmarks/decode_attention.py`; BENCHMARKS.md).

Imported only where it runs (Triton with it): a CUDA GPU, or Triton's interpreter in the tests.
Shapes: b slots, Q query heads, H KV heads, L slot length, D head dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles.utils.invariant_kernels import softmax_block

KEYS = 64  # cached columns a block


def supported(keys: torch.Tensor) -> bool:
    """Whether the kernel runs over this (S, H, L, D) cache: a power-of-two head dim of 16 or more (a tile's width),
    each cached key contiguous. (The queries come in the cache's dtype: the runner casts them.)"""
    d = keys.shape[-1]
    return d >= 16 and d & (d - 1) == 0 and keys.stride(-1) == 1


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                     scale: float, *, block: int = KEYS, **launch) -> torch.Tensor:
    """q (b, Q, D) of slots [0, b), slot j at positions[j], attending to columns [0, positions[j]] of its slot
    in the (S, H, L, D) caches -> (b, Q, D). `block` (columns a block) and `launch` (Triton's num_warps,
    num_stages; its defaults otherwise) are for benchmarks/decode_attention.py's sweep."""
    b, heads, d = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q)
    _decode_attention[(b, kv_heads)](
        q, keys, values, positions, out, q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        out.stride(0), out.stride(1), scale, group, D=d, G=max(16, triton.next_power_of_2(group)), KEYS=block,
        IEEE=q.dtype == torch.float32, **launch)
    return out


@triton.jit
def _decode_attention(q, keys, values, positions, out, s_qb, s_qh, s_ks, s_kh, s_kl, s_ob, s_oh, scale, group,
                      D: tl.constexpr, G: tl.constexpr, KEYS: tl.constexpr, IEEE: tl.constexpr):
    slot, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    r = tl.arange(0, G)  # the group's query heads, padded to a tile's G rows
    d = tl.arange(0, D)
    rows = r < group
    query = tl.load(q + slot * s_qb + (head * group + r)[:, None] * s_qh + d[None, :], mask=rows[:, None], other=0.0)
    last = tl.load(positions + slot)  # the slot sees columns 0..last
    base = slot * s_ks + head * s_kh
    m = tl.full((G,), float("-inf"), tl.float32)
    total = tl.zeros((G,), tl.float32)
    acc = tl.zeros((G, D), tl.float32)
    for n0 in range(0, last + 1, KEYS):
        n = n0 + tl.arange(0, KEYS)
        seen = n <= last
        k = tl.load(keys + base + n[:, None] * s_kl + d[None, :], mask=seen[:, None], other=0.0)
        v = tl.load(values + base + n[:, None] * s_kl + d[None, :], mask=seen[:, None], other=0.0)
        if IEEE:
            scores = tl.dot(query, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(query, tl.trans(k)) * scale
        scores = tl.where(seen[None, :], scores, float("-inf"))
        m, total, acc = softmax_block(m, total, acc, scores, v, IEEE)
    tl.store(out + slot * s_ob + (head * group + r)[:, None] * s_oh + d[None, :],
             (acc / total[:, None]).to(out.dtype.element_ty), mask=rows[:, None])
