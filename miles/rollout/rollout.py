"""The rollout side: prompts -> generation -> reward -> `Sample`s.

`RolloutManager.generate(rollout_id)` is the only call the training loop makes into this side;
what it returns (a list of `Sample`) is the only thing that crosses over to training.
"""

from __future__ import annotations

import logging
import time

from miles.bridge.types import Sample, Status
from miles.config import RolloutConfig
from miles.data.prompts import PromptDataset, PromptRecord, render_prompt
from miles.errors import UsageError
from miles.rollout.engine import LocalEngine, sample_seed
from miles.rollout.rewards import RewardFn
from miles.utils.progress import Progress

logger = logging.getLogger("miles")

_FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED}


class RolloutManager:
    def __init__(self, cfg: RolloutConfig, engine: LocalEngine, tokenizer, dataset: PromptDataset,
                 reward_fn: RewardFn):
        self.cfg = cfg
        self.engine = engine
        self.tokenizer = tokenizer
        self.dataset = dataset
        self.reward_fn = reward_fn
        self.last_stats: dict[str, float] = {}

    def generate(self, rollout_id: int) -> list[Sample]:
        cfg = self.cfg
        records = self.dataset.next_batch(cfg.batch_size)
        prompts = [tokenize_prompt(r.prompt, self.tokenizer, cfg.apply_chat_template) for r in records]
        # Each prompt repeated n times, group by group: sample i answers prompt i // n.
        flat_prompts = [p for p in prompts for _ in range(cfg.n_samples_per_prompt)]

        seeds = [sample_seed(cfg.seed, rollout_id, i) for i in range(len(flat_prompts))]
        start = time.perf_counter()
        with Progress(f"rollout {rollout_id} generating", total=cfg.sampling.max_new_tokens) as bar:
            outputs = self.engine.generate(flat_prompts, cfg.sampling, seeds, on_step=bar.update_to)
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
                metadata=dict(record.metadata),
            )
            sample.reward = float(self.reward_fn(sample))
            samples.append(sample)

        n_tokens = sum(s.response_length for s in samples)
        self.last_stats = {"perf/rollout_time_s": gen_time, "perf/rollout_tok_s": n_tokens / max(gen_time, 1e-9)}
        if self.engine.verifier is not None:  # --true-on-policy-mode: tokens re-drawn from the trainer's numbers
            self.last_stats["rollout/true_on_policy_redrawn"] = self.engine.verifier.last_redrawn
        return samples



def tokenize_prompt(prompt, tokenizer, apply_chat_template: bool) -> list[int]:
    text = render_prompt(prompt, tokenizer, apply_chat_template)
    # The chat template already holds any BOS the model wants; don't add special tokens twice.
    return tokenizer(text, add_special_tokens=not apply_chat_template)["input_ids"]


def drop_long_prompts(records: list[PromptRecord], tokenizer, cfg: RolloutConfig) -> list[PromptRecord]:
    """Applies --rollout-max-prompt-len. Also renders every prompt once, so a prompt the chat
    template cannot take fails now, before any model is loaded."""
    lengths = [len(tokenize_prompt(r.prompt, tokenizer, cfg.apply_chat_template)) for r in records]
    if cfg.max_prompt_len is None:
        return records
    kept = [r for r, n in zip(records, lengths) if n <= cfg.max_prompt_len]
    if not kept:
        raise UsageError(f"--rollout-max-prompt-len {cfg.max_prompt_len} drops every prompt "
                         f"(the shortest is {min(lengths)} tokens)")
    if len(kept) < len(records):
        logger.info("--rollout-max-prompt-len %d: dropped %d of %d prompts", cfg.max_prompt_len,
                    len(records) - len(kept), len(records))
    return kept
