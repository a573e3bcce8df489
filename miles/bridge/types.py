"""The one type that crosses from the rollout side to the training side.

A `Sample` is plain data (ints, floats, strings, lists, dicts): no tensors and no torch import,
so rollout dumps stay loadable with `torch.load(weights_only=True)` and the rollout side can live
in another process or on another machine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


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
    metadata: dict[str, Any] = field(default_factory=dict)  # free-form: data row extras, seeds, ...

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
