"""The `RolloutSource` seam and the live rollout: prompts -> engine -> reward -> `Sample`s.

`RolloutSource.generate(rollout_id)` is the only call the loop makes into the rollout side; the
`RolloutBatch` it returns is the only thing that crosses over to training. `LiveRollout` makes
rollouts with an `Engine`; `miles.rollout.replay.ReplaySource` reads them from dumps.

Which prompts rollout i gets is a pure function of i (`PromptDataset.batch_for`), and sample j of
rollout i always draws from the random stream (seed, i, j): a rollout can be made in any order,
ahead of time, or again after a resume, and be the same rollout.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from miles.bridge.types import RolloutBatch, Sample, Status
from miles.config import RolloutConfig
from miles.data.prompts import PromptDataset, PromptRecord, render_prompt
from miles.errors import UsageError
from miles.rollout.engine import Engine
from miles.rollout.rewards import RewardFn
from miles.rollout.sampling import sample_seed
from miles.utils.progress import Progress

logger = logging.getLogger("miles")

_FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED}


class RolloutSource(Protocol):
    def generate(self, rollout_id: int) -> RolloutBatch: ...


class LiveRollout:
    def __init__(self, cfg: RolloutConfig, engine: Engine, tokenizer, dataset: PromptDataset, reward_fn: RewardFn, *,
                 apply_chat_template: bool, seed: int):
        self.cfg = cfg
        self.engine = engine
        self.tokenizer = tokenizer
        self.dataset = dataset
        self.reward_fn = reward_fn
        self.apply_chat_template = apply_chat_template
        self.seed = seed

    def generate(self, rollout_id: int) -> RolloutBatch:
        cfg = self.cfg
        records = self.dataset.batch_for(rollout_id, cfg.batch_size)
        prompts = [tokenize_prompt(r.prompt, self.tokenizer, self.apply_chat_template) for r in records]
        # Each prompt repeated n times, group by group: sample i answers prompt i // n.
        flat_prompts = [p for p in prompts for _ in range(cfg.n_samples_per_prompt)]
        seeds = [sample_seed(self.seed, rollout_id, i) for i in range(len(flat_prompts))]

        start = time.perf_counter()
        with Progress(f"rollout {rollout_id} generating", total=cfg.sampling.max_new_tokens, unit="tokens") as bar:
            outputs = self.engine.generate(flat_prompts, cfg.sampling, seeds, progress=bar.update_to)
        gen_time = time.perf_counter() - start

        samples = []
        for i, (prompt_ids, out) in enumerate(zip(flat_prompts, outputs)):
            record = records[i // cfg.n_samples_per_prompt]
            sample = Sample(
                group_index=i // cfg.n_samples_per_prompt,
                index=i,
                prompt=record.prompt,
                tokens=prompt_ids + out.token_ids,
                response=self.tokenizer.decode(out.token_ids, skip_special_tokens=True),
                response_length=len(out.token_ids),
                label=record.label,
                loss_mask=[1] * len(out.token_ids),
                rollout_log_probs=out.log_probs,
                status=_FINISH_STATUS[out.finish_reason],
                weight_version=out.weight_version,
                metadata=dict(record.metadata),
                rollout_routed_experts=out.routed_experts,
            )
            sample.reward = float(self.reward_fn(sample))
            samples.append(sample)

        n_tokens = sum(s.response_length for s in samples)
        stats = {"perf/rollout_time_s": gen_time, "perf/rollout_tok_s": n_tokens / max(gen_time, 1e-9)}
        redrawn = [out.redrawn for out in outputs if out.redrawn is not None]
        if redrawn:  # --true-on-policy-mode: tokens re-drawn from the trainer's numbers
            stats["rollout/true_on_policy_redrawn"] = sum(redrawn)
        return RolloutBatch(samples, stats)


def tokenize_prompt(prompt, tokenizer, apply_chat_template: bool) -> list[int]:
    text = render_prompt(prompt, tokenizer, apply_chat_template)
    # The chat template already holds any BOS the model wants; don't add special tokens twice.
    return tokenizer(text, add_special_tokens=not apply_chat_template)["input_ids"]


def drop_long_prompts(records: list[PromptRecord], tokenizer, *, apply_chat_template: bool,
                      max_prompt_len: int | None, max_positions: int) -> list[PromptRecord]:
    """Applies --rollout-max-prompt-len, and refuses a prompt that would not fit the model:
    `max_positions` is the model's positions minus --rollout-max-response-len. Also renders every
    prompt once, so a prompt the chat template cannot take fails now, before any model is loaded."""
    if max_positions <= 0:
        raise UsageError(f"--rollout-max-response-len leaves no room for a prompt in the model's positions "
                         f"({max_positions} left); lower it")
    lengths = [len(tokenize_prompt(r.prompt, tokenizer, apply_chat_template)) for r in records]
    limit = max_prompt_len if max_prompt_len is not None else float("inf")
    unfit = [(i, n) for i, n in enumerate(lengths) if max_positions < n <= limit]
    if unfit:
        i, n = max(unfit, key=lambda item: item[1])
        raise UsageError(f"--prompt-data row {i + 1}: its prompt is {n} tokens, but with --rollout-max-response-len the "
                         f"model has room for {max_positions} ({len(unfit)} such prompt(s)); pass "
                         f"--rollout-max-prompt-len {max_positions} (or less) to drop them, or lower "
                         f"--rollout-max-response-len")
    if max_prompt_len is None:
        return records
    kept = [r for r, n in zip(records, lengths) if n <= max_prompt_len]
    if not kept:
        raise UsageError(f"--rollout-max-prompt-len {max_prompt_len} drops every prompt "
                         f"(the shortest is {min(lengths)} tokens)")
    if len(kept) < len(records):
        logger.info("--rollout-max-prompt-len %d: dropped %d of %d prompts", max_prompt_len,
                    len(records) - len(kept), len(records))
    return kept
