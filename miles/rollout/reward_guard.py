"""How the rollout calls a reward: on a copy of the sample, under a deadline, with its failures named.

A reward function gets a deep copy of the `Sample`, so one that edits `tokens` or `loss_mask`
cannot change what is trained on. It runs in a daemon thread joined with `--reward-timeout`: one
that never returns stops the run with an `error:` line naming it (the stuck thread dies with the
process). `sys.exit()` or a `KeyboardInterrupt` raised by the reward's own code is reported as
what it is, rather than ending the run silently or passing for a Ctrl-C. (A real Ctrl-C or SIGTERM
reaches the main thread, which is the one waiting here, and stops the run as a signal.)
"""

from __future__ import annotations

import copy
import functools
import threading

from miles.bridge.types import Sample
from miles.errors import UsageError
from miles.rollout.rewards import RewardFn


def guarded_reward(fn: RewardFn, name: str, timeout: float) -> RewardFn:
    """`fn` as the rollout calls it; `name` is how errors name it (`--rm-type math`, `--custom-rm-path m:f`)."""

    @functools.wraps(fn)
    def reward(sample: Sample) -> float:
        outcome: dict = {}

        def call() -> None:
            try:
                outcome["value"] = fn(copy.deepcopy(sample))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread, which names it
                outcome["error"] = e

        worker = threading.Thread(target=call, name=f"reward {name} sample {sample.index}", daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            raise UsageError(f"{name} did not return within --reward-timeout {timeout:g} s on sample {sample.index}: "
                             "it hangs or is too slow; fix it, or raise --reward-timeout")
        error = outcome.get("error")
        if isinstance(error, SystemExit):
            raise UsageError(f"{name} called sys.exit({error.code!r}) on sample {sample.index}; a reward function "
                             "must return a number, not exit the process")
        if isinstance(error, KeyboardInterrupt):
            raise UsageError(f"{name} raised KeyboardInterrupt itself on sample {sample.index} (no Ctrl-C reached "
                             "miles); a reward function must return a number")
        if error is not None:
            raise error
        return outcome["value"]

    return reward
