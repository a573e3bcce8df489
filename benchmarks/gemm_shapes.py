"""The fast engine's decode GEMMs alone, on the GPU: each projection of a Qwen2.5-0.5B layer (fused q/k/v with its bias,
output, fused gate/up, down) and the LM head at a decode batch, as the engine runs them (`F.linear`, cuBLAS) against
other ways to compute the same product: the weight stored transposed (`addmm` on a (K, N) weight), torch's BLAS
preference set to cuBLASLt, and Inductor's autotuned GEMM (torch.compile mode="max-autotune-no-cudagraphs", which
times cuBLAS and Triton templates for the exact shape and keeps the fastest; its choices print as it goes). Each GEMM
is timed in a CUDA graph of --layers calls, each on its own copy of the weight (a decode step reads every layer's
weight from memory once; one weight timed again and again would sit in L2), and printed as us a call, TFLOP/s, and %
of the bf16 matmul rate measured in the run, with the weight's bytes a second against the copy bandwidth.

    python benchmarks/gemm_shapes.py [--batch 128 512] [--layers 24] [--repeats 5] [--no-autotune]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from common import FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, VOCAB, copy_bandwidth, graph_times, matmul_flops

SHAPES = {  # name: (out features N, in features K, bias)
    "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, True),
    "o_proj": (HIDDEN, HEADS * HEAD_DIM, False),
    "gate_up": (2 * FFN, HIDDEN, False),
    "down": (HIDDEN, FFN, False),
    "lm_head": (VOCAB, HIDDEN, False),
}


def on_cublaslt(call):
    """CALL with torch's BLAS preference set to cuBLASLt (whose heuristics pick the kernel for every GEMM, where
    torch's default sends a GEMM without a bias to cuBLAS), put back after."""
    def lt():
        before = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            return call()
        finally:
            torch.backends.cuda.preferred_blas_library(before)
    return lt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--layers", type=int, default=24, help="weight copies a graph cycles through")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--no-autotune", action="store_true")
    args = ap.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    peak, bandwidth = matmul_flops(device, dtype), copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}: matmul {peak / 1e12:.0f} TFLOP/s, copy {bandwidth / 1e12:.2f} TB/s; "
          f"{args.layers} weight copies a graph; us a call: median [min, max] of {args.repeats} replays")
    tuned = None
    if not args.no_autotune:
        import torch._inductor.config as inductor

        inductor.max_autotune_gemm_backends = "ATEN,TRITON"
        tuned = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
    for batch in args.batch:
        for name in args.shapes:
            n, k, has_bias = SHAPES[name]
            copies = 1 if name == "lm_head" else args.layers  # the head is read once a step
            x = torch.randn(batch, k, device=device, dtype=dtype)
            ws = [torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5 for _ in range(copies)]
            bs = [torch.randn(n, device=device, dtype=dtype) if has_bias else None for _ in range(copies)]
            wts = [w.t().contiguous() for w in ws]  # (K, N)
            ways = {
                "F.linear": [lambda w=w, b=b: F.linear(x, w, b) for w, b in zip(ws, bs)],
                "addmm (K, N)": [(lambda wt=wt, b=b: torch.addmm(b, x, wt)) if b is not None
                                 else (lambda wt=wt: torch.mm(x, wt)) for wt, b in zip(wts, bs)],
            }
            ways["cuBLASLt"] = [on_cublaslt(call) for call in ways["F.linear"]]
            if tuned is not None:
                ways["max-autotune"] = [lambda w=w, b=b: tuned(x, w, b) for w, b in zip(ws, bs)]
            reference = F.linear(x, ws[0], bs[0]).float()
            flop, weight_bytes = 2 * batch * n * k, n * k * 2
            for way, calls in ways.items():
                diff = (calls[0]().float() - reference).abs().max().item()
                times = graph_times(calls, args.repeats)
                t = statistics.median(times)
                print(f"batch {batch:4d} {name:8s} ({batch}x{k} @ {k}x{n}) {way:13s} {t * 1e6:7.2f} us "
                      f"[{min(times) * 1e6:.2f}, {max(times) * 1e6:.2f}] | {flop / t / 1e12:6.1f} TFLOP/s "
                      f"{100 * flop / t / peak:5.1f}% of matmul | weight {weight_bytes / t / 1e9:6.0f} GB/s "
                      f"{100 * weight_bytes / t / bandwidth:5.1f}% of copy | max diff {diff:.3g}", flush=True)


if __name__ == "__main__":
    main()
