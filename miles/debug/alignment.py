"""The step-1 `Alignment check`: is this run numerically sane before it burns a day?

After the first step, each check measures one thing the debugging guide says to look at first,
and prints one line: PASS, WARN or FAIL, the measured value, and for WARN/FAIL the likely culprit
and the fix. `--alignment-check error` turns any FAIL into exit status 3.

The checks are pure functions of numbers (bands below), so each is testable by hand; `run_checks`
gathers those numbers from the first step's samples and trainer diagnostics. A non-finite value
(NaN, Inf) is a FAIL in every check: no band can vouch for it.

A resumed run makes its checks at its first step, not at step 1: every check still holds there
except `log_probs vs ref` against a reference model (the policy has trained away from it), which
is reported as SKIP with the reason.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from miles.bridge.types import Sample, mean_rollout_log_prob
from miles.errors import CheckFailed

logger = logging.getLogger("miles")

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"


@dataclass
class Check:
    name: str
    verdict: str
    value: str
    culprit: str = ""
    fix: str = ""

    def line(self) -> str:
        text = f"Alignment check | {self.name:<24} | {self.verdict} | {self.value}"
        if self.verdict in (WARN, FAIL):
            text += f" | likely culprit: {self.culprit} | fix: {self.fix}"
        return text


NONFINITE_CULPRIT = "non-finite values (NaN/Inf): a NaN/Inf weight in the model, or an overflow in low precision"
NONFINITE_FIX = ("check the weights for NaN/Inf (`miles check-weights` against the base model); --precision fp32 "
                 "to confirm an overflow")


def _nonfinite(name: str, value: str, *numbers: float) -> Check | None:
    """The FAIL every check gives when one of its numbers is NaN or Inf; None when all are finite."""
    if all(math.isfinite(x) for x in numbers):
        return None
    return Check(name, FAIL, value, NONFINITE_CULPRIT, NONFINITE_FIX)


# -- a. rollout coherence -----------------------------------------------------------------------

def check_coherence(nll_per_token: float, vocab_size: int, repetition: float, replacement_frac: float,
                    scorer: str) -> Check:
    """Gibberish detector. A model whose weights did not load predicts near-uniformly: its NLL per
    token approaches ln(vocab). Degenerate loops and U+FFFD characters are the other signatures."""
    uniform = math.log(vocab_size)
    value = (f"{scorer} NLL {nll_per_token:.2f}/token (uniform would be {uniform:.1f}), repeated 4-grams "
             f"{repetition:.0%}, replacement chars in {replacement_frac:.0%} of responses")
    if bad := _nonfinite("rollout coherence", value, nll_per_token):
        return bad
    if nll_per_token > 0.75 * uniform:
        return Check("rollout coherence", FAIL, value,
                     "the model predicts near-uniformly: parameters did not load (or a layer mapping is wrong)",
                     "check train.log for `Loaded checkpoint from`; fix --hf-checkpoint / --load / --ref-load; "
                     "compare weights with `miles check-weights`")
    problems = []
    if nll_per_token > 4.0:
        problems.append("responses are very unlikely under the model")
    if repetition > 0.5:
        problems.append("responses loop")
    if replacement_frac > 0.05:
        problems.append("responses hold U+FFFD (broken bytes)")
    if problems:
        return Check("rollout coherence", WARN, value,
                     "; ".join(problems) + ": parameter mapping wrong, buffers dropped after weight sync, or a "
                     "pretrained (not instruct) model behind a chat template",
                     "read the samples (`--debug-rollout-print-every 1`, `miles inspect-rollout`); "
                     "`--check-weight-update-equal`; try the instruct model")
    return Check("rollout coherence", PASS, value)


# -- b. log_probs vs ref_log_probs --------------------------------------------------------------

def check_policy_vs_ref(max_diff: float, kl: float, against: str) -> Check:
    """At step 1 the actor and the reference hold the same weights: their log-probs must agree."""
    value = f"max |log_probs - {against}| {max_diff:.3g}, KL {kl:.3g}"
    if bad := _nonfinite("log_probs vs ref", value, max_diff, kl):
        return bad
    if max_diff == 0:
        return Check("log_probs vs ref", PASS, value + " (bitwise equal)")
    if max_diff < 1e-4:
        return Check("log_probs vs ref", PASS, value + " (kernel jitter)")
    if max_diff <= 1:
        return Check("log_probs vs ref", WARN, value,
                     "non-deterministic kernels (fused/flash attention, atomics) or a lower-precision path in "
                     "one of the two forwards",
                     "--attention-backend eager (deterministic) or --deterministic-mode; same --precision for both")
    return Check("log_probs vs ref", FAIL, value,
                 "configuration: the two models differ (another --ref-load checkpoint, precision, or parallelism)",
                 "point --ref-load at the initial policy (or leave it unset); re-check --precision")


# -- c. trainer vs engine -----------------------------------------------------------------------

def train_engine_bound(precision: str) -> float:
    """The mean train/engine log-prob gap rounding explains: fp32 ~1e-3, bf16/fp16 ~5e-2."""
    return 1e-3 if precision == "fp32" else 0.05


def check_train_vs_engine(mean_diff: float, max_diff: float, precision: str) -> Check:
    """The engine samples; the trainer scores. Their log-probs of the same tokens should agree to
    fp32 rounding in fp32, and to bf16 rounding (~1e-2 per token on average) in bf16."""
    value = f"train_rollout_logprob_abs_diff {mean_diff:.3g}, forward_logp_max_diff {max_diff:.3g} ({precision})"
    if bad := _nonfinite("trainer vs engine", value, mean_diff, max_diff):
        return bad
    if mean_diff > 0.3 or max_diff > 5:
        return Check("trainer vs engine", FAIL, value,
                     "the engine's weights are not the trainer's: a weight-sync / parameter-mapping bug or dropped "
                     "buffers in the engine",
                     "--check-weight-update-equal; `miles check-weights`; compare engine buffers")
    bound = train_engine_bound(precision)
    if mean_diff > bound:
        return Check("trainer vs engine", WARN, value,
                     f"precision mismatch between engine and trainer beyond {precision} rounding",
                     "--use-tis to correct the off-policy gap; same --precision and --attention-backend on both")
    return Check("trainer vs engine", PASS, value)


# -- d. response NLL on an instruct model -------------------------------------------------------

NLL_WARN = 1.5  # per token; the guide's "slightly elevated" is ~0.8 on large instruct models


def check_response_nll(nll_per_token: float, has_template: bool, applied_template: bool) -> Check:
    """Responses an instruct model finds unlikely usually mean its prompts are not in the format it
    was trained on. The cheapest such mistake to spot is structural: a template left unused."""
    value = f"{nll_per_token:.2f}/token"
    if bad := _nonfinite("response NLL", value, nll_per_token):
        return bad
    if has_template and not applied_template:
        return Check("response NLL", WARN, value + " (prompts sent without the model's chat template)",
                     "chat-template mismatch: the model has a chat template but prompts are sent raw",
                     "--apply-chat-template; then `miles verify-chat-template --model DIR`")
    if nll_per_token > NLL_WARN:
        return Check("response NLL", WARN, value,
                     "far above normal: prompts do not look like what the model was trained on (chat-template "
                     "mismatch), or a pretrained model where an instruct one is expected",
                     "`miles verify-chat-template --model DIR`; check --input-key holds the user turn")
    return Check("response NLL", PASS, value)


# -- e. grad_norm -------------------------------------------------------------------------------

GRAD_NORM_WARN = 100.0


def check_grad_norm(grad_norm: float) -> Check:
    value = f"{grad_norm:.4g}"
    if not math.isfinite(grad_norm):
        return Check("grad_norm", FAIL, value, "NaN/Inf gradients: a bad chat template or activation overflow "
                     "(low precision)", "--precision fp32 to confirm; `miles verify-chat-template`; lower --lr")
    if grad_norm > GRAD_NORM_WARN:
        return Check("grad_norm", WARN, value, "far above normal for step 1: a bad chat template, an activation "
                     "overflow, or a broken reward signal", "`miles verify-chat-template`; --clip-grad; check rewards")
    if grad_norm == 0:
        return Check("grad_norm", WARN, value, "no gradient: every group's rewards are equal, so every advantage is 0",
                     "see the reward-signal check")
    return Check("grad_norm", PASS, value)


# -- f. reward signal ---------------------------------------------------------------------------

@dataclass
class RewardStats:
    n: int
    groups: int
    mixed_groups: int  # groups whose rewards differ: the only ones GRPO learns from
    distinct: list[float] = field(default_factory=list)
    missing_labels: int = 0
    unparsable: int | None = None  # responses with no final answer (math reward only)
    label_key: str | None = None
    nonfinite: int = 0  # rewards that are NaN or Inf


def check_reward_signal(s: RewardStats) -> Check:
    shown = ", ".join(f"{r:.3g}" for r in s.distinct[:4]) + (", ..." if len(s.distinct) > 4 else "")
    value = (f"{len(s.distinct)} distinct reward(s) [{shown}] over {s.n} samples, "
             f"{s.mixed_groups}/{s.groups} groups mixed, labels missing {s.missing_labels}/{s.n}")
    if s.unparsable is not None:
        value += f", no parsable answer in {s.unparsable}/{s.n} responses"
    if s.nonfinite:
        return Check("reward signal", FAIL, value + f", {s.nonfinite}/{s.n} rewards NaN/Inf",
                     "the reward function returned NaN/Inf: every advantage of that group, and the update, is NaN",
                     "fix the reward function (`miles inspect-rollout` shows which samples); return a finite number")
    if s.missing_labels == s.n:
        return Check("reward signal", FAIL, value, f"no sample has a label: --label-key {s.label_key!r} is wrong "
                     "or the data has none", "pass the data's label key to --label-key")
    if len(s.distinct) == 1:
        culprit = (f"every reward is {s.distinct[0]}: " + ("the responses hold no parsable answer (answer format)"
                   if s.unparsable == s.n else "the reward never fires (label format or answer format)"))
        return Check("reward signal", FAIL if s.unparsable == s.n else WARN, value, culprit,
                     "read samples with `--debug-rollout-print-every 1`; check --label-key, --rm-type, the prompt's "
                     "answer instructions")
    if s.missing_labels or (s.unparsable is not None and s.unparsable > s.n / 2) or s.mixed_groups == 0:
        return Check("reward signal", WARN, value, "a weak reward signal: labels missing in some rows, most responses "
                     "unparsable, or no group with mixed rewards",
                     "check --label-key on every row; prompt for a final answer; more samples per prompt")
    return Check("reward signal", PASS, value)


# -- g. MoE routing ------------------------------------------------------------------------------

ROUTING_FAIL = 0.5  # more than half the routes differ: the engine's routers are not the trainer's


def check_routing(mismatch: float | None, replay: bool, moe_without_routes: bool = False) -> Check:
    """An MoE policy routes each token to k experts; when the trainer's router picks other experts
    than the engine's did, the trainer scores and trains a policy that did not generate the data
    (the guide: MoE training collapses after ~50 steps without routing replay)."""
    if moe_without_routes:
        return Check("MoE routing", WARN, "an MoE model, but the rollout carries no routes to compare",
                     "the engine did not return its expert choices, so routing cannot be replayed or checked",
                     "miles' local engine and `miles serve` return them; start SGLang or vLLM with "
                     "--enable-return-routed-experts; then --use-rollout-routing-replay")
    value = (f"routing_mismatch_frac {mismatch:.3g} (token-layer routes where the trainer's own top-k differs "
             f"from the engine's), replay {'on' if replay else 'off'}")
    if bad := _nonfinite("MoE routing", value, mismatch):
        return bad
    if mismatch > ROUTING_FAIL:
        return Check("MoE routing", FAIL, value,
                     "the engine's routers are not the trainer's: a weight-sync / parameter-mapping bug in the "
                     "router weights", "--check-weight-update-equal; `miles check-weights`")
    if mismatch == 0:
        return Check("MoE routing", PASS, value + ": every route agrees")
    if replay:
        return Check("MoE routing", PASS, value + ": the trainer follows the engine's experts")
    return Check("MoE routing", WARN, value,
                 "MoE routing not preserved: the trainer routes these tokens to other experts than the engine "
                 "chose, so it optimises a policy that did not generate the data (MoE collapse after ~50 steps)",
                 "--use-rollout-routing-replay (R3: replay the engine's expert choices in training)")


# -- gathering the numbers and reporting ---------------------------------------------------------

def repetition_rate(tokens: list[int], n: int = 4) -> float:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def reward_stats(samples: list[Sample], rm_type: str | None, label_key: str | None) -> RewardStats:
    groups: dict[int, set[float]] = {}
    for s in samples:
        groups.setdefault(s.group_index, set()).add(s.reward)
    unparsable = None
    if rm_type == "math":
        from miles.rollout.rewards import has_answer

        unparsable = sum(not has_answer(s.response) for s in samples)
    finite = {s.reward for s in samples if math.isfinite(s.reward)}
    return RewardStats(len(samples), len(groups), sum(len(r) > 1 for r in groups.values()), sorted(finite),
                       sum(s.label is None for s in samples), unparsable, label_key,
                       sum(not math.isfinite(s.reward) for s in samples))


def report(checks: list[Check], mode: str, step: int, explain: Callable[[], object] | None = None) -> None:
    """Logs the report, then `explain()` when the trainer-vs-engine check is WARN/FAIL (the mismatch
    attribution); raises CheckFailed (exit 3) on a FAIL when mode is `error`."""
    logger.info("Alignment check after step %d (--alignment-check %s):", step, mode)
    for c in checks:
        (logger.warning if c.verdict in (WARN, FAIL) else logger.info)(c.line())
    counts = {v: sum(c.verdict == v for c in checks) for v in (PASS, WARN, FAIL)}
    logger.info("Alignment check: %d PASS, %d WARN, %d FAIL", counts[PASS], counts[WARN], counts[FAIL])
    if explain is not None and any(c.name == "trainer vs engine" and c.verdict in (WARN, FAIL) for c in checks):
        explain()
    if counts[FAIL] and mode == "error":
        failed = ", ".join(c.name for c in checks if c.verdict == FAIL)
        raise CheckFailed(f"alignment check failed: {failed} (see the `Alignment check` lines in train.log)")


@dataclass(kw_only=True)
class CheckContext:
    """What the checks need to know about the run besides the step's numbers."""

    vocab_size: int
    precision: str
    has_template: bool
    applied_template: bool
    rm_type: str | None
    label_key: str | None


def run_checks(samples: list[Sample], metrics: dict[str, float], diag, ctx: CheckContext,
               resumed_after: int = 0) -> list[Check]:
    """Every check that the run's sides allow: no trainer (rollout-only) means a and f only.
    `resumed_after` K > 0: the run resumed after step K (see the module docstring)."""
    from miles.train.losses import kl_k3, masked_mean

    checks = []
    repetition = sum(repetition_rate(s.response_tokens) for s in samples) / len(samples)
    replacement = sum("\ufffd" in s.response for s in samples) / len(samples)
    if diag is not None:
        nll, scorer = -masked_mean(diag.old_log_probs, diag.mask).item(), "trainer"
    else:
        mean_logp = mean_rollout_log_prob(samples)
        nll, scorer = (-mean_logp if mean_logp is not None else float("nan")), "engine"
    checks.append(check_coherence(nll, ctx.vocab_size, repetition, replacement, scorer))

    if diag is not None:
        if diag.ref_log_probs is not None and resumed_after:
            checks.append(Check("log_probs vs ref", SKIP, f"resumed after step {resumed_after}: the policy has "
                                "trained away from the reference, so the two agree only at step 1"))
        elif diag.ref_log_probs is not None:
            diff = ((diag.old_log_probs - diag.ref_log_probs).abs() * diag.mask).max().item()
            kl = masked_mean(kl_k3(diag.old_log_probs, diag.ref_log_probs), diag.mask).item()
            checks.append(check_policy_vs_ref(diff, kl, "ref_log_probs"))
        else:  # no reference model: the first training forward must match the scoring one, at any step
            checks.append(check_policy_vs_ref(diag.recompute_max_diff, metrics.get("train/ppo_kl", 0.0),
                                              "recomputed log_probs"))
        if diag.rollout_log_probs is not None:
            checks.append(check_train_vs_engine(metrics["train/train_rollout_logprob_abs_diff"],
                                                metrics["forward_logp_max_diff"], ctx.precision))
        else:
            checks.append(Check("trainer vs engine", SKIP, "the samples carry no engine log-probs"))
        checks.append(check_response_nll(nll, ctx.has_template, ctx.applied_template))
        checks.append(check_grad_norm(metrics.get("train/grad_norm", float("nan"))))
        if diag.routing_mismatch is not None or diag.moe_without_routes:
            checks.append(check_routing(diag.routing_mismatch, diag.routing_replay, diag.moe_without_routes))
    checks.append(check_reward_signal(reward_stats(samples, ctx.rm_type, ctx.label_key)))
    return checks
