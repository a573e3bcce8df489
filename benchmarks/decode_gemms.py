"""The decode step's four GEMMs alone: cuBLAS (what F.linear runs) against miles' split-K Triton matmul
(miles.rollout.local.decode_gemm) at a sweep of tiles and K splits, and the down projection with the SiLU-and-multiply
read into the GEMM against decode_fused.silu_and_mul + cuBLAS. Times are of a call replayed in a CUDA graph (no
launch time, as the engine's captured steps run); each Triton result is checked against F.linear.

    python benchmarks/decode_gemms.py [--batch 128 512] [--top 3]

Shape: Qwen2.5-0.5B's layer (hidden 896, 14 + 2 + 2 heads of 64: qkv 1152 columns with a bias, MLP 4864), bf16.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from common import gpu_times

from miles.rollout.local.decode_fused import silu_and_mul
from miles.rollout.local.decode_gemm import Config, linear

HIDDEN, QKV, MLP = 896, 1152, 4864
SHAPES = {"qkv": (QKV, HIDDEN, True), "o": (HIDDEN, HIDDEN, False), "gate_up": (2 * MLP, HIDDEN, False),
          "down": (HIDDEN, MLP, False)}  # name: (N, K, bias)
TILES = [(64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4),
         (32, 64, 128, 4, 4), (64, 64, 128, 4, 3), (32, 128, 64, 4, 4), (64, 128, 128, 8, 3), (128, 128, 128, 8, 3)]
SPLITS = [1, 2, 4, 8]


def us(fn) -> float:
    return statistics.median(gpu_times(fn)) * 1e6


def sweep(x, w, b, want, silu: bool) -> list[tuple[float, Config, float]]:
    """(us, config, largest difference from `want`) of every tile and split, fastest first."""
    results = []
    for bm, bn, bk, warps, stages in TILES:
        for split in SPLITS:
            config = Config(bm, bn, bk, split, warps, stages)
            try:
                diff = (linear(x, w, b, config=config, silu_mul=silu).float() - want).abs().max().item()
                results.append((us(lambda: linear(x, w, b, config=config, silu_mul=silu)), config, diff))
            except Exception as e:  # a tile too large for the SM's shared memory
                print(f"  {config}: {type(e).__name__}", flush=True)
    return sorted(results, key=lambda r: r[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--top", type=int, default=3, help="fastest Triton configurations printed a shape")
    args = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    g = torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for m in args.batch:
        total_cublas = total_best = 0.0
        for name, (n, k, has_bias) in SHAPES.items():
            w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dev, dtype)
            b = torch.randn(n, generator=g).to(dev, dtype) if has_bias else None
            x = torch.randn(m, k, generator=g).to(dev, dtype)
            want = F.linear(x, w, b).float()
            cublas = us(lambda: F.linear(x, w, b))
            flops = 2 * m * n * k
            results = sweep(x, w, b, want, silu=False)
            best = min(cublas, results[0][0])
            total_cublas, total_best = total_cublas + cublas, total_best + best
            print(f"batch {m:4} {name:>8} ({m}x{n}x{k}): cuBLAS {cublas:6.1f} us ({flops / cublas / 1e6:5.0f} TFLOP/s)",
                  flush=True)
            for t, config, diff in results[: args.top]:
                print(f"    Triton {t:6.1f} us ({cublas / t:.2f}x cuBLAS) {tuple(config)} max diff {diff:.2e}",
                      flush=True)
            if name == "down":  # the SiLU-and-multiply read into the GEMM
                gate_up = torch.randn(m, 2 * k, generator=g).to(dev, dtype)
                want = F.linear(silu_and_mul(gate_up), w).float()
                apart = us(lambda: F.linear(silu_and_mul(gate_up), w))
                fused = sweep(gate_up, w, None, want, silu=True)
                print(f"batch {m:4} silu+down: silu_and_mul + cuBLAS {apart:6.1f} us", flush=True)
                for t, config, diff in fused[: args.top]:
                    print(f"    Triton, SiLU read in {t:6.1f} us ({apart / t:.2f}x) {tuple(config)} max diff {diff:.2e}",
                          flush=True)
        print(f"batch {m:4}: the four GEMMs {total_cublas:.1f} us in cuBLAS, {total_best:.1f} us at the faster of each "
              f"({total_cublas / total_best:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
