"""Advantage estimators: pure functions in a registry, keyed by `--advantage-estimator`.

Each takes the samples' rewards (B,), the per-token KL to the reference (B, R) or None, and the
response mask (B, R), and returns per-token advantages (B, R). Samples come group by group:
rows [g*n, (g+1)*n) answer the same prompt.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

EPS = 1e-6


def grpo_advantages(rewards: torch.Tensor, kl: torch.Tensor | None, mask: torch.Tensor, *,
                    group_size: int, kl_coef: float) -> torch.Tensor:
    """GRPO: each sample's reward normalised within its group, (r - mean) / (std + eps).

    With --kl-coef the reward is first shaped by the sample's summed KL to the reference. A group
    whose rewards are all equal has zero advantage: it carries no learning signal.
    """
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * (kl * mask).sum(-1)
    groups = rewards.view(-1, group_size)
    normalised = (groups - groups.mean(-1, keepdim=True)) / (groups.std(-1, keepdim=True) + EPS)
    return normalised.view(-1, 1) * mask


def reinforce_plus_plus_advantages(rewards: torch.Tensor, kl: torch.Tensor | None, mask: torch.Tensor, *,
                                   group_size: int, kl_coef: float) -> torch.Tensor:
    """REINFORCE++: token rewards -kl_coef * KL_t plus the outcome reward on the last response
    token; returns-to-go (gamma = 1); then whitened over every response token of the batch."""
    token_rewards = torch.zeros_like(mask, dtype=torch.float32)
    if kl is not None and kl_coef:
        token_rewards = -kl_coef * kl * mask
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & (mask > 0)  # (B, R) the final token
    token_rewards = token_rewards + last * rewards[:, None]
    returns = token_rewards.flip(-1).cumsum(-1).flip(-1) * mask
    n = mask.sum()
    mean = returns.sum() / n
    std = (((returns - mean) ** 2 * mask).sum() / (n - 1).clamp(min=1)).sqrt()
    return (returns - mean) / (std + EPS) * mask


AdvantageFn = Callable[..., torch.Tensor]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "gspo": grpo_advantages,  # GSPO differs from GRPO in the ratio (see losses.policy_loss), not here
    "reinforce_plus_plus": reinforce_plus_plus_advantages,
}
