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
from collections import Counter
from typing import Protocol

from miles.bridge.types import RolloutBatch, Sample, Status
from miles.config import RolloutConfig
from miles.data.prompts import PromptDataset, PromptRecord, render_prompt
from miles.errors import RunFailed, UsageError
from miles.rollout.engine import Engine, GenerationOutput
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
        self.generate_fn = None  # --custom-generate-function-path: async fn(client, sample, sampling) -> Sample
        if cfg.custom_generate_path:
            from miles.rollout.custom_generate import load_generate

            self.generate_fn = load_generate(cfg.custom_generate_path)
        self.keep = None  # dynamic sampling: the group filter, and the second walk its top-up rounds take
        if cfg.dynamic_filter_path:
            from miles.rollout.filters import load_filter

            self.keep = load_filter(cfg.dynamic_filter_path, cfg)
            self.top_up = PromptDataset(dataset.records, shuffle=True, seed=f"{seed}:top-up")

    def generate(self, rollout_id: int) -> RolloutBatch:
        if self.keep is not None:
            return self._dynamic(rollout_id)
        samples, redrawn, gen_time = self._groups(self.dataset.batch_for(rollout_id, self.cfg.batch_size),
                                                  rollout_id)
        return RolloutBatch(samples, _stats(samples, redrawn, gen_time))

    def _custom(self, records: list[PromptRecord], flat_prompts: list[list[int]], seeds: list[int]) -> list[Sample]:
        """--custom-generate-function-path: each prompt sample through the user's function."""
        from miles.rollout.custom_generate import run_custom

        n = self.cfg.n_samples_per_prompt
        prompts = [Sample(group_index=i // n, index=i, prompt=records[i // n].prompt, tokens=list(p),
                          label=records[i // n].label, metadata=dict(records[i // n].metadata))
                   for i, p in enumerate(flat_prompts)]
        finished = run_custom(self.generate_fn, self.cfg.custom_generate_path, self.engine, self.tokenizer, prompts,
                              seeds, self.cfg.sampling, batched=not hasattr(self.engine, "servers"))
        for i, s in enumerate(finished):  # the function owns the response; the batch owns the numbering
            s.group_index, s.index = i // n, i
            s.response = s.response or self.tokenizer.decode(s.response_tokens, skip_special_tokens=True)
        return finished

    def _groups(self, records: list[PromptRecord], rollout_id: int, first_seed: int = 0):
        """Each record's group of n rewarded samples (group_index i, index i * n + j); sample k draws from
        the stream (seed, rollout id, first_seed + k). Returns (samples, the engine's true on-policy
        re-draw counts, seconds)."""
        cfg = self.cfg
        prompts = [tokenize_prompt(r.prompt, self.tokenizer, self.apply_chat_template) for r in records]
        # Each prompt repeated n times, group by group: sample i answers prompt i // n.
        flat_prompts = [p for p in prompts for _ in range(cfg.n_samples_per_prompt)]
        seeds = [sample_seed(self.seed, rollout_id, first_seed + i) for i in range(len(flat_prompts))]

        start = time.perf_counter()
        if self.generate_fn is not None:
            samples, redrawn = self._custom(records, flat_prompts, seeds), []
        else:
            with Progress(f"rollout {rollout_id} generating", total=cfg.sampling.max_new_tokens,
                          unit="tokens") as bar:
                outputs = self.engine.generate(flat_prompts, cfg.sampling, seeds, progress=bar.update_to)
            samples = [response_sample(records[i // cfg.n_samples_per_prompt], i, cfg.n_samples_per_prompt, p, out,
                                       self.tokenizer) for i, (p, out) in enumerate(zip(flat_prompts, outputs))]
            redrawn = [out.redrawn for out in outputs if out.redrawn is not None]
        gen_time = time.perf_counter() - start
        for sample in samples:
            sample.reward = float(self.reward_fn(sample))
        return samples, redrawn, gen_time

    def _dynamic(self, rollout_id: int) -> RolloutBatch:
        """Dynamic sampling: rounds of `over_sampling_batch_size` prompts until `batch_size` groups passed
        the filter. Round 0 takes this rollout's prompts of the data walk (in units of the round size);
        later rounds top up from a second walk over the data in its own seeded order, so which prompts
        rollout i sees stays a function of i. The first `batch_size` kept groups train; the surplus goes."""
        cfg, n = self.cfg, self.cfg.n_samples_per_prompt
        size = cfg.over_sampling_batch_size or cfg.batch_size
        kept: list[list[Sample]] = []
        dropped: Counter[str] = Counter()
        made, redrawn, gen_time, rounds = [], [], 0.0, 0  # every sample generated, kept or not
        while len(kept) < cfg.batch_size:
            if rounds == cfg.dynamic_max_rounds:
                raise RunFailed(
                    f"dynamic sampling starved: rollout {rollout_id} kept {len(kept)} of the {cfg.batch_size} groups "
                    f"it needs after {rounds} round(s) of {size} prompts ({sum(dropped.values())} dropped by "
                    f"--dynamic-sampling-filter-path {cfg.dynamic_filter_path}: {_reasons(dropped)}); raise "
                    "--dynamic-sampling-max-rounds or --over-sampling-batch-size, or check the rewards "
                    "(`miles inspect-rollout` on a --save-debug-rollout-data dump)")
            records = (self.dataset.batch_for(rollout_id, size) if rounds == 0 else
                       self.top_up.batch_for(rollout_id * cfg.dynamic_max_rounds + rounds - 1, size))
            samples, redraws, seconds = self._groups(records, rollout_id, first_seed=rounds * size * n)
            made += samples
            redrawn += redraws
            gen_time += seconds
            for g in range(len(records)):
                group = samples[g * n:(g + 1) * n]
                verdict = self.keep(group)
                if verdict.keep:
                    kept.append(group)
                else:
                    dropped[verdict.reason or "filtered"] += 1
            rounds += 1
        surplus = len(kept) - cfg.batch_size
        samples = []
        for g, group in enumerate(kept[:cfg.batch_size]):  # renumbered: the trainer's groups are contiguous
            for j, s in enumerate(group):
                s.group_index, s.index = g, g * n + j
                samples.append(s)
        logger.info("dynamic sampling: rollout %d kept %d groups in %d round(s) of %d prompts; dropped %d (%s), "
                    "surplus %d", rollout_id, cfg.batch_size, rounds, size, sum(dropped.values()), _reasons(dropped),
                    surplus)
        stats = _stats(made, redrawn, gen_time)
        stats.update({"rollout/dynamic_sampling_rounds": rounds, "rollout/dynamic_sampling_dropped_groups":
                      sum(dropped.values()), "rollout/dynamic_sampling_surplus_groups": surplus})
        return RolloutBatch(samples, stats)


def response_sample(record: PromptRecord, index: int, group_size: int, prompt_ids: list[int], out: GenerationOutput,
                    tokenizer) -> Sample:
    """Sample `index` (of group index // group_size): the engine's response to `record`'s prompt, unrewarded."""
    return Sample(
        group_index=index // group_size,
        index=index,
        prompt=record.prompt,
        tokens=prompt_ids + out.token_ids,
        response=tokenizer.decode(out.token_ids, skip_special_tokens=True),
        response_length=len(out.token_ids),
        label=record.label,
        loss_mask=[1] * len(out.token_ids),
        rollout_log_probs=out.log_probs,
        status=_FINISH_STATUS[out.finish_reason],
        weight_version=out.weight_version,
        metadata=dict(record.metadata),
        rollout_routed_experts=out.routed_experts,
    )


def _stats(made: list[Sample], redrawn: list[int], gen_time: float) -> dict[str, float]:
    """Generation throughput over every sample made; --true-on-policy-mode's tokens re-drawn from the
    trainer's numbers."""
    n_tokens = sum(s.response_length for s in made)
    stats = {"perf/rollout_time_s": gen_time, "perf/rollout_tok_s": n_tokens / max(gen_time, 1e-9)}
    if redrawn:
        stats["rollout/true_on_policy_redrawn"] = sum(redrawn)
    return stats


def _reasons(dropped: Counter) -> str:
    return ", ".join(f"{count} x {reason}" for reason, count in dropped.most_common(3)) or "none"


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
        raise UsageError(f"--prompt-data row {i + 1}: its prompt is {n} tokens, but with --rollout-max-response-len "
                         f"the model has room for {max_positions} ({len(unfit)} such prompt(s)); pass "
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
