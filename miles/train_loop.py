"""The RL loop of `miles train`, top to bottom: generate -> train -> sync weights -> save.

Every branch lives in a component: the rollout side (`RolloutManager`: data, engine, reward), the
training side (`Trainer`: log-probs, advantages, loss, optimizer), and the bridge between them
(`Sample`s one way, `sync_weights` the other).
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import numpy as np
import torch

from miles import __version__
from miles.bridge.types import Sample
from miles.bridge.weight_sync import sync_weights
from miles.config import ModelConfig, RolloutConfig, RunConfig, TrainConfig
from miles.data.prompts import PromptData, PromptDataset
from miles.rollout.engine import LocalEngine
from miles.rollout.rewards import RewardFn
from miles.rollout.rollout import RolloutManager, drop_long_prompts
from miles.train.checkpoint import find_latest_checkpoint, load_trainer_state, save_checkpoint
from miles.train.trainer import Trainer
from miles.utils.logging import MetricsWriter
from miles.utils.models import eos_token_ids, load_causal_lm, load_tokenizer, quiet_transformers, resolve_checkpoint

logger = logging.getLogger("miles")


def run_training(model_cfg: ModelConfig, rollout_cfg: RolloutConfig, train_cfg: TrainConfig, run_cfg: RunConfig,
                 data: PromptData, reward_fn: RewardFn, config: dict) -> None:
    output_dir = Path(run_cfg.output_dir)
    seed_everything(run_cfg.seed)
    quiet_transformers()
    logger.info("miles %s | device=%s precision=%s | output_dir=%s", __version__, model_cfg.device,
                model_cfg.precision, output_dir)

    base = resolve_checkpoint(model_cfg.hf_checkpoint)
    resume = find_latest_checkpoint(run_cfg.load) if run_cfg.load else None
    tokenizer = load_tokenizer(base)
    records = drop_long_prompts(data.records, tokenizer, rollout_cfg)
    load = dict(device=model_cfg.device, attention_backend=model_cfg.attention_backend)
    policy = load_causal_lm(resume or base, **load)
    ref = load_causal_lm(model_cfg.ref_load or base, **load) if train_cfg.needs_ref else None
    engine_dtype = torch.bfloat16 if model_cfg.precision == "bf16" else torch.float32
    engine = LocalEngine(load_causal_lm(resume or base, dtype=engine_dtype, **load),
                         eos_token_ids=eos_token_ids(policy, tokenizer), pad_token_id=tokenizer.pad_token_id)

    dataset = PromptDataset(records, shuffle=rollout_cfg.shuffle, seed=rollout_cfg.seed)
    rollout = RolloutManager(rollout_cfg, engine, tokenizer, dataset, reward_fn)
    trainer = Trainer(train_cfg, policy, ref, pad_token_id=tokenizer.pad_token_id, precision=model_cfg.precision)
    start_step = 0
    if resume is not None:
        state = load_trainer_state(resume)
        trainer.load_state_dict(state)
        dataset.load_state_dict(state["data"])
        start_step = state["step"]
        logger.info("Resuming after step %d from %s", start_step, resume)

    save_root = Path(run_cfg.save) if run_cfg.save else output_dir / "checkpoints"
    metrics_out = MetricsWriter(output_dir, tensorboard=run_cfg.use_tensorboard,
                                wandb_project=run_cfg.wandb_project if run_cfg.use_wandb else None,
                                wandb_group=run_cfg.wandb_group, config=config)
    try:
        for step in range(start_step + 1, run_cfg.num_rollout + 1):
            rollout_id = step - 1
            step_start = time.perf_counter()
            samples = rollout.generate(rollout_id)
            train_start = time.perf_counter()
            metrics = trainer.train(samples)
            train_time = time.perf_counter() - train_start
            sync = sync_weights(trainer.model, engine, step)

            metrics.update(rollout_metrics(samples))
            metrics.update(rollout.last_stats)
            metrics["perf/train_tok_s"] = sum(len(s.tokens) for s in samples) / train_time
            metrics["perf/weight_sync_s"] = sync.seconds
            metrics["perf/step_time_s"] = time.perf_counter() - step_start
            if step == run_cfg.num_rollout or (run_cfg.save_interval and step % run_cfg.save_interval == 0):
                state = {**trainer.state_dict(), "data": dataset.state_dict(), "config": config}
                save_checkpoint(save_root, step, trainer.model, tokenizer, state)
            metrics_out.write(step, metrics)
            log_step(step, run_cfg.num_rollout, metrics)
    finally:
        metrics_out.close()
    logger.info("Done: %d steps; metrics in %s", run_cfg.num_rollout - start_step, output_dir / "metrics.jsonl")


def rollout_metrics(samples: list[Sample]) -> dict[str, float]:
    n = len(samples)
    return {
        "rollout/reward_mean": sum(s.reward for s in samples) / n,
        "rollout/response_len_mean": sum(s.response_length for s in samples) / n,
        "rollout/truncated_frac": sum(s.status == "truncated" for s in samples) / n,
    }


def log_step(step: int, total: int, m: dict[str, float]) -> None:
    logger.info(
        "step %d/%d | reward %.3f | resp_len %.1f | loss %.4f | grad_norm %.3f | ppo_kl %.2e | "
        "forward_logp_max_diff %.2e | %.1fs (rollout %.0f tok/s, train %.0f tok/s)",
        step, total, m["rollout/reward_mean"], m["rollout/response_len_mean"], m["train/loss"], m["train/grad_norm"],
        m["train/ppo_kl"], m["forward_logp_max_diff"], m["perf/step_time_s"], m["perf/rollout_tok_s"],
        m["perf/train_tok_s"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
