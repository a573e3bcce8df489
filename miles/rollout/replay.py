"""`ReplaySource`: a `RolloutSource` that reads rollout i from its dump (`--load-debug-rollout-data`).

It stands in for the whole rollout side, so a replayed run trains on exactly the captured inputs
with no engine built. Each dump is checked in full before it is trained on
(`miles.bridge.rollout_dump.check_fits`): a dump that does not fit the flags or the model, or has
any bad field, is a UsageError naming the file, the sample and the field.
"""

from __future__ import annotations

import time

from miles.bridge.dump_paths import dump_path
from miles.bridge.rollout_dump import LOAD_FLAG, check_fits, read_dump, samples_from_dump
from miles.bridge.types import RolloutBatch
from miles.errors import UsageError


class ReplaySource:
    def __init__(self, template: str, *, vocab_size: int, rollout_batch_size: int, n_samples_per_prompt: int,
                 needs_log_probs: bool):
        self.template = template
        self.vocab_size = vocab_size
        self.expected = rollout_batch_size * n_samples_per_prompt
        self.n_samples_per_prompt = n_samples_per_prompt
        self.needs_log_probs = needs_log_probs

    def check_all(self, rollout_ids: range) -> None:
        """Fails before training starts if any file is missing; the first one is fully checked."""
        for rollout_id in rollout_ids:
            path = dump_path(self.template, rollout_id)
            if not path.is_file():
                raise UsageError(f"{LOAD_FLAG}: no dump for rollout {rollout_id}: {path} does not exist; capture "
                                 f"it with --debug-rollout-only --save-debug-rollout-data, or lower --num-rollout")
        if len(rollout_ids):
            self.generate(rollout_ids[0])

    def generate(self, rollout_id: int) -> RolloutBatch:
        start = time.perf_counter()
        path = dump_path(self.template, rollout_id)
        samples = samples_from_dump(read_dump(path), path, self.n_samples_per_prompt)
        check_fits(samples, path, vocab_size=self.vocab_size, expected=self.expected,
                   n_samples_per_prompt=self.n_samples_per_prompt, needs_log_probs=self.needs_log_probs)
        return RolloutBatch(samples, {"perf/rollout_load_s": time.perf_counter() - start})
