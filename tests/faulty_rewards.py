"""Rewards that misbehave on purpose, for the reliability tests (`--custom-rm-path faulty_rewards:NAME`)."""

import sys
import time

from miles.testing.rewards import digit_share


def nan_once(sample):
    """NaN for one sample of rollout 1 (its first prompt is "What is 2 + 1?" in the tiny task, in order)."""
    if "2 + 1?" in str(sample.prompt) and sample.index == 1:
        return float("nan")
    return digit_share(sample)


def nan_every_other_rollout(sample):
    """NaN for every sample of the rollouts of steps 2, 4, ... (made by the weights of steps 1, 3, ...; the weights
    are synced after every step, a skipped one too)."""
    return float("nan") if sample.weight_version % 2 else digit_share(sample)


def always_nan(sample):
    return float("nan")


def hangs(sample):
    time.sleep(3600)


def exits(sample):
    sys.exit(3)


def interrupts(sample):
    raise KeyboardInterrupt


def vandal(sample):
    """Edits the sample it is given: the trainer must not see the edit."""
    sample.tokens[:] = [0] * len(sample.tokens)
    sample.loss_mask[:] = [0] * len(sample.loss_mask)
    return digit_share(sample)


def crashes(sample):
    raise RuntimeError("reward service unreachable")
