"""The behavioural weight check, for engines whose digests mean nothing (vLLM on CPU, SGLang).

A fixed probe sequence is scored by the trainer (`Trainer.prompt_log_probs`) and by every server
(`RemoteEngine.prompt_log_probs`, prompt log-probs at temperature 1); the weights are taken as
equal when no token's log-prob differs by more than the precision's tolerance. A server that did
not load the new weights, loaded them into the wrong tensors, or lost a buffer (rotary
frequencies) scores the probe differently: `checksum_ok=false` on the `weight_sync` line.
"""

from __future__ import annotations

import math

from miles.bridge.weight_sync import SyncStats

PROBE_TEXT = ("Weight probe. Question: what is 12 + 30? Answer: 42. The quick brown fox jumps over the lazy dog; "
              "1, 2, 3, 5, 8, 13, 21.")
# Max |log p| difference between engine and trainer on the same weights: fp32 kernels of two
# stacks differ in summation order only (measured ~1e-5 on the demo model, vLLM CPU vs PyTorch);
# bf16 rounding of activations costs more. An optimizer step at the demo's lr moves the probe by
# more than these (see tests/test_remote.py), so a server that kept the old weights fails.
TOLERANCE = {"fp32": 1e-3, "bf16": 5e-2}


def probe_tokens(tokenizer) -> list[int]:
    return tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]


def compare_probe(stats: SyncStats, trainer: list[float], engines: dict[str, list[float]], precision: str) -> None:
    """Sets stats.probe_max_diff and checksum_ok; each server beyond tolerance is listed as mismatched."""
    tolerance = TOLERANCE[precision]
    worst = 0.0
    for url, scores in engines.items():
        diff = max((abs(a - b) for a, b in zip(trainer, scores)), default=math.inf) \
            if len(scores) == len(trainer) else math.inf
        diff = diff if math.isfinite(diff) else math.inf
        worst = max(worst, diff)
        if not diff <= tolerance:
            stats.mismatched.append(f"{url}: probe log-probs differ from the trainer's by up to {diff:.2e} "
                                    f"(> {tolerance:g} for {precision})")
    stats.probe_max_diff = worst
    stats.checksum_ok = not stats.mismatched
