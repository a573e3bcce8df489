"""Packed (thd) attention against padded (bshd) attention, forward + backward, one layer's shape.

    python3 benchmarks/varlen_attention.py [--seqs 64] [--len 384] [--heads 14] [--kv-heads 2] [--repeats 20]

Times, side by side in one run (CUDA, bf16; median of --repeats after warm-up):
- miles' packed path (`miles.utils.varlen.packed_causal_attention`, what `--qkv-format thd` runs), and
  which kernel it took (torch's `varlen_attn`, or one SDPA per sequence);
- the padded path a user would otherwise run: one batched `scaled_dot_product_attention(is_causal=True)`
  over (seqs, heads, len, dim), with GQA as SDPA's enable_gqa;
- the packed tokens scattered to that padded grid, one SDPA, gathered back
  (`miles.utils.varlen.padded_causal_attention`): padded attention's kernel, the copies included;
- the per-sequence SDPA loop (the fallback), so a slow figure says which one ran.
Sequence lengths are drawn between len/2 and len (seed 0); padded rows pad to len.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from miles.utils import varlen


def timed(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--len", type=int, default=384)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "a CUDA device is needed"
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(args.len // 2, args.len + 1, (args.seqs,), generator=g)
    total = int(lens.sum())
    cu = torch.zeros(args.seqs + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    cu = cu.cuda()
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(total, args.heads, args.dim, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(total, args.kv_heads, args.dim, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(total, args.kv_heads, args.dim, device=dev, dtype=dt, requires_grad=True)
    qp = torch.randn(args.seqs, args.heads, args.len, args.dim, device=dev, dtype=dt, requires_grad=True)
    kp = torch.randn(args.seqs, args.kv_heads, args.len, args.dim, device=dev, dtype=dt, requires_grad=True)
    vp = torch.randn(args.seqs, args.kv_heads, args.len, args.dim, device=dev, dtype=dt, requires_grad=True)
    scale = args.dim ** -0.5
    flash = varlen._flash_kwargs(q, scale)
    print(f"torch {torch.__version__}; varlen_attn parameters: {sorted(varlen._varlen_params())}")
    print(f"packed path takes: {varlen.kernel_for(q, scale)} {flash if flash is not None else ''}")

    def packed():
        varlen.packed_causal_attention(q, k, v, cu, args.len, scale).sum().backward()

    def padded():
        F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True).sum().backward()

    def padded_inside():
        varlen.padded_causal_attention(q, k, v, cu, args.len, scale).sum().backward()

    def loop():
        varlen.per_sequence_attention(q, k, v, cu, scale).sum().backward()

    rows = [("miles packed (thd)", timed(packed, args.repeats), total),
            ("padded SDPA (bshd)", timed(padded, args.repeats), args.seqs * args.len),
            ("thd scattered to padded SDPA", timed(padded_inside, args.repeats), total),
            ("per-sequence SDPA loop", timed(loop, args.repeats), total)]
    base = rows[1][1]
    print(f"{args.seqs} sequences, {total} real tokens ({args.seqs * args.len} padded), heads {args.heads}/"
          f"{args.kv_heads}, dim {args.dim}; forward + backward")
    for name, t, tokens in rows:
        print(f"  {name:26s} {t * 1e3:8.3f} ms  {tokens / t / 1e6:7.2f} M tok/s  {t / base:5.2f}x padded")


if __name__ == "__main__":
    main()
