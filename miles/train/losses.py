"""Policy-gradient losses and KL estimators: pure functions on (B, R) response-token tensors.

B is the number of samples, R the longest response; `mask` (B, R) is 1 on trained tokens.
How per-token values become one loss (per sample, or per token, over the global batch) is `aggregate`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


# -- KL(policy || ref) per token, from log-probs of the sampled tokens ---------------------------
# With log_ratio = log pi(y) - log ref(y) and y ~ pi (Schulman, "Approximating KL divergence"):

def kl_k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return log_probs - ref_log_probs  # unbiased, high variance, can be negative


def kl_k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_probs - ref_log_probs) ** 2  # biased, low variance, >= 0


def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    neg_log_ratio = ref_log_probs - log_probs
    return neg_log_ratio.exp() - 1 - neg_log_ratio  # unbiased, low variance, >= 0


def kl_low_var(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    # k3 with its input and output clamped, as in verl/slime: one token with a huge ratio
    # (exp(20) ~ 5e8) must not dominate the loss.
    neg_log_ratio = (ref_log_probs - log_probs).clamp(-20, 20)
    return (neg_log_ratio.exp() - 1 - neg_log_ratio).clamp(-10, 10)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "low_var_kl": kl_low_var,
}


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float,
    sequence_level_ratio: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO-clip surrogate, per token. Returns (loss, clipped, ppo_kl), each (B, R).

    `sequence_level_ratio` is GSPO: every token of a sample uses the sample's length-normalised
    ratio exp(mean_t(log pi - log pi_old)), while the gradient still flows through each token's
    log-prob (s_i * pi / sg(pi) has the value s_i and the gradient of GSPO).
    """
    log_ratio = log_probs - old_log_probs
    if sequence_level_ratio:
        seq_log_ratio = masked_mean(log_ratio, mask, dim=-1)[:, None]  # (B, 1)
        log_ratio = seq_log_ratio.detach() + log_probs - log_probs.detach()
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
    loss = torch.maximum(unclipped, clipped)
    return loss, (clipped > unclipped).float(), -log_ratio.detach()


def tis_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, clip: float):
    """Truncated importance sampling: weight min(pi_train / pi_engine, clip) per token, no gradient.

    Corrects for the engine sampling from a slightly different distribution than the trainer
    scores (precision, kernels). Returns (weights, was_clipped), each (B, R).
    """
    ratio = (old_log_probs - rollout_log_probs).exp()
    return ratio.clamp(max=clip).detach(), (ratio > clip).float()


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, *, samples_in_batch: int,
              tokens_in_batch: int | None = None) -> torch.Tensor:
    """One micro-batch's share of the global batch's loss (or metric).

    Per sample (tokens_in_batch None, the default): each sample's mean over its tokens, summed over
    samples and divided by the global batch's sample count; TRL's `loss_type="grpo"`.
    Per token (--calculate-per-token-loss, DAPO's aggregation): the sum over every trained token
    divided by the global batch's trained-token count; TRL's `loss_type="dapo"` (and `"bnpo"` when
    the micro-batch is the whole batch). Dividing by the global, not the micro-batch's, count makes
    gradient accumulation exact in both: eight micro-batches of one sum to the gradient of one of eight.
    """
    if tokens_in_batch is None:
        return masked_mean(per_token, mask, dim=-1).sum() / samples_in_batch
    return (per_token * mask).sum() / max(tokens_in_batch, 1)
