"""Evaluation on held-out prompts during training (`--eval-interval`, `--eval-prompt-data NAME PATH ...`).

`Evaluator.evaluate(step)` sends every prompt of every set through the rollout engine (the local one
or the servers), `--n-samples-per-eval-prompt` times, with the evaluation's sampling (greedy by
default) and scores each response with the run's reward function. Nothing it makes reaches the
trainer. Per set NAME it returns:

- `eval/NAME`: the mean reward over every response;
- `eval/NAME/pass@K` (K > 1 responses per prompt): the share of prompts with at least one response
  whose reward is > 0 (the math rewards give 1 or 0);
- `eval/NAME/response_len`: the mean response length in tokens.

Sample j of the evaluation at step s draws from the stream (seed, "eval", s, j): evaluations repeat
bitwise with the run, and they use no training stream.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from miles.config import EvalConfig
from miles.data.prompts import PromptRecord
from miles.rollout.engine import Engine
from miles.rollout.rewards import RewardFn
from miles.rollout.sampling import derived_seed
from miles.rollout.source import response_sample, tokenize_prompt
from miles.utils.progress import Progress

logger = logging.getLogger("miles")


@dataclass(frozen=True)
class EvalSet:
    name: str
    records: list[PromptRecord]


def eval_seed(seed: int, step: int, index: int) -> int:
    return derived_seed("eval", seed, step, index)


class Evaluator:
    def __init__(self, cfg: EvalConfig, sets: list[EvalSet], engine: Engine, tokenizer, reward_fn: RewardFn, *,
                 apply_chat_template: bool, seed: int):
        self.cfg, self.sets, self.engine, self.tokenizer = cfg, sets, engine, tokenizer
        self.reward_fn, self.apply_chat_template, self.seed = reward_fn, apply_chat_template, seed

    def due(self, step: int) -> bool:
        """Evaluate after `step` steps (0: before the first)?"""
        return step % self.cfg.interval == 0

    def evaluate(self, step: int) -> dict[str, float]:
        metrics = {}
        start = time.perf_counter()
        for s in self.sets:
            metrics.update(self._evaluate_set(s, step))
        summary = " | ".join(f"{k.removeprefix('eval/')} {v:.3g}" for k, v in metrics.items())
        logger.info("eval after step %d (%.1f s): %s", step, time.perf_counter() - start, summary)
        return metrics

    def _evaluate_set(self, s: EvalSet, step: int) -> dict[str, float]:
        n = self.cfg.n_samples_per_prompt
        prompts = [tokenize_prompt(r.prompt, self.tokenizer, self.apply_chat_template) for r in s.records]
        flat = [p for p in prompts for _ in range(n)]
        seeds = [eval_seed(self.seed, step, j) for j in range(len(flat))]
        with Progress(f"eval {s.name}", total=self.cfg.sampling.max_new_tokens, unit="tokens") as bar:
            outputs = self.engine.generate(flat, self.cfg.sampling, seeds, progress=bar.update_to)
        samples = [response_sample(s.records[j // n], j, n, p, out, self.tokenizer)
                   for j, (p, out) in enumerate(zip(flat, outputs))]
        rewards = [float(self.reward_fn(sample)) for sample in samples]
        lengths = [sample.response_length for sample in samples]
        metrics = {f"eval/{s.name}": sum(rewards) / len(rewards),
                   f"eval/{s.name}/response_len": sum(lengths) / len(lengths)}
        if n > 1:
            solved = sum(any(r > 0 for r in rewards[i * n:(i + 1) * n]) for i in range(len(s.records)))
            metrics[f"eval/{s.name}/pass@{n}"] = solved / len(s.records)
        return metrics
