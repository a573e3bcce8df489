"""The batch-invariant kernels (miles.utils.invariant, --true-on-policy-mode on a GPU) against what runs
without the mode, on the Qwen2.5-0.5B shape: each matmul of a layer at the trainer's and the decode's row
counts (cuBLAS), packed attention over a micro-batch (torch's varlen_attn), the sampler's draw over the
151,936-token vocabulary (miles' plain sampler). Prints one table: median [min..max] of --repeats timed
calls after a warm-up, and the invariant kernel's time over the alternative's.

    python benchmarks/invariant_kernels.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, VOCAB  # noqa: E402

from miles.rollout.sampling import _plain_sample  # noqa: E402
from miles.utils import invariant  # noqa: E402
from miles.utils.varlen import packed_causal_attention  # noqa: E402


def timed(fn, repeats: int) -> list[float]:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return times


def spread(times: list[float]) -> str:
    return f"{statistics.median(times) * 1e3:8.3f} [{min(times) * 1e3:.3f}..{max(times) * 1e3:.3f}]"


def cases(rows_train: int, rows_decode: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    for rows, where in ((rows_train, "trainer"), (rows_decode, "decode")):
        for name, (n, k) in {"qkv": (HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN), "gate_up": (2 * FFN, HIDDEN),
                             "down": (HIDDEN, FFN), "lm_head": (VOCAB, HIDDEN)}.items():
            a = torch.randn(rows, k, generator=g, **bf16)
            w = torch.randn(n, k, generator=g, **bf16)
            flops = 2 * rows * n * k
            yield f"matmul {name} {where} ({rows} x {k} x {n})", flops, lambda a=a, w=w: torch.mm(a, w.t()), \
                lambda a=a, w=w: invariant.mm(a, w.t())
    lengths = [384] * 8
    t = sum(lengths)
    q = torch.randn(t, HEADS, HEAD_DIM, generator=g, **bf16)
    k, v = (torch.randn(t, KV_HEADS, HEAD_DIM, generator=g, **bf16) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    flops = 4 * sum(n * (n + 1) // 2 for n in lengths) * HEADS * HEAD_DIM
    yield "attention packed 8 x 384", flops, lambda: packed_causal_attention(q, k, v, cu, 384, None), \
        lambda: invariant.packed_attention(q, k, v, cu)
    logits = torch.randn(rows_decode, VOCAB, generator=g, **bf16)
    u = torch.rand(rows_decode, generator=g, device="cuda", dtype=torch.float64)
    yield f"sampler {rows_decode} x {VOCAB}", 0, lambda: _plain_sample(logits, u, 1.0), \
        lambda: invariant.sample(logits, u, 1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--trainer-rows", type=int, default=8 * 384)
    ap.add_argument("--decode-rows", type=int, default=64)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms per call, median [min..max] of "
          f"{args.repeats}")
    print(f"{'':44}{'without the mode':>28}{'batch-invariant':>28}{'ratio':>8}{'TFLOP/s':>16}")
    for label, flops, plain, inv in cases(args.trainer_rows, args.decode_rows):
        a, b = timed(plain, args.repeats), timed(inv, args.repeats)
        ratio = statistics.median(b) / statistics.median(a)
        tf = (f"{flops / statistics.median(a) / 1e12:6.0f} / {flops / statistics.median(b) / 1e12:<6.0f}"
              if flops else "")
        print(f"{label:44}{spread(a):>28}{spread(b):>28}{ratio:7.2f}x{tf:>16}", flush=True)


if __name__ == "__main__":
    main()
