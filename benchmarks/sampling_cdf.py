"""Cost and accuracy of the sampler's float64 inverse CDF against the float32 one it replaced.

    python benchmarks/sampling_cdf.py                  # GPU if there is one, else CPU
    python benchmarks/sampling_cdf.py --device cpu --batch 8 32

For each batch size, at Qwen's 151,936-token vocabulary and logits shaped like a trained LM's (a
few likely tokens, a long tail): the time of one `sample_tokens` call (float64 CDF, what miles
does) next to the same call with a float32 CDF (what it did before), median and spread over
`--repeats` runs; and the total variation between the distribution each samples and the softmax
it reports, with the count of tokens of probability above 1e-12 that can never be drawn.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from miles.config import SamplingParams
from miles.rollout.sampling import sample_tokens, sampling_cdf

VOCAB = 151_936


def float32_sample(logits: torch.Tensor, temperature: float, uniforms: torch.Tensor) -> torch.Tensor:
    """The sampler before: the same inverse CDF, cumulated in float32."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    cdf = log_probs.exp().cumsum(-1)
    target = (uniforms.to(cdf.device, torch.float32) * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)


def timed(fn, repeats: int, device: torch.device) -> list[float]:
    fn()  # warm-up: kernels, allocator
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def accuracy(log_probs: torch.Tensor, cdf: torch.Tensor) -> tuple[float, int]:
    """(max total variation over rows, tokens of probability > 1e-12 with a zero-width CDF interval)."""
    target = log_probs.double().exp()
    target = target / target.sum(-1, keepdim=True)
    cdf = cdf.double()
    sampled = torch.diff(cdf, dim=-1, prepend=torch.zeros_like(cdf[:, :1])) / cdf[:, -1:]
    tv = (0.5 * (sampled - target).abs().sum(-1)).max().item()
    return tv, int(((sampled <= 0) & (target > 1e-12)).sum().item())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[32, 128])
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    device = torch.device(args.device)
    sampling = SamplingParams(max_new_tokens=1, temperature=0.7, top_p=1.0)
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), vocab {VOCAB}, "
          f"{args.repeats} timed calls each (median [min, max] ms)")
    print(f"{'batch':>5} | {'float64 CDF (miles)':>24} | {'float32 CDF (before)':>24} | ratio | "
          f"{'TV f64':>8} {'TV f32':>8} | undrawable f64 / f32")
    for batch in args.batch:
        gen = torch.Generator(device=device).manual_seed(0)
        logits = torch.randn(batch, VOCAB, device=device, generator=gen) * 3
        logits[:, :8] += 12
        uniforms = torch.rand(batch, device=device, generator=gen, dtype=torch.float64)
        t64 = timed(lambda: sample_tokens(logits, sampling, uniforms), args.repeats, device)
        t32 = timed(lambda: float32_sample(logits, sampling.temperature, uniforms), args.repeats, device)
        log_probs = torch.log_softmax(logits / sampling.temperature, dim=-1)
        tv64, lost64 = accuracy(log_probs, sampling_cdf(log_probs, 1.0))
        tv32, lost32 = accuracy(log_probs, log_probs.exp().cumsum(-1))

        def ms(ts):
            return f"{statistics.median(ts) * 1e3:7.3f} [{min(ts) * 1e3:.3f}, {max(ts) * 1e3:.3f}]"

        print(f"{batch:>5} | {ms(t64):>24} | {ms(t32):>24} | {statistics.median(t64) / statistics.median(t32):5.2f} | "
              f"{tv64:8.1e} {tv32:8.1e} | {lost64} / {lost32}")


if __name__ == "__main__":
    main()
