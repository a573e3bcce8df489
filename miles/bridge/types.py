"""What crosses between the two sides: `Sample`s to training, results back to the loop.

A `Sample` is plain data (ints, floats, strings, lists, dicts): no tensors and no torch import,
so rollout dumps stay loadable with `torch.load(weights_only=True)` and the rollout side can live
in another process or on another machine. A `RolloutBatch` is what a `RolloutSource` returns for
one rollout id; a `TrainResult` is what `Trainer.train` returns for it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class Status:
    """Why generation of a sample stopped (the SGLang `finish_reason` types)."""

    COMPLETED = "completed"  # the engine sampled an end-of-sequence token
    TRUNCATED = "truncated"  # hit --rollout-max-response-len
    ABORTED = "aborted"  # generation was interrupted (engine paused or failed)


@dataclass
class Sample:
    group_index: int  # which prompt of the rollout this sample answers (GRPO groups share it)
    index: int  # position of the sample in the rollout, 0..N-1
    prompt: str | list[dict[str, Any]]  # the prompt as given in the data (text or chat messages)
    tokens: list[int]  # prompt token ids followed by response token ids
    response: str = ""  # decoded response text
    response_length: int = 0  # number of response tokens at the end of `tokens`
    label: Any = None  # ground truth from --label-key, None when the data has none
    reward: float = 0.0  # from the reward function (before any KL shaping)
    loss_mask: list[int] = field(default_factory=list)  # (response_length,) 1 = trained on
    rollout_log_probs: list[float] = field(default_factory=list)  # (response_length,) engine log p
    status: str = Status.COMPLETED
    weight_version: int | None = None  # optimizer steps behind the weights that generated it (None: unknown)
    metadata: dict[str, Any] = field(default_factory=dict)  # free-form: data row extras, seeds, ...
    # MoE (slime's name): the experts the engine's routers chose for each token it was fed (the prompt, then
    # each response token but the last), a numpy int array (len(tokens) - 1, layers, k); None for a dense model.
    rollout_routed_experts: Any = None

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def mean_rollout_log_prob(samples: list[Sample]) -> float | None:
    """The engine's mean log-prob per trained token (loss_mask 1) over `samples`; None without any.

    The one definition behind `rollout/rollout_log_probs`, the printed samples, inspect-rollout
    and the rollout-only coherence check.
    """
    total, count = 0.0, 0
    for s in samples:
        for lp, m in zip(s.rollout_log_probs, s.loss_mask):
            if m:
                total += lp
                count += 1
    return total / count if count else None


@dataclass
class RolloutBatch:
    """One rollout: its samples, group by group, and the side's own measurements (perf/..., rollout/...)."""

    samples: list[Sample]
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class StepDiagnostics:
    """Per-token tensors (B, R) of one rollout's scoring, for the alignment check."""

    old_log_probs: torch.Tensor  # the policy's, before any update
    ref_log_probs: torch.Tensor | None
    rollout_log_probs: torch.Tensor | None  # None when the samples carry no engine log-probs
    mask: torch.Tensor
    recompute_max_diff: float  # max |log-prob in the first training forward - old_log_probs|
    # MoE: the share of token-layer routes where the policy's own top-k differs from the engine's
    # (None: a dense model, or no routes); whether they were replayed; an MoE rollout that came without routes.
    routing_mismatch: float | None = None
    routing_replay: bool = False
    moe_without_routes: bool = False


@dataclass
class TrainResult:
    """What `Trainer.train` returns for one rollout."""

    metrics: dict[str, float]  # train/..., rollout/log_probs and the trainer/engine gap
    diagnostics: StepDiagnostics
    hashes: dict[str, str] = field(default_factory=dict)  # with --debug-determinism: the training side's digests
    nonfinite: str | None = None  # what was NaN/Inf when an update was skipped for it, and where
