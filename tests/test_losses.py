"""The maths of the training side against values computed by hand."""

import math

import pytest
import torch

from miles.train.advantages import grpo_advantages, reinforce_plus_plus_advantages
from miles.train.losses import KL_ESTIMATORS, aggregate, masked_mean, policy_loss, tis_weights

T = torch.tensor


@pytest.mark.parametrize("kind, expected", [
    ("k1", 0.5),                                # log p - log ref = -1 - (-1.5)
    ("k2", 0.125),                              # 0.5 * 0.5^2
    ("k3", math.exp(-0.5) - 1 + 0.5),           # e^(ref - p) - 1 - (ref - p)
    ("low_var_kl", math.exp(-0.5) - 1 + 0.5),   # k3 while nothing is clamped
])
def test_kl_estimators(kind, expected):
    kl = KL_ESTIMATORS[kind](T([-1.0]), T([-1.5]))
    assert kl.item() == pytest.approx(expected, abs=1e-7)


def test_kl_estimators_are_zero_on_equal_log_probs():
    logp = T([-0.3, -2.0, -7.5])
    for kind, fn in KL_ESTIMATORS.items():
        assert torch.equal(fn(logp, logp.clone()), torch.zeros(3)), kind


def test_low_var_kl_clamps():
    # ref - p = -30 is clamped to -20, then e^-20 - 1 + 20 = 19.0 is clamped to 10.
    assert KL_ESTIMATORS["low_var_kl"](T([0.0]), T([-30.0])).item() == 10.0
    assert KL_ESTIMATORS["k3"](T([0.0]), T([-30.0])).item() == pytest.approx(29.0, abs=1e-5)


def test_low_var_kl_gradient_stays_finite_on_a_huge_ratio():
    # ref - p = 100: e^100 overflows fp32; the input clamp keeps the clamped output's gradient 0, not 0 * inf = NaN.
    logp = T([-100.0], requires_grad=True)
    KL_ESTIMATORS["low_var_kl"](logp, T([0.0])).sum().backward()
    assert torch.isfinite(logp.grad).all()


@pytest.mark.parametrize("ratio, adv, loss, clipped", [
    (1.5, 1.0, -1.2, 1.0),   # good sample pushed too far up: clipped at 1 + 0.2
    (1.5, -1.0, 1.5, 0.0),   # bad sample whose ratio grew: the unclipped (larger) loss wins
    (0.5, 1.0, -0.5, 0.0),   # good sample whose ratio fell: unclipped
    (0.5, -1.0, 0.8, 1.0),   # bad sample pushed too far down: clipped at 1 - 0.2
    (1.0, 2.0, -2.0, 0.0),   # on-policy: loss = -A
])
def test_ppo_clip(ratio, adv, loss, clipped):
    logp = T([[math.log(ratio)]])
    out, was_clipped, ppo_kl = policy_loss(logp, T([[0.0]]), T([[adv]]), T([[1.0]]), eps_clip=0.2, eps_clip_high=0.2)
    assert out.item() == pytest.approx(loss, abs=1e-6)
    assert was_clipped.item() == clipped
    assert ppo_kl.item() == pytest.approx(-math.log(ratio), abs=1e-6)


def test_ppo_clip_asymmetric_high():
    # eps_clip_high (DAPO's clip-higher) only moves the upper bound: ratio 1.5, A = 1 -> -1.28.
    out, _, _ = policy_loss(T([[math.log(1.5)]]), T([[0.0]]), T([[1.0]]), T([[1.0]]), eps_clip=0.2, eps_clip_high=0.28)
    assert out.item() == pytest.approx(-1.28, abs=1e-6)


def test_gspo_uses_the_sequence_ratio():
    # Token log-ratios 0.2 and 0.0 (the pad token is masked): every token uses exp(0.1).
    logp = T([[0.2, 0.0, 5.0]], requires_grad=True)
    mask = T([[1.0, 1.0, 0.0]])
    out, _, _ = policy_loss(logp, torch.zeros(1, 3), torch.ones(1, 3), mask, eps_clip=1.0, eps_clip_high=1.0,
                            sequence_level_ratio=True)
    assert out[0, :2].tolist() == pytest.approx([-math.exp(0.1)] * 2, abs=1e-6)
    out[0, :2].sum().backward()
    # d/dlogp_t of -s * pi_t / sg(pi_t) is -s on each token.
    assert logp.grad[0, :2].tolist() == pytest.approx([-math.exp(0.1)] * 2, abs=1e-6)


def test_grpo_advantages():
    # Group [1, 0, 0, 0]: mean 0.25, unbiased std 0.5 -> [1.5, -0.5, -0.5, -0.5].
    # Group [1, 1, 1, 1]: all equal -> no signal.
    rewards = T([1.0, 0, 0, 0, 1, 1, 1, 1])
    mask = torch.ones(8, 3)
    mask[1, 2] = 0
    adv = grpo_advantages(rewards, None, mask, group_size=4, kl_coef=0.0)
    assert adv[:, 0].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0], abs=1e-5)
    assert adv[1, 2].item() == 0.0  # masked tokens carry no advantage


def test_grpo_kl_reward_shaping():
    # Summed KL per sample [2, 0] with kl_coef 0.5 -> shaped rewards [0, 1]; normalised [-0.707, 0.707].
    kl = T([[1.0, 1.0], [0.0, 0.0]])
    adv = grpo_advantages(T([1.0, 1.0]), kl, torch.ones(2, 2), group_size=2, kl_coef=0.5)
    assert adv[:, 0].tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)], abs=1e-5)


def test_reinforce_plus_plus_advantages():
    # Sample 0: 2 tokens, reward 1 -> returns [1, 1]; sample 1: 1 token, reward 0 -> [0].
    # Over the 3 tokens: mean 2/3, unbiased std sqrt(1/3) -> [0.577, 0.577, -1.155].
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    adv = reinforce_plus_plus_advantages(T([1.0, 0.0]), None, mask, group_size=1, kl_coef=0.0)
    s = math.sqrt(1 / 3)
    assert adv.tolist() == [pytest.approx([(1 - 2 / 3) / s] * 2, abs=1e-4),
                            pytest.approx([(-2 / 3) / s, 0.0], abs=1e-4)]


def test_reinforce_plus_plus_kl_penalty_accumulates_backwards():
    # kl_coef 1, KL [0.5, 0.25] on a 2-token sample, reward 1: token rewards [-0.5, 0.75],
    # returns-to-go [0.25, 0.75]; whitened over two tokens -> [-0.707, 0.707].
    adv = reinforce_plus_plus_advantages(T([1.0]), T([[0.5, 0.25]]), torch.ones(1, 2), group_size=1, kl_coef=1.0)
    assert adv[0].tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)], abs=1e-4)


def test_tis_weights():
    w, clipped = tis_weights(T([[0.0, 0.0]]), T([[math.log(4.0), -math.log(4.0)]]), clip=2.0)
    assert w.tolist() == [pytest.approx([0.25, 2.0])]  # ratio 4 is truncated to 2
    assert clipped.tolist() == [[0.0, 1.0]]


def test_aggregate_is_accumulation_invariant():
    per_token = torch.randn(8, 5)
    mask = (torch.rand(8, 5) > 0.3).float()
    mask[:, 0] = 1
    whole = aggregate(per_token, mask, samples_in_batch=8)
    parts = sum(aggregate(per_token[i : i + 2], mask[i : i + 2], samples_in_batch=8) for i in range(0, 8, 2))
    assert whole.item() == pytest.approx(parts.item(), abs=1e-6)
    # And it is the mean over samples of each sample's token mean.
    assert whole.item() == pytest.approx(masked_mean(per_token, mask, dim=-1).mean().item(), abs=1e-6)


def test_per_token_aggregate_by_hand():
    # Sample 0: tokens [1, 3] (2 trained); sample 1: token [8] (1 trained, 1 masked).
    per_token = T([[1.0, 3.0], [8.0, 100.0]])
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    # Per token (DAPO): (1 + 3 + 8) / 3 tokens = 4; per sample (GRPO): (2 + 8) / 2 samples = 5.
    assert aggregate(per_token, mask, samples_in_batch=2, tokens_in_batch=3).item() == pytest.approx(4.0)
    assert aggregate(per_token, mask, samples_in_batch=2).item() == pytest.approx(5.0)
    # Accumulated over micro-batches of one sample, each divided by the global batch's token count.
    parts = [aggregate(per_token[i:i + 1], mask[i:i + 1], samples_in_batch=2, tokens_in_batch=3) for i in (0, 1)]
    assert sum(p.item() for p in parts) == pytest.approx(4.0)
