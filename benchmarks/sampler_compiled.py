"""The fast path's sampler, eager vs compiled (--enable-torch-compile), side by side in one run.

    python benchmarks/sampler_compiled.py [--batch 128] [--vocab 151936] [--device cuda]

Draws from random bf16 logits (scales 1 and 4: flat and peaked distributions) with one uniform per
row, by `sample_tokens` and by `compiled_sample_tokens`: prints how many tokens agree, the largest
log-prob difference, and the time of a call of each (mean of 50, after a warm-up that compiles).
"""

from __future__ import annotations

import argparse
import time

import torch

from miles.config import SamplingParams
from miles.rollout.sampling import compiled_sample_tokens, sample_tokens


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--draws", type=int, default=20, help="batches drawn per scale for the agreement count")
    args = p.parse_args()
    g = torch.Generator(device=args.device).manual_seed(0)
    sampling = SamplingParams(max_new_tokens=1, temperature=1.0, top_p=1.0)
    agree = total = 0
    worst = 0.0
    for scale in (1.0, 4.0):
        for _ in range(args.draws):
            logits = (torch.randn(args.batch, args.vocab, generator=g, device=args.device) * scale).bfloat16()
            u = torch.rand(args.batch, generator=g, device=args.device, dtype=torch.float64)
            eager_tok, eager_logp = sample_tokens(logits, sampling, u)
            tok, logp = compiled_sample_tokens(logits, sampling, u)
            agree += int((tok == eager_tok).sum())
            total += tok.numel()
            worst = max(worst, float((logp - eager_logp).abs().max()))
    print(f"batch {args.batch} x vocab {args.vocab} on {args.device}: compiled vs eager tokens agree {agree}/{total}, "
          f"max log-prob difference {worst:.2e}")
    for name, sample in (("eager", sample_tokens), ("compiled", compiled_sample_tokens)):
        sync(args.device)
        start = time.perf_counter()
        for _ in range(50):
            sample(logits, sampling, u)
        sync(args.device)
        print(f"  {name:<8} sampler: {(time.perf_counter() - start) / 50 * 1e6:,.0f} us a call")


if __name__ == "__main__":
    main()
