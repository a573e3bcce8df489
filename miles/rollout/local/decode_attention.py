"""The fast engine's decode attention on a GPU: a Triton kernel over the slot KV cache.

One program per (slot, KV head): the group's query heads as the rows of one tile, the slot's cached keys and
values read once, in blocks of KEYS columns, and only up to the slot's own position (SDPA reads the whole width
bucket under a mask), with an online softmax in fp32. On the H200 at the Qwen2.5-0.5B shape (14 query heads,
2 KV heads, head dim 64, bf16, positions 128-384) a call takes 0.33-0.38x of the SDPA call it replaces
(`benchmarks/decode_attention.py`; BENCHMARKS.md).

`rope_and_attend`, what the engine's decode steps run, is the same kernel with the step's RoPE and KV-cache write
(decode_fused.rope_and_cache) done by each program for its own query heads and key first: one kernel a layer
fewer, the queries never written out (+1-3% tok/s at batch 512 on the H100). `decode_attention` takes queries
rotated elsewhere (the layer functions' decode steps: models with per-head q/k norms, or `fused_decode` off).

Imported only where it runs (Triton with it): a CUDA GPU, or Triton's interpreter in the tests.
Shapes: b slots, Q query heads, H KV heads, L slot length, D head dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles.rollout.local.decode_fused import projected, rope, row_scale
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


def rope_and_attend(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                    keys: torch.Tensor, values: torch.Tensor, heads: int, scale: float, *,
                    norm: tuple[torch.Tensor, float] | None = None, bias: torch.Tensor | None = None,
                    block: int = KEYS, **launch) -> torch.Tensor:
    """A decode step's RoPE, cache write and attention in one kernel: qkv (b, (Q + 2H) * D), the fused projection's
    rows of slots [0, b), slot j at positions[j]; cos and sin (L, 1, D) by position. Each program rotates its KV
    head's query heads and key, writes the key and value into its slot's column positions[j] of the (S, H, L, D)
    caches (as decode_fused.rope_and_cache does), attends to the slot's earlier columns read from the cache and to
    the new one from its registers, and returns (b, Q, D): decode_attention of rope_and_cache's queries, with no
    kernel of its own for the RoPE and no round trip of the queries through memory.

    With `norm` (x (b, hidden), eps), qkv is the projection of the unnormalised rows x by weights with the input
    RMSNorm's weight folded in, with no bias: each program first scales what it reads by its row's
    decode_fused.row_scale of x (the norm's 1 / rms), which makes it the projection of the normalised row (runner.py's
    `_folded_layer`). `bias` ((Q + 2H) * D, or None) is added to what is read (after the scale)."""
    b, kv_heads, d = qkv.shape[0], keys.shape[1], keys.shape[-1]
    group = heads // kv_heads
    x, eps = norm if norm is not None else (qkv, 0.0)
    if qkv.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError("rope_and_attend takes rows with contiguous columns")
    out = torch.empty(b, heads, d, dtype=keys.dtype, device=qkv.device)
    _rope_and_attend[(b, kv_heads)](
        qkv, cos, sin, positions, keys, values, out, x, bias, qkv.stride(0), cos.stride(0), keys.stride(0),
        keys.stride(1), keys.stride(2), out.stride(0), out.stride(1), x.stride(0), scale, group, x.shape[1], eps,
        HEADS=heads, KV_HEADS=kv_heads, D=d, G=max(16, triton.next_power_of_2(group)), KEYS=block,
        IEEE=keys.dtype == torch.float32, NORM=norm is not None, HIDDEN=triton.next_power_of_2(x.shape[1]),
        **launch)
    return out


@triton.jit
def _cached_columns(query, keys, values, s_kl, count, scale, G: tl.constexpr, D: tl.constexpr, KEYS: tl.constexpr,
                    IEEE: tl.constexpr):
    """The online softmax (running max, sum, output; fp32) of a tile of queries (G, D) over one slot's and KV head's
    cached columns [0, count) at `keys` and `values`, KEYS columns a block; count 0 leaves it empty (max -inf)."""
    d = tl.arange(0, D)
    m = tl.full((G,), float("-inf"), tl.float32)
    total = tl.zeros((G,), tl.float32)
    acc = tl.zeros((G, D), tl.float32)
    for n0 in range(0, count, KEYS):  # every block holds at least one column
        n = n0 + tl.arange(0, KEYS)
        seen = n < count
        k = tl.load(keys + n[:, None] * s_kl + d[None, :], mask=seen[:, None], other=0.0)
        v = tl.load(values + n[:, None] * s_kl + d[None, :], mask=seen[:, None], other=0.0)
        if IEEE:
            scores = tl.dot(query, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(query, tl.trans(k)) * scale
        scores = tl.where(seen[None, :], scores, float("-inf"))
        m, total, acc = softmax_block(m, total, acc, scores, v, IEEE)
    return m, total, acc


@triton.jit
def _store_heads(out, slot, head, group, r, rows, d, s_ob, s_oh, acc, total):
    """A program's output: its KV head's query heads (rows r of the tile, masked by `rows`), the online softmax's
    sum-weighted values divided by its sum, into (b, Q, D) `out`."""
    tl.store(out + slot * s_ob + (head * group + r)[:, None] * s_oh + d[None, :],
             (acc / total[:, None]).to(out.dtype.element_ty), mask=rows[:, None])


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
    m, total, acc = _cached_columns(query, keys + base, values + base, s_kl, last + 1, scale, G, D, KEYS, IEEE)
    _store_heads(out, slot, head, group, r, rows, d, s_ob, s_oh, acc, total)


@triton.jit
def _rope_and_attend(qkv, cos, sin, positions, keys, values, out, normed, bias, s_row, s_pos, s_ks, s_kh, s_kl, s_ob,
                     s_oh, s_n, scale, group, N, eps, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr,
                     G: tl.constexpr, KEYS: tl.constexpr, IEEE: tl.constexpr, NORM: tl.constexpr,
                     HIDDEN: tl.constexpr):
    slot, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    r = tl.arange(0, G)
    d = tl.arange(0, D)
    rows = r < group
    last = tl.load(positions + slot)  # the new column: earlier ones come from the cache
    c = tl.load(cos + last * s_pos + d).to(tl.float32)
    s = tl.load(sin + last * s_pos + d).to(tl.float32)
    row = qkv + slot * s_row
    own_head = head + tl.arange(0, 1)  # the KV head as a tile of one row: key and value (1, D)
    scaled = row_scale(normed + slot * s_n, N, eps, HIDDEN) if NORM else None  # the norm folded: `projected`
    query = rope(row, head * group + r, rows, c, s, D, scaled, bias)
    key = rope(row + HEADS * D, own_head, own_head < KV_HEADS, c, s, D, scaled,
               bias + HEADS * D if bias is not None else None)
    value = projected(row, bias, (HEADS + KV_HEADS + own_head)[:, None] * D + d[None, :],
                      (own_head < KV_HEADS)[:, None], scaled)
    query, key, value = (query.to(keys.dtype.element_ty), key.to(keys.dtype.element_ty),
                         value.to(values.dtype.element_ty))
    base = slot * s_ks + head * s_kh
    tl.store(keys + base + last * s_kl + d[None, :], key)
    tl.store(values + base + last * s_kl + d[None, :], value)
    m, total, acc = _cached_columns(query, keys + base, values + base, s_kl, last, scale, G, D, KEYS, IEEE)
    own = tl.sum(query.to(tl.float32) * key.to(tl.float32), axis=1) * scale  # the new column
    m_new = tl.maximum(m, own)
    alpha = tl.exp(m - m_new)
    p = tl.exp(own - m_new)
    total = total * alpha + p
    acc = acc * alpha[:, None] + p[:, None] * value.to(tl.float32)
    _store_heads(out, slot, head, group, r, rows, d, s_ob, s_oh, acc, total)
