"""The sampler's torch path, eager and compiled (--enable-torch-compile), and on a GPU with Triton the device
draw (`miles.utils.invariant.sample`: the plain path's sampler on a GPU), side by side in one run.

    python benchmarks/sampler_compiled.py [--batch 128] [--vocab 151936] [--device cuda]

Draws from random bf16 logits (scales 1 and 4: flat and peaked distributions) with one uniform per
row: prints how many tokens each sampler shares with the eager one, the largest log-prob difference,
and the time of a call of each (mean of 50, after a warm-up that compiles); on a GPU also the time of a
call replayed in a CUDA graph of 50 (no launch time), as the engine's decode steps run.
"""

from __future__ import annotations

import argparse
import time

import torch

from miles.config import SamplingParams
from miles.rollout import sampling as sampling_module
from miles.rollout.sampling import compiled_sample_tokens, sample_tokens
from miles.utils import invariant

sampling_module.DEVICE_DRAW = False  # "eager" and "compiled" are the torch path; "invariant" the device draw


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
    samplers = {"eager": sample_tokens, "compiled": compiled_sample_tokens}
    if args.device == "cuda" and invariant.available():
        samplers["invariant"] = lambda logits, sampling, u: invariant.sample(logits, u, sampling.temperature)
    agree = dict.fromkeys(samplers, 0)
    worst = dict.fromkeys(samplers, 0.0)
    total = 0
    for scale in (1.0, 4.0):
        for _ in range(args.draws):
            logits = (torch.randn(args.batch, args.vocab, generator=g, device=args.device) * scale).bfloat16()
            u = torch.rand(args.batch, generator=g, device=args.device, dtype=torch.float64)
            eager_tok, eager_logp = sample_tokens(logits, sampling, u)
            total += eager_tok.numel()
            for name, sample in samplers.items():
                tok, logp = sample(logits, sampling, u)
                agree[name] += int((tok == eager_tok).sum())
                worst[name] = max(worst[name], float((logp - eager_logp).abs().max()))
    print(f"batch {args.batch} x vocab {args.vocab} on {args.device}; tokens shared with the eager sampler, largest "
          f"log-prob difference, us a call")
    for name, sample in samplers.items():
        sync(args.device)
        start = time.perf_counter()
        for _ in range(50):
            sample(logits, sampling, u)
        sync(args.device)
        launched = (time.perf_counter() - start) / 50 * 1e6
        replayed = ""
        if args.device == "cuda":
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(50):
                        sample(logits, sampling, u)
                graph.replay()
                sync(args.device)
                start = time.perf_counter()
                graph.replay()
                sync(args.device)
                replayed = f", {(time.perf_counter() - start) / 50 * 1e6:,.0f} us in a CUDA graph"
            except RuntimeError as e:  # one sampler failing to capture must not lose the others' figures
                replayed = f", no CUDA graph ({str(e).splitlines()[0][:80]})"
        print(f"  {name:<9} {agree[name]}/{total} tokens, {worst[name]:.2e}; {launched:,.0f} us a call{replayed}")


if __name__ == "__main__":
    main()
