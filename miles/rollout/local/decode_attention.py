"""The fast engine's decode attention on a GPU: a Triton kernel over the slot KV cache.

One program per slot and KV heads (`heads_per_program`: as many as fill a 16-row tile with their query heads, at
most two): those query heads as the rows of one tile, each row scored against its own head's keys, the slot's cached
keys and values read once, in blocks of KEYS columns, and only up to the slot's own position (SDPA reads the whole
width bucket under a mask), with an online softmax in fp32. On the H200 at the Qwen2.5-0.5B shape (14 query heads,
2 KV heads, head dim 64, bf16, positions 128-384) a call takes 0.33-0.38x of the SDPA call it replaces
(`benchmarks/decode_attention.py`; BENCHMARKS.md).

`rope_and_attend`, what the engine's decode steps run, is the same kernel with the step's RoPE and KV-cache write
(decode_fused.rope_and_cache) done by each program for its own query heads and keys first: one kernel a layer
fewer, the queries never written out (+1-3% tok/s at batch 512 on the H100). `decode_attention` takes queries
rotated elsewhere (the layer functions' decode steps: models with per-head q/k norms, or `fused_decode` off).

Imported only where it runs (Triton with it): a CUDA GPU, or Triton's interpreter in the tests.
Shapes: b slots, Q query heads, H KV heads, L slot length, D head dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles.rollout.local.decode_fused import rope

KEYS = 64  # cached columns a block
TILE_ROWS = 16  # a tile's query rows (tl.dot's smallest): a program takes as many KV heads' query groups as fill it
MAX_HEADS = 2  # ... but at most this many KV heads (the shape measured: Qwen2.5-0.5B's 2 KV heads of 7 query heads)


def supported(keys: torch.Tensor) -> bool:
    """Whether the kernel runs over this (S, H, L, D) cache: a power-of-two head dim of 16 or more (a tile's width),
    each cached key contiguous. (The queries come in the cache's dtype: the runner casts them.)"""
    d = keys.shape[-1]
    return d >= 16 and d & (d - 1) == 0 and keys.stride(-1) == 1


def heads_per_program(kv_heads: int, group: int, limit: int = MAX_HEADS) -> int:
    """The KV heads one program attends for: the most, a power of two dividing `kv_heads` and at most `limit`, whose
    query heads (`group` each) fit one tile of TILE_ROWS rows (1 where one group fills it). Two KV heads of seven
    query heads in one program read both heads' columns in the same loop, half as many programs a step."""
    most = 1
    while most * 2 <= limit and kv_heads % (most * 2) == 0 and most * 2 * group <= TILE_ROWS:
        most *= 2
    return most


def _tile(heads: int, group: int) -> int:
    return max(TILE_ROWS, triton.next_power_of_2(heads * group))


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                     scale: float, *, block: int = KEYS, kv_per_program: int | None = None, **launch) -> torch.Tensor:
    """q (b, Q, D) of slots [0, b), slot j at positions[j], attending to columns [0, positions[j]] of its slot
    in the (S, H, L, D) caches -> (b, Q, D). `block` (columns a block), `kv_per_program` (KV heads a program, default
    heads_per_program) and `launch` (Triton's num_warps, num_stages; its defaults otherwise) are for
    benchmarks/decode_attention.py's sweep."""
    b, q_heads, d = q.shape
    kv_heads = keys.shape[1]
    group = q_heads // kv_heads
    hb = kv_per_program or heads_per_program(kv_heads, group)
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q)
    _decode_attention[(b, kv_heads // hb)](
        q, keys, values, positions, out, q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        out.stride(0), out.stride(1), scale, group, HB=hb, D=d, G=_tile(hb, group), KEYS=block,
        IEEE=q.dtype == torch.float32, **launch)
    return out


def rope_and_attend(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                    keys: torch.Tensor, values: torch.Tensor, heads: int, scale: float, *, block: int = KEYS,
                    kv_per_program: int | None = None, **launch) -> torch.Tensor:
    """A decode step's RoPE, cache write and attention in one kernel: qkv (b, (Q + 2H) * D), the fused projection's
    rows of slots [0, b), slot j at positions[j]; cos and sin (L, 1, D) by position. Each program rotates its KV
    heads' query heads and keys, writes the keys and values into its slot's column positions[j] of the (S, H, L, D)
    caches (as decode_fused.rope_and_cache does), attends to the slot's earlier columns read from the cache and to
    the new one from its registers, and returns (b, Q, D): decode_attention of rope_and_cache's queries, with no
    kernel of its own for the RoPE and no round trip of the queries through memory. `block`, `kv_per_program` and
    `launch` as decode_attention's."""
    b, kv_heads, d = qkv.shape[0], keys.shape[1], keys.shape[-1]
    group = heads // kv_heads
    hb = kv_per_program or heads_per_program(kv_heads, group)
    if qkv.stride(-1) != 1:
        raise ValueError("rope_and_attend takes rows with contiguous columns")
    out = torch.empty(b, heads, d, dtype=keys.dtype, device=qkv.device)
    _rope_and_attend[(b, kv_heads // hb)](
        qkv, cos, sin, positions, keys, values, out, qkv.stride(0), cos.stride(0), keys.stride(0), keys.stride(1),
        keys.stride(2), out.stride(0), out.stride(1), scale, group, HEADS=heads, KV_HEADS=kv_heads, HB=hb, D=d,
        G=_tile(hb, group), KEYS=block, IEEE=keys.dtype == torch.float32, **launch)
    return out


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _cached_columns(query, keys, values, s_kh, s_kl, count, scale, kv, HB: tl.constexpr, G: tl.constexpr,
                    D: tl.constexpr, KEYS: tl.constexpr, IEEE: tl.constexpr):
    """The online softmax (running max, sum, output; fp32) of a tile of queries (G, D) over one slot's cached
    columns [0, count) of HB KV heads at `keys` and `values` (head h at + h * s_kh), KEYS columns a block; row r
    attends to head kv[r] (its scores from that head's keys, its output from that head's values; rows past the
    heads' query heads get scores 0 and are not stored). count 0 leaves it empty (max -inf)."""
    d = tl.arange(0, D)
    m = tl.full((G,), float("-inf"), tl.float32)
    total = tl.zeros((G,), tl.float32)
    acc = tl.zeros((G, D), tl.float32)
    for n0 in range(0, count, KEYS):  # every block holds at least one column
        n = n0 + tl.arange(0, KEYS)
        seen = n < count
        scores = tl.zeros((G, KEYS), tl.float32)
        for h in tl.static_range(HB):
            k = tl.load(keys + h * s_kh + n[:, None] * s_kl + d[None, :], mask=seen[:, None], other=0.0)
            scores = tl.where((kv == h)[:, None], _dot(query, tl.trans(k), IEEE) * scale, scores)
        scores = tl.where(seen[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        for h in tl.static_range(HB):  # each row's weights times its own head's values (exact zeros for the others)
            v = tl.load(values + h * s_kh + n[:, None] * s_kl + d[None, :], mask=seen[:, None], other=0.0)
            mine = tl.where((kv == h)[:, None], p, 0.0)
            acc = acc + _dot(mine if IEEE else mine.to(v.dtype), v, IEEE)
        m = m_new
    return m, total, acc


@triton.jit
def _store_heads(out, slot, first, group, r, rows, d, s_ob, s_oh, acc, total):
    """A program's output: its KV heads' query heads (rows r of the tile, masked by `rows`; `first` its first KV
    head), the online softmax's sum-weighted values divided by its sum, into (b, Q, D) `out`."""
    tl.store(out + slot * s_ob + (first * group + r)[:, None] * s_oh + d[None, :],
             (acc / total[:, None]).to(out.dtype.element_ty), mask=rows[:, None])


@triton.jit
def _decode_attention(q, keys, values, positions, out, s_qb, s_qh, s_ks, s_kh, s_kl, s_ob, s_oh, scale, group,
                      HB: tl.constexpr, D: tl.constexpr, G: tl.constexpr, KEYS: tl.constexpr, IEEE: tl.constexpr):
    slot, first = tl.program_id(0).to(tl.int64), tl.program_id(1) * HB  # the program's first KV head
    r = tl.arange(0, G)  # its KV heads' query heads, padded to a tile's G rows
    d = tl.arange(0, D)
    rows = r < HB * group
    query = tl.load(q + slot * s_qb + (first * group + r)[:, None] * s_qh + d[None, :], mask=rows[:, None], other=0.0)
    last = tl.load(positions + slot)  # the slot sees columns 0..last
    base = slot * s_ks + first * s_kh
    m, total, acc = _cached_columns(query, keys + base, values + base, s_kh, s_kl, last + 1, scale, r // group, HB, G,
                                    D, KEYS, IEEE)
    _store_heads(out, slot, first, group, r, rows, d, s_ob, s_oh, acc, total)


@triton.jit
def _rope_and_attend(qkv, cos, sin, positions, keys, values, out, s_row, s_pos, s_ks, s_kh, s_kl, s_ob, s_oh, scale,
                     group, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HB: tl.constexpr, D: tl.constexpr,
                     G: tl.constexpr, KEYS: tl.constexpr, IEEE: tl.constexpr):
    slot, first = tl.program_id(0).to(tl.int64), tl.program_id(1) * HB
    r = tl.arange(0, G)
    d = tl.arange(0, D)
    rows = r < HB * group
    kv = r // group  # each row's KV head among the program's
    last = tl.load(positions + slot)  # the new column: earlier ones come from the cache
    c = tl.load(cos + last * s_pos + d).to(tl.float32)
    s = tl.load(sin + last * s_pos + d).to(tl.float32)
    row = qkv + slot * s_row
    query = rope(row, first * group + r, rows, c, s, D).to(keys.dtype.element_ty)
    base = slot * s_ks + first * s_kh
    m, total, acc = _cached_columns(query, keys + base, values + base, s_kh, s_kl, last, scale, kv, HB, G, D, KEYS,
                                    IEEE)
    own = tl.zeros((G,), tl.float32)  # the new column's score and value for each row
    value = tl.zeros((G, D), tl.float32)
    for h in tl.static_range(HB):  # each KV head as a tile of one row: key and value (1, D)
        head = first + h + tl.arange(0, 1)
        key = rope(row + HEADS * D, head, head < KV_HEADS, c, s, D).to(keys.dtype.element_ty)
        new = tl.load(row + (HEADS + KV_HEADS + head)[:, None] * D + d[None, :]).to(values.dtype.element_ty)
        tl.store(keys + base + h * s_kh + last * s_kl + d[None, :], key)
        tl.store(values + base + h * s_kh + last * s_kl + d[None, :], new)
        mine = kv == h
        own = tl.where(mine, tl.sum(query.to(tl.float32) * key.to(tl.float32), axis=1) * scale, own)
        value = tl.where(mine[:, None], new.to(tl.float32), value)
    m_new = tl.maximum(m, own)
    alpha = tl.exp(m - m_new)
    p = tl.exp(own - m_new)
    total = total * alpha + p
    acc = acc * alpha[:, None] + p[:, None] * value
    _store_heads(out, slot, first, group, r, rows, d, s_ob, s_oh, acc, total)
