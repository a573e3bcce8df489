"""The fast engine's decode attention on a GPU: Triton kernels over the slot KV cache.

One program per (slot, KV head, chunk of CHUNK cached columns): the group's query heads as the rows of one tile,
the chunk's keys and values read once, in blocks of KEYS columns, and only up to the slot's own position (SDPA
reads the whole width bucket under a mask), with an online softmax in fp32. A slot whose columns fit one chunk
is written out by its program; a longer one's chunks leave their partial softmax (running max, sum, output) for
a second kernel that combines them (flash-decoding's split over the keys), so a step's programs are not fewer
than its slots' chunks. On the H200 at the Qwen2.5-0.5B shape (14 query heads, 2 KV heads, head dim 64, bf16,
positions 128-384) the one-pass kernel took 0.33-0.38x of the SDPA call it replaces
(`benchmarks/decode_attention.py`; BENCHMARKS.md).

Imported only where it runs (Triton with it): a CUDA GPU, or Triton's interpreter in the tests.
Shapes: b slots, Q query heads, H KV heads, L slot length, D head dim, P chunks a slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles.utils.invariant_kernels import softmax_block

KEYS = 64  # cached columns a block
CHUNK = 128  # cached columns a program, where a slot is split (a multiple of KEYS)


def supported(keys: torch.Tensor) -> bool:
    """Whether the kernel runs over this (S, H, L, D) cache: a power-of-two head dim of 16 or more (a tile's width),
    each cached key contiguous. (The queries come in the cache's dtype: the runner casts them.)"""
    d = keys.shape[-1]
    return d >= 16 and d & (d - 1) == 0 and keys.stride(-1) == 1


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                     scale: float, width: int | None = None, chunk: int = CHUNK) -> torch.Tensor:
    """q (b, Q, D) of slots [0, b), slot j at positions[j] < `width` (default: the slot length L), attending to
    columns [0, positions[j]] of its slot in the (S, H, L, D) caches -> (b, Q, D). Each slot's columns are split
    in chunks of `chunk` (0: one program a slot and KV head reads them all)."""
    b, heads, d = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    width = keys.shape[2] if width is None else width
    parts = -(-width // chunk) if chunk else 1
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q)
    g = max(16, triton.next_power_of_2(group))
    # the chunks' partial softmax: running max and sum (b, H, P, 2, G), output (b, H, P, G, D); unused at one part
    stats = torch.empty((b, kv_heads, parts, 2, g) if parts > 1 else (1,), dtype=torch.float32, device=q.device)
    partial = torch.empty((b, kv_heads, parts, g, d) if parts > 1 else (1,), dtype=torch.float32, device=q.device)
    _decode_attention[(b, kv_heads, parts)](
        q, keys, values, positions, out, stats, partial, q.stride(0), q.stride(1), keys.stride(0), keys.stride(1),
        keys.stride(2), out.stride(0), out.stride(1), scale, group, D=d, G=g, KEYS=KEYS, CHUNK=chunk or KEYS,
        SPLIT=parts > 1, IEEE=q.dtype == torch.float32)
    if parts > 1:
        _combine[(b, kv_heads)](positions, stats, partial, out, out.stride(0), out.stride(1), group, parts, D=d, G=g,
                                CHUNK=chunk)
    return out


@triton.jit
def _decode_attention(q, keys, values, positions, out, stats, partial, s_qb, s_qh, s_ks, s_kh, s_kl, s_ob, s_oh,
                      scale, group, D: tl.constexpr, G: tl.constexpr, KEYS: tl.constexpr, CHUNK: tl.constexpr,
                      SPLIT: tl.constexpr, IEEE: tl.constexpr):
    slot, head, part = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    last = tl.load(positions + slot)  # the slot sees columns 0..last
    if SPLIT:
        first = part * CHUNK
        if first > last:  # a chunk past the slot's position: nothing to read, nothing for _combine to read
            return
        stop = tl.minimum(last + 1, first + CHUNK)
    else:
        first = 0
        stop = last + 1
    r = tl.arange(0, G)  # the group's query heads, padded to a tile's G rows
    d = tl.arange(0, D)
    rows = r < group
    query = tl.load(q + slot * s_qb + (head * group + r)[:, None] * s_qh + d[None, :], mask=rows[:, None], other=0.0)
    base = slot * s_ks + head * s_kh
    m = tl.full((G,), float("-inf"), tl.float32)
    total = tl.zeros((G,), tl.float32)
    acc = tl.zeros((G, D), tl.float32)
    for n0 in range(first, stop, KEYS):
        n = n0 + tl.arange(0, KEYS)
        seen = n < stop
        k = tl.load(keys + base + n[:, None] * s_kl + d[None, :], mask=seen[:, None], other=0.0)
        v = tl.load(values + base + n[:, None] * s_kl + d[None, :], mask=seen[:, None], other=0.0)
        if IEEE:
            scores = tl.dot(query, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(query, tl.trans(k)) * scale
        scores = tl.where(seen[None, :], scores, float("-inf"))
        m, total, acc = softmax_block(m, total, acc, scores, v, IEEE)
    if SPLIT:
        at = (slot * tl.num_programs(1) + head) * tl.num_programs(2) + part
        tl.store(stats + at * 2 * G + r, m)
        tl.store(stats + at * 2 * G + G + r, total)
        tl.store(partial + at * G * D + r[:, None] * D + d[None, :], acc)
    else:
        tl.store(out + slot * s_ob + (head * group + r)[:, None] * s_oh + d[None, :],
                 (acc / total[:, None]).to(out.dtype.element_ty), mask=rows[:, None])


@triton.jit
def _combine(positions, stats, partial, out, s_ob, s_oh, group, parts, D: tl.constexpr, G: tl.constexpr,
             CHUNK: tl.constexpr):
    """A slot's chunks' partial softmaxes into its output: each rescaled to the largest running max, summed."""
    slot, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    r = tl.arange(0, G)
    d = tl.arange(0, D)
    m = tl.full((G,), float("-inf"), tl.float32)
    total = tl.zeros((G,), tl.float32)
    acc = tl.zeros((G, D), tl.float32)
    base = (slot * tl.num_programs(1) + head) * parts
    for part in range(0, tl.load(positions + slot) // CHUNK + 1):  # chunk 0 holds column 0: m is finite after it
        at = base + part
        m_part = tl.load(stats + at * 2 * G + r)
        m_new = tl.maximum(m, m_part)
        alpha, beta = tl.exp(m - m_new), tl.exp(m_part - m_new)
        total = total * alpha + tl.load(stats + at * 2 * G + G + r) * beta
        acc = acc * alpha[:, None] + tl.load(partial + at * G * D + r[:, None] * D + d[None, :]) * beta[:, None]
        m = m_new
    tl.store(out + slot * s_ob + (head * group + r)[:, None] * s_oh + d[None, :],
             (acc / total[:, None]).to(out.dtype.element_ty), mask=r[:, None] < group)
