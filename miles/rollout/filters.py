"""Dynamic sampling (DAPO): which generated groups a rollout keeps (`--dynamic-sampling-filter-path`).

A filter is `fn(args, samples) -> bool | DynamicFilterOutput`, slime's signature: `samples` are one
prompt's group (its `--n-samples-per-prompt` responses, rewarded), `args` the run's rollout config
(miles.config.RolloutConfig). The built-in `check_reward_nonzero_std` (slime's name) drops a group
whose rewards are all equal: its advantages are all 0, so it carries no signal and only dilutes the
batch.
"""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from miles.bridge.types import Sample
from miles.errors import UsageError

FLAG = "--dynamic-sampling-filter-path"


@dataclass(frozen=True)
class DynamicFilterOutput:
    keep: bool
    reason: str | None = None  # why a group was dropped (counted in the step's log line)


def check_reward_nonzero_std(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput:
    rewards = [s.reward for s in samples]
    if max(rewards) > min(rewards):
        return DynamicFilterOutput(True)
    return DynamicFilterOutput(False, f"every reward {rewards[0]:g}")


GroupFilter = Callable[[list[Sample]], DynamicFilterOutput]


def load_filter(path: str, args) -> GroupFilter:
    """The filter at `path` (module:function), called as fn(args, samples); its answer as a
    DynamicFilterOutput, or one `error:` line naming the filter when it fails or answers nonsense."""
    from miles.utils.imports import load_function

    fn = load_function(path, FLAG)

    def keep(samples: list[Sample]) -> DynamicFilterOutput:
        try:
            out = fn(args, samples)
        except Exception as e:  # the user's function failed: say where, in one line
            frame = traceback.extract_tb(e.__traceback__)[-1]
            raise UsageError(f"{FLAG} {path} raised {type(e).__name__}: {e} (at {frame.filename}:{frame.lineno}) on "
                             f"the group of prompt {samples[0].group_index if samples else '?'}; fix the filter") from e
        if inspect.isawaitable(out):
            raise UsageError(f"{FLAG} {path} is async; a filter must return its answer (bool or "
                             "DynamicFilterOutput)")
        if isinstance(out, bool):
            return DynamicFilterOutput(out, None if out else "filtered")
        if isinstance(getattr(out, "keep", None), bool):
            return DynamicFilterOutput(out.keep, getattr(out, "reason", None) or (None if out.keep else "filtered"))
        raise UsageError(f"{FLAG} {path} returned {out!r}; a filter returns a bool or an object with a bool `keep` "
                         "(miles.rollout.filters.DynamicFilterOutput)")

    return keep
