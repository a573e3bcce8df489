"""The RL loop of `miles train`, top to bottom: generate -> train -> sync weights -> save.

Every branch lives in a component: the rollout side (`RolloutManager`: data, engine, reward, or a
`ReplaySource` reading dumps), the training side (`Trainer`: log-probs, advantages, loss,
optimizer), and the bridge between them (`Sample`s one way, `sync_weights` the other).
`--debug-rollout-only` builds no trainer; `--debug-train-only` builds no engine.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from miles import __version__
from miles.bridge.types import Sample
from miles.bridge.weight_sync import sync_weights
from miles.config import ModelConfig, RolloutConfig, RunConfig, TrainConfig
from miles.data.prompts import PromptData, PromptDataset
from miles.errors import CheckFailed, UsageError
from miles.debug.alignment import CheckContext, report, run_checks
from miles.debug.determinism import HashWriter, enable_deterministic_mode, rollout_hashes
from miles.debug.print_rollout import log_rollout_samples
from miles.debug.rollout_dump import ReplaySource, save_rollout
from miles.rollout.engine import LocalEngine
from miles.rollout.rewards import RewardFn
from miles.rollout.rollout import RolloutManager, drop_long_prompts
from miles.train.checkpoint import find_latest_checkpoint, load_trainer_state, save_checkpoint
from miles.rollout.true_on_policy import TrainerComputationVerifier
from miles.train.trainer import Trainer, mixed_precision
from miles.utils.logging import MetricsWriter
from miles.utils.models import eos_token_ids, load_causal_lm, load_tokenizer, quiet_transformers, resolve_checkpoint

logger = logging.getLogger("miles")


@dataclass
class Components:
    tokenizer: object
    source: RolloutManager | ReplaySource  # where each rollout's samples come from
    engine: LocalEngine | None  # None with --debug-train-only
    trainer: Trainer | None  # None with --debug-rollout-only
    dataset: PromptDataset | None  # None when replaying dumps
    start_step: int  # steps already done (resume)
    check_context: CheckContext  # what the alignment check needs to know


def run_training(model_cfg: ModelConfig, rollout_cfg: RolloutConfig, train_cfg: TrainConfig, run_cfg: RunConfig,
                 data: PromptData | None, reward_fn: RewardFn | None, config: dict) -> None:
    output_dir = Path(run_cfg.output_dir)
    seed_everything(run_cfg.seed)
    quiet_transformers()
    logger.info("miles %s | device=%s precision=%s | output_dir=%s", __version__, model_cfg.device,
                model_cfg.precision, output_dir)
    if run_cfg.deterministic_mode:
        enable_deterministic_mode(run_cfg.seed, model_cfg.device, model_cfg.attention_backend)
    c = build_components(model_cfg, rollout_cfg, train_cfg, run_cfg, data, reward_fn)
    hashes_out = HashWriter(output_dir) if run_cfg.debug_determinism else None
    save_root = Path(run_cfg.save) if run_cfg.save else output_dir / "checkpoints"
    dump_meta = dump_metadata(model_cfg, rollout_cfg, run_cfg)
    metrics_out = MetricsWriter(output_dir, tensorboard=run_cfg.use_tensorboard,
                                wandb_project=run_cfg.wandb_project if run_cfg.use_wandb else None,
                                wandb_group=run_cfg.wandb_group, config=config)
    try:
        for step in range(c.start_step + 1, run_cfg.num_rollout + 1):
            rollout_id = step - 1
            step_start = time.perf_counter()
            samples = c.source.generate(rollout_id)
            metrics = {**rollout_metrics(samples), **c.source.last_stats}
            capture_rollout(run_cfg, rollout_id, samples, metrics, dump_meta)
            if c.trainer is not None:
                metrics.update(train_and_sync(c, run_cfg, samples, step))
                if step == run_cfg.num_rollout or (run_cfg.save_interval and step % run_cfg.save_interval == 0):
                    state = {**c.trainer.state_dict(), "config": config}
                    if c.dataset is not None:
                        state["data"] = c.dataset.state_dict()
                    save_checkpoint(save_root, step, c.trainer.model, c.tokenizer, state)
            metrics["perf/step_time_s"] = time.perf_counter() - step_start

            if hashes_out is not None:
                hashes_out.write(step, {**rollout_hashes(samples), **(c.trainer.step_hashes if c.trainer else {})})
            metrics_out.write(step, metrics)
            log_step(step, run_cfg.num_rollout, metrics)
            if step == c.start_step + 1 and run_cfg.alignment_check != "off":
                log_rollout_samples(rollout_id, samples, limit=2)  # the guide's first look: is it coherent?
                checks = run_checks(samples, metrics, c.trainer.diagnostics if c.trainer else None, c.check_context)
                report(checks, run_cfg.alignment_check, step)
    finally:
        metrics_out.close()
    logger.info("Done: %d steps; metrics in %s", run_cfg.num_rollout - c.start_step, output_dir / "metrics.jsonl")


def capture_rollout(run_cfg: RunConfig, rollout_id: int, samples: list[Sample], metrics: dict, meta: dict) -> None:
    """--save-debug-rollout-data and --debug-rollout-print-every."""
    if run_cfg.save_debug_rollout_data:
        start = time.perf_counter()
        path = save_rollout(run_cfg.save_debug_rollout_data, rollout_id, samples, meta)
        metrics["perf/rollout_dump_s"] = time.perf_counter() - start
        logger.info("Saved rollout %d (%d samples) to %s", rollout_id, len(samples), path)
    if run_cfg.debug_rollout_print_every and rollout_id % run_cfg.debug_rollout_print_every == 0:
        log_rollout_samples(rollout_id, samples)


def train_and_sync(c: Components, run_cfg: RunConfig, samples: list[Sample], step: int) -> dict[str, float]:
    """One rollout's optimizer steps, then the weights to the engine (if this run has one)."""
    start = time.perf_counter()
    metrics = c.trainer.train(samples)
    metrics["perf/train_tok_s"] = sum(len(s.tokens) for s in samples) / (time.perf_counter() - start)
    if c.engine is not None:
        sync = sync_weights(c.trainer.model, c.engine, step, verify=run_cfg.check_weight_update_equal,
                            debug_level=run_cfg.debug_weight_sync)
        metrics["perf/weight_sync_s"] = sync.seconds
        if run_cfg.alignment_check == "error" and (sync.mismatched or sync.buffer_problems):
            raise CheckFailed(f"weight sync check failed at step {step} (see `weight_sync` lines)")
    return metrics


def build_components(model_cfg: ModelConfig, rollout_cfg: RolloutConfig, train_cfg: TrainConfig, run_cfg: RunConfig,
                     data: PromptData | None, reward_fn: RewardFn | None) -> Components:
    base = resolve_checkpoint(model_cfg.hf_checkpoint)
    resume = find_latest_checkpoint(run_cfg.load) if run_cfg.load else None
    tokenizer = load_tokenizer(base)
    load = dict(device=model_cfg.device, attention_backend=model_cfg.attention_backend)

    state = load_trainer_state(resume) if resume is not None else None
    start_step = state["step"] if state is not None else 0
    if start_step >= run_cfg.num_rollout:
        raise UsageError(f"--load {run_cfg.load}: the checkpoint is at step {start_step}, so --num-rollout "
                         f"{run_cfg.num_rollout} leaves nothing to do; --num-rollout counts from step 1")

    engine = dataset = None
    if run_cfg.load_debug_rollout_data:
        logger.info("--load-debug-rollout-data %s: replaying captured rollouts, so --debug-train-only is on",
                    run_cfg.load_debug_rollout_data)
        source = ReplaySource(run_cfg.load_debug_rollout_data, vocab_size=_vocab_size(base, tokenizer),
                              rollout_batch_size=rollout_cfg.batch_size,
                              n_samples_per_prompt=rollout_cfg.n_samples_per_prompt, needs_log_probs=train_cfg.use_tis)
        source.check_all(range(start_step, run_cfg.num_rollout))
    else:
        records = drop_long_prompts(data.records, tokenizer, rollout_cfg)
        dataset = PromptDataset(records, shuffle=rollout_cfg.shuffle, seed=rollout_cfg.seed)
        engine = build_engine(resume or base, tokenizer, model_cfg, train_cfg, run_cfg.true_on_policy_mode)
        source = RolloutManager(rollout_cfg, engine, tokenizer, dataset, reward_fn)

    trainer = None
    if run_cfg.debug_rollout_only:
        logger.info("--debug-rollout-only: no trainer or reference model built; weight sync and checkpoint "
                    "saving are skipped")
    else:
        policy = load_causal_lm(resume or base, **load)
        ref = load_causal_lm(model_cfg.ref_load or base, **load) if train_cfg.needs_ref else None
        trainer = Trainer(train_cfg, policy, ref, pad_token_id=tokenizer.pad_token_id, precision=model_cfg.precision,
                          record_hashes=run_cfg.debug_determinism)
        if engine is None:
            logger.info("--debug-train-only: no rollout engine built; weight sync is skipped")
    logger.info("Models in memory: %s", _model_memory(engine, trainer))

    if state is not None:
        if trainer is not None:
            trainer.load_state_dict(state)
        if dataset is not None and "data" in state:
            dataset.load_state_dict(state["data"])
        logger.info("Resuming after step %d from %s", start_step, resume)
    rm_type = None if rollout_cfg.custom_rm_path else rollout_cfg.rm_type  # a custom reward's format is unknown
    context = CheckContext(_vocab_size(base, tokenizer), model_cfg.precision, bool(tokenizer.chat_template),
                           rollout_cfg.apply_chat_template, rm_type, rollout_cfg.label_key)
    return Components(tokenizer, source, engine, trainer, dataset, start_step, context)


def build_engine(path, tokenizer, model_cfg: ModelConfig, train_cfg: TrainConfig, true_on_policy: bool) -> LocalEngine:
    """The rollout engine: bf16 weights in bf16 runs; in true on-policy mode the trainer's own
    numerics instead (fp32 weights under the trainer's autocast) and a check of every rollout."""
    load = dict(device=model_cfg.device, attention_backend=model_cfg.attention_backend)
    if not true_on_policy:
        dtype = torch.bfloat16 if model_cfg.precision == "bf16" else torch.float32
        model = load_causal_lm(path, dtype=dtype, **load)
        return LocalEngine(model, eos_token_ids=eos_token_ids(model, tokenizer), pad_token_id=tokenizer.pad_token_id)
    model = load_causal_lm(path, dtype=torch.float32, **load)
    engine = LocalEngine(model, eos_token_ids=eos_token_ids(model, tokenizer), pad_token_id=tokenizer.pad_token_id,
                         autocast=lambda: mixed_precision(model_cfg.precision, model_cfg.device))
    engine.verifier = TrainerComputationVerifier(micro_batch_size=train_cfg.micro_batch_size,
                                                 temperature=train_cfg.rollout_temperature,
                                                 pad_token_id=tokenizer.pad_token_id)
    logger.info("--true-on-policy-mode: the engine samples from the trainer's own computation (score_rollout, "
                "micro-batch %d, %s) and reports its log-probs", train_cfg.micro_batch_size, model_cfg.precision)
    return engine


def _vocab_size(base: Path, tokenizer) -> int:
    from transformers import AutoConfig

    return max(AutoConfig.from_pretrained(base).vocab_size, len(tokenizer))


def _model_memory(engine: LocalEngine | None, trainer: Trainer | None) -> str:
    models = {"engine": engine.model if engine else None,
              "policy": trainer.model if trainer else None,
              "reference": trainer.ref_model if trainer else None}
    parts = [f"{name} {sum(p.numel() * p.element_size() for p in m.parameters()) / 2**20:.1f} MiB"
             for name, m in models.items() if m is not None]
    return ", ".join(parts)


def dump_metadata(model_cfg: ModelConfig, rollout_cfg: RolloutConfig, run_cfg: RunConfig) -> dict:
    """What a replay needs to know about how a rollout was made."""
    return {
        "miles_version": __version__,
        "hf_checkpoint": str(resolve_checkpoint(model_cfg.hf_checkpoint)),
        "load": run_cfg.load,
        "precision": model_cfg.precision,
        "seed": rollout_cfg.seed,
        "rollout_batch_size": rollout_cfg.batch_size,
        "n_samples_per_prompt": rollout_cfg.n_samples_per_prompt,
        "max_new_tokens": rollout_cfg.sampling.max_new_tokens,
        "temperature": rollout_cfg.sampling.temperature,
        "top_p": rollout_cfg.sampling.top_p,
        "apply_chat_template": rollout_cfg.apply_chat_template,
        "rm_type": rollout_cfg.custom_rm_path or rollout_cfg.rm_type,
    }


def rollout_metrics(samples: list[Sample]) -> dict[str, float]:
    n = len(samples)
    metrics = {
        "rollout/reward_mean": sum(s.reward for s in samples) / n,
        "rollout/response_len_mean": sum(s.response_length for s in samples) / n,
        "rollout/truncated_frac": sum(s.status == "truncated" for s in samples) / n,
    }
    log_probs = [lp for s in samples for lp, m in zip(s.rollout_log_probs, s.loss_mask) if m]
    if log_probs:  # the engine's mean log-prob per trained token
        metrics["rollout/rollout_log_probs"] = sum(log_probs) / len(log_probs)
    return metrics


def log_step(step: int, total: int, m: dict[str, float]) -> None:
    parts = [f"step {step}/{total}", f"reward {m['rollout/reward_mean']:.3f}",
             f"resp_len {m['rollout/response_len_mean']:.1f}"]
    if "train/loss" in m:
        parts += [f"loss {m['train/loss']:.4f}", f"grad_norm {m['train/grad_norm']:.3f}",
                  f"ppo_kl {m['train/ppo_kl']:.2e}"]
    if "forward_logp_max_diff" in m:
        parts.append(f"forward_logp_max_diff {m['forward_logp_max_diff']:.2e}")
    speed = [f"{k.split('/')[1].split('_')[0]} {m[k]:.0f} tok/s" for k in ("perf/rollout_tok_s", "perf/train_tok_s")
             if k in m]
    parts.append(f"{m['perf/step_time_s']:.1f}s ({', '.join(speed)})")
    logger.info(" | ".join(parts))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
