"""The fast engine's decode GEMMs on a GPU: a Triton matmul split over K, with the SiLU-and-multiply read in.

At a decode step's few hundred rows the layer's GEMMs have few output tiles: at 512 rows and Qwen2.5-0.5B's shape
the down projection (896 columns, K = 4864) is 28 tiles of 128 x 128 for 132 SMs, and cuBLAS ran the step's four
GEMMs at about half the matmul rate (BENCHMARKS.md). Here a program computes a BM x BN tile over a 1/SPLIT share of
K; with SPLIT > 1 the shares' fp32 sums go to a workspace and a second kernel adds them in a fixed order (so the
result does not depend on which program finishes first: --deterministic-mode's bits) and rounds once. With
`silu_mul` the GEMM reads the fused gate/up projection's output (N, 2F) and forms SiLU(gate) * up, rounded to its
dtype as decode_fused.silu_and_mul rounds it, as it loads each block: the down projection without its input's
round trip through memory.

Imported only where it runs (Triton with it): a CUDA GPU, or Triton's interpreter in the tests.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class Config(NamedTuple):
    bm: int  # rows a tile
    bn: int  # columns a tile
    bk: int  # K a block
    split: int  # shares of K, each its own program
    warps: int
    stages: int


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, config: Config,
           silu_mul: bool = False) -> torch.Tensor:
    """x (M, K) @ w (N, K).T (+ bias) -> (M, N) in x's dtype, accumulated in fp32 and rounded once, as F.linear.
    With `silu_mul`, x is (M, 2K) [gate | up] and the GEMM's input is SiLU(gate) * up, rounded to x's dtype."""
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("linear takes rows with contiguous columns")
    if x.shape[1] != (2 * k if silu_mul else k):
        raise ValueError(f"linear: x has {x.shape[1]} columns for a weight of {k}" + (" (silu_mul)" if silu_mul else ""))
    bm, bn, bk, split, warps, stages = config
    share = triton.cdiv(triton.cdiv(k, split), bk) * bk  # K a program, whole blocks
    split = triton.cdiv(k, share)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split)
    _gemm[grid](x, w, out, partial, bias if bias is not None else out, m, n, k, share, x.stride(0), w.stride(0),
                BM=bm, BN=bn, BK=bk, SPLIT=split > 1, BIAS=bias is not None, SILU=silu_mul,
                EVEN_K=k % bk == 0, num_warps=warps, num_stages=stages)
    if split > 1:
        block = 1024
        _reduce[(triton.cdiv(m * n, block),)](partial, out, bias if bias is not None else out, m * n, n, split,
                                              BLOCK=block, BIAS=bias is not None)
    return out


@triton.jit
def _gemm(x, w, out, partial, bias, M, N, K, share, s_x, s_w, BM: tl.constexpr, BN: tl.constexpr,
          BK: tl.constexpr, SPLIT: tl.constexpr, BIAS: tl.constexpr, SILU: tl.constexpr, EVEN_K: tl.constexpr):
    tiles_m = tl.cdiv(M, BM)
    tile, part = tl.program_id(0), tl.program_id(1)
    rm = (tile % tiles_m) * BM + tl.arange(0, BM)  # the row tiles of a column tile run side by side: its weights
    rn = (tile // tiles_m) * BN + tl.arange(0, BN)  # are read from L2 once
    rows, cols = rm < M, rn < N
    start = part * share
    end = tl.minimum(start + share, K)
    x_at = x + rm.to(tl.int64)[:, None] * s_x
    w_at = w + rn.to(tl.int64)[None, :] * s_w
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(start, end, BK):
        rk = k0 + tl.arange(0, BK)
        inside = rk < end  # always true with EVEN_K (the shares are whole blocks): the compiler drops it
        if EVEN_K:
            inside = rk >= 0
        a = tl.load(x_at + rk[None, :], mask=rows[:, None] & inside[None, :], other=0.0)
        if SILU:  # SiLU(gate) * up in fp32, rounded as decode_fused.silu_and_mul rounds it
            up = tl.load(x_at + K + rk[None, :], mask=rows[:, None] & inside[None, :], other=0.0).to(tl.float32)
            gate = a.to(tl.float32)
            a = (gate * tl.sigmoid(gate) * up).to(x.dtype.element_ty)
        b = tl.load(w_at + rk[:, None], mask=cols[None, :] & inside[:, None], other=0.0)
        acc = tl.dot(a, b, acc)
    at = rm.to(tl.int64)[:, None] * N + rn[None, :]
    inside = rows[:, None] & cols[None, :]
    if SPLIT:
        tl.store(partial + part.to(tl.int64) * M * N + at, acc, mask=inside)
    else:
        if BIAS:
            acc += tl.load(bias + rn, mask=cols, other=0.0).to(tl.float32)[None, :]
        tl.store(out + at, acc.to(out.dtype.element_ty), mask=inside)


@triton.jit
def _reduce(partial, out, bias, MN, N, SPLIT, BLOCK: tl.constexpr, BIAS: tl.constexpr):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = at < MN
    total = tl.load(partial + at, mask=inside, other=0.0)
    for s in range(1, SPLIT):  # in the shares' order: the same sum whichever program finished first
        total += tl.load(partial + s * MN + at, mask=inside, other=0.0)
    if BIAS:
        total += tl.load(bias + at % N, mask=inside, other=0.0).to(tl.float32)
    tl.store(out + at, total.to(out.dtype.element_ty), mask=inside)
