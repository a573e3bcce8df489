"""The CPU engine's decode GEMMs: torch's `F.linear` against oneDNN with the weight packed once (issue 13).

miles' CPU decode spends most of its time in fp32 GEMMs of a few rows (the decode batch) against each
weight. `F.linear` hands the weight to oneDNN in its plain layout at every call; oneDNN can also take it
reordered once into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the op Inductor's
CPU weight prepacking uses) and then run `torch.ops.mkldnn._linear_pointwise` on it. This prints both,
per GEMM shape of the demo model (SmolLM2-135M: hidden 576, ffn 1536, KV 192, vocab 49,152) at the
decode batch, and the largest difference between their outputs.

    python benchmarks/cpu_linear.py [--rows 32] [--calls 50] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {"q / o projection": (576, 576), "k / v projection": (576, 192), "gate / up": (576, 1536),
          "down": (1536, 576), "LM head": (576, 49152)}  # (in, out)


def per_call(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32, help="the decode batch")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"fp32, {args.rows} rows, {torch.get_num_threads()} threads; ms a call, median [min..max] of "
          f"{args.repeats} rounds of {args.calls} calls")
    print(f"{'GEMM':18}{'in x out':>14}{'F.linear':>25}{'prepacked':>25}{'speed-up':>10}{'max diff':>10}")
    for name, (k, n) in SHAPES.items():
        x, w = torch.randn(args.rows, k), torch.randn(n, k) / k ** 0.5
        packed = torch.ops.mkldnn._reorder_linear_weight(w, args.rows)
        plain = lambda: F.linear(x, w)  # noqa: E731
        prepacked = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
        a, b = [], []
        for _ in range(args.repeats):  # the two in turn
            a.append(per_call(plain, args.calls) * 1e3)
            b.append(per_call(prepacked, args.calls) * 1e3)
        diff = (plain() - prepacked()).abs().max().item()
        cell = lambda v: f"{statistics.median(v):.3f} [{min(v):.3f}..{max(v):.3f}]"  # noqa: E731
        print(f"{name:18}{f'{k} x {n}':>14}{cell(a):>25}{cell(b):>25}"
              f"{statistics.median(a) / statistics.median(b):>9.2f}x{diff:>10.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
