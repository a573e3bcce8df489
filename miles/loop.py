"""The RL loop of `miles train`, top to bottom: generate -> train -> sync weights -> save.

Every branch lives in a component behind a seam: a `RolloutSource` (live generation with an
`Engine`, or a `ReplaySource` reading dumps) makes each rollout's `Sample`s; the `Trainer` turns
them into optimizer steps; a `WeightTransport` carries the weights back to the engine.
`--debug-rollout-only` builds no trainer; `--debug-train-only` builds no engine.

Scale-out changes components, not the loop: with `--actor-num-gpus-per-node` the trainer is a
`TrainerGroup` of Ray-hosted ranks (miles/cluster) and servers are started by engine actors;
`--colocate` adds turns on the shared device (`c.turns`); `--async` makes the source an
`AheadRollouts` that generates rollout k+1 while rollout k trains.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from miles import __version__
from miles.bridge.rollout_dump import save_rollout
from miles.bridge.transports import DiskTransport, InProcessTransport, WeightTransport
from miles.bridge.types import RolloutBatch, Sample, TrainResult, mean_rollout_log_prob
from miles.bridge.weight_probe import compare_probe, probe_tokens
from miles.bridge.weight_sync import SyncStats, log_sync, verify_digests
from miles.config import Configs
from miles.data.prompts import PromptData, PromptDataset
from miles.debug.alignment import CheckContext, report, run_checks
from miles.debug.attribution import log_attribution
from miles.debug.determinism import HashWriter, enable_deterministic_mode, rollout_hashes
from miles.debug.print_rollout import log_rollout_samples
from miles.errors import CheckFailed, RunFailed, Stopped, UsageError, WorkerCrashed
from miles.cluster.colocate import Apart, Colocated
from miles.rollout.ahead import AheadRollouts
from miles.rollout.engine import Engine
from miles.rollout.evaluation import EvalSet, Evaluator
from miles.rollout.local import LocalEngine
from miles.rollout.local.true_on_policy import TrainerComputationVerifier
from miles.rollout.replay import ReplaySource
from miles.rollout.reward_guard import guarded_reward
from miles.rollout.rewards import RewardFn
from miles.rollout.source import LiveRollout, RolloutSource, drop_long_prompts
from miles.train.batch import score_sequences
from miles.train.checkpoint import (Checkpointer, abandon, clean_temporaries, find_latest_checkpoint,
                                    load_trainer_state, newer_steps)
from miles.train.trainer import Trainer, mixed_precision
from miles.utils import invariant
from miles.utils.jsonl import reconcile
from miles.utils.logging import MetricsWriter
from miles.utils.rng import rng_state, set_rng_state
from miles.utils.stopping import StopSignals
from miles.utils.models import (eos_token_ids, eos_token_ids_of_dir, load_causal_lm, load_tokenizer, quiet_transformers,
                                resolve_checkpoint)

logger = logging.getLogger("miles")


@dataclass
class Components:
    tokenizer: object
    source: RolloutSource  # where each rollout's samples come from
    engine: Engine | None  # LocalEngine or RemoteEngine; None with --debug-train-only
    trainer: Trainer | None  # or a TrainerGroup of Ray-hosted ranks; None with --debug-rollout-only
    transport: WeightTransport | None  # trainer -> engine; None when either side is absent
    checkpoints: Checkpointer | None  # when to save; None without a trainer
    dataset: PromptDataset | None  # None when replaying dumps
    start_step: int  # steps already done (resume)
    check_context: CheckContext  # what the alignment check needs to know
    cluster: object | None = None  # the ClusterRun hosting ranks and engines on Ray; None in one process
    turns: Apart = Apart()  # --colocate: trainer and engines take turns on the device
    evaluator: Evaluator | None = None  # --eval-prompt-data: held-out prompts through the engine
    done: int = 0  # the last step whose results are written
    in_step: bool = False  # between a step's first update and its results being written


def run_training(cfg: Configs, data: PromptData | None, reward_fn: RewardFn | None, config: dict) -> None:
    run, debug = cfg.run, cfg.debug
    output_dir = Path(run.output_dir)
    seed_everything(run.seed)
    quiet_transformers()
    logger.info("miles %s | device=%s precision=%s | output_dir=%s", __version__, cfg.model.device,
                cfg.model.precision, output_dir)
    if debug.deterministic_mode:
        enable_deterministic_mode(run.seed, cfg.model.device, cfg.model.attention_backend)
    if debug.true_on_policy_mode and cfg.model.device.startswith("cuda"):
        _use_batch_invariant_kernels(cfg)
    signals, c, outputs, closers = StopSignals(), None, [], contextlib.ExitStack()
    signals.install()  # from here on SIGTERM / SIGINT are logged, and the last finished step saved
    try:
        c = build_components(cfg, data, reward_fn, config, closers)
        for name in ("metrics.jsonl", "hashes.jsonl"):  # each step exactly once, also after a crash
            if note := reconcile(output_dir / name, c.start_step):
                logger.warning(note)
        hashes_out = HashWriter(output_dir) if debug.debug_determinism else None
        metrics_out = MetricsWriter(output_dir, tensorboard=run.use_tensorboard,
                                    wandb_project=run.wandb_project if run.use_wandb else None,
                                    wandb_group=run.wandb_group, config=config)
        outputs = [w for w in (metrics_out, hashes_out) if w is not None]
        train_steps(c, cfg, signals, metrics_out, hashes_out)
    except Stopped as stop:
        log_stop(c, cfg, stop)
        raise
    except RunFailed as e:  # an engine request failed: on Ray, say which engine actor died, if one did
        if c is not None and c.cluster is not None and not isinstance(e, WorkerCrashed):
            if (explained := c.cluster.explain(e)) is not e:
                raise explained from e
        raise
    finally:
        signals.restore()
        for writer in outputs:
            writer.close()
        closers.close()  # the servers this run started
    steps = run.num_rollout - c.start_step
    logger.info("Done: %d step%s; metrics in %s", steps, "" if steps == 1 else "s", output_dir / "metrics.jsonl")


def train_steps(c: Components, cfg: Configs, signals: StopSignals, metrics_out: MetricsWriter,
                hashes_out: HashWriter | None) -> None:
    """The steps themselves: generate, then (as one unit no signal splits) train, sync, record, save."""
    run, debug = cfg.run, cfg.debug
    dump_meta = dump_metadata(cfg)
    c.done, nonfinite_steps = c.start_step, 0
    if c.evaluator is not None and c.start_step == 0:  # the baseline every later evaluation compares with
        c.turns.for_rollout()
        metrics_out.write(0, c.evaluator.evaluate(0))
    for step in range(c.start_step + 1, run.num_rollout + 1):
        rollout_id = step - 1  # the engine holds the weights after `rollout_id` steps (one fewer with --async)
        step_start = time.perf_counter()
        c.turns.for_rollout()
        rollout = c.source.generate(rollout_id)  # a signal here stops the run at once
        if isinstance(c.source, AheadRollouts) and step < run.num_rollout:
            c.source.start(rollout_id + 1)  # generated while this one trains
        with signals.deferred():  # from here on the step lands whole, or not at all
            c.in_step = True
            metrics = {**rollout_metrics(rollout_id, rollout.samples), **rollout.stats}
            capture_rollout(cfg, rollout_id, rollout, metrics, dump_meta)
            checking = step == c.start_step + 1 and debug.alignment_check != "off"  # the step-1 alignment check
            gap = attribute_gap(c, cfg, rollout.samples) if checking and c.trainer is not None else None
            # --use-rollout-logprobs skips the trainer's scoring, except where the alignment check compares the two
            reuse = cfg.train.use_rollout_logprobs and not checking
            result = train_and_sync(c, cfg, rollout.samples, step, metrics, reuse) if c.trainer is not None else None
            nonfinite_steps = nonfinite_steps + 1 if result and result.nonfinite else 0
            if hashes_out is not None:
                hashing = time.perf_counter()
                hashes = {**rollout_hashes(rollout.samples), **(result.hashes if result else {})}
                metrics["perf/hash_s"] = metrics.get("perf/hash_s", 0.0) + time.perf_counter() - hashing
            if isinstance(c.turns, Colocated):
                metrics["perf/colocate_switch_s"] = c.turns.take_seconds()
            metrics["perf/step_time_s"] = time.perf_counter() - step_start
            if c.evaluator is not None and c.evaluator.due(step):  # after the sync: the weights this step made
                c.turns.for_rollout()
                metrics.update(c.evaluator.evaluate(step))
            if hashes_out is not None:
                hashes_out.write(step, hashes)
            metrics_out.write(step, metrics)  # before the checkpoint: a kill between the two redoes the step
            log_step(step, run.num_rollout, metrics)
            c.done, c.in_step = step, False
            if isinstance(c.source, AheadRollouts):
                c.source.done_with(rollout_id)
            guard_nonfinite(c, result, step, nonfinite_steps, run.max_nonfinite_steps)
            if debug.true_on_policy_mode:
                check_true_on_policy(metrics, step)
            if checking:
                log_rollout_samples(rollout_id, rollout.samples, limit=2)  # the guide's first look: coherent?
                checks = run_checks(rollout.samples, metrics, result.diagnostics if result else None,
                                    c.check_context, resumed_after=c.start_step)
                report(checks, debug.alignment_check, step,
                       explain=functools.partial(log_attribution, gap) if gap is not None else None)
            if c.checkpoints is not None:
                c.checkpoints.after_step(step)


def attribute_gap(c: Components, cfg: Configs, samples: list[Sample]):
    """Step 1, before it trains: if the train/engine gap is high, which factor moves it
    (miles.debug.attribution); logged after the alignment report when that warns about the gap."""
    from miles.debug.alignment import train_engine_bound
    from miles.debug.attribution import measure_mismatch

    if isinstance(c.turns, Colocated):  # the sides hold the device in turns; re-scoring both needs both
        return "--colocate: run it apart (without --colocate) to attribute"
    return measure_mismatch(samples, c.trainer, c.engine, temperature=cfg.rollout.sampling.temperature,
                            precision=cfg.model.precision, bound=train_engine_bound(cfg.model.precision))


def guard_nonfinite(c: Components, result: TrainResult | None, step: int, bad_in_a_row: int, limit: int) -> None:
    """Logs a step skipped for NaN/Inf; after `limit` in a row saves the (unchanged) weights and stops."""
    if result is None or result.nonfinite is None:
        return
    logger.warning("Skipped step %d: non-finite %s; parameters and optimizer unchanged (%d in a row, "
                   "--max-nonfinite-steps %d)", step, result.nonfinite, bad_in_a_row, limit)
    if bad_in_a_row >= limit:
        if c.checkpoints is not None:
            c.checkpoints.save(step)
        message = (f"Stopping: {bad_in_a_row} consecutive steps with non-finite values (--max-nonfinite-steps "
                   f"{limit}); last: {result.nonfinite}")
        logger.error(message)
        raise CheckFailed(message.removeprefix("Stopping: ") + "; no NaN/Inf reached the weights")


def check_true_on_policy(metrics: dict, step: int) -> None:
    """--true-on-policy-mode promises the engine's log-probs are the trainer's bit for bit; a step where they
    are not stops the run (after its metrics row is written)."""
    gap = metrics.get("forward_logp_max_diff", 0.0)  # the scoring's, or (--use-rollout-logprobs) the training forward's
    if gap != 0.0:
        message = (f"--true-on-policy-mode: at step {step} the engine's log-probs differ from the trainer's by up to "
                   f"{gap:.3g}; they must be equal bit for bit, so a kernel outside the mode's ran on one side: "
                   f"report it with `miles doctor RUN_DIR --bundle bug.md`")
        logger.error(message)
        raise CheckFailed(message)


def log_stop(c: Components | None, cfg: Configs, stop: Stopped) -> None:
    """The SIGTERM/SIGINT message: what was saved, how to resume. A stop between steps saves the
    last finished one; an immediate stop mid-step (a second signal) cannot."""
    if c is None:
        logger.warning("Stopped by %s while the run was starting; nothing to save", stop.signal_name)
        return
    done, mid_step, saved = c.done, c.in_step, None
    if isinstance(c.source, AheadRollouts):
        with contextlib.suppress(Exception):  # its rollout goes with the checkpoint when it is finished
            c.source.finish()
    c.turns.for_sync()  # a checkpoint gathers from the trainer's devices
    if c.checkpoints is not None and not mid_step:
        saved = c.checkpoints.save(done) or (c.checkpoints.root / f"step_{done}" if done else None)
    elif c.checkpoints is not None and c.checkpoints.saved_step:
        saved = c.checkpoints.root / f"step_{c.checkpoints.saved_step}"
    where = f"saved {saved}; resume with --load {cfg.run.output_dir}" if saved else "no checkpoint to resume from"
    during = f"during step {done + 1} of {cfg.run.num_rollout}" if done < cfg.run.num_rollout else "after the last step"
    logger.warning("Stopped by %s %s%s; %s", stop.signal_name, during,
                   " (a second signal: the step in progress is lost)" if mid_step else "", where)


def capture_rollout(cfg: Configs, rollout_id: int, rollout: RolloutBatch, metrics: dict, meta: dict) -> None:
    """--save-debug-rollout-data and --debug-rollout-print-every."""
    debug = cfg.debug
    if debug.save_debug_rollout_data:
        start = time.perf_counter()
        path = save_rollout(debug.save_debug_rollout_data, rollout_id, rollout.samples, meta)
        metrics["perf/rollout_dump_s"] = time.perf_counter() - start
        logger.info("Saved rollout %d (%d samples) to %s", rollout_id, len(rollout.samples), path)
    if debug.debug_rollout_print_every and rollout_id % debug.debug_rollout_print_every == 0:
        log_rollout_samples(rollout_id, rollout.samples)


def train_and_sync(c: Components, cfg: Configs, samples: list[Sample], step: int, metrics: dict,
                   rollout_log_probs: bool = False) -> TrainResult:
    """One rollout's optimizer steps (on the engine's log-probs as the old ones with `rollout_log_probs`), then the
    weights to the engine (if this run has one)."""
    c.turns.for_training()
    start = time.perf_counter()
    result = c.trainer.train(samples, rollout_log_probs=rollout_log_probs)
    metrics.update(result.metrics)
    if rollout_log_probs and not result.metrics.get("train/rollout_logprobs_used"):
        logger.warning("--use-rollout-logprobs: rollout %d has samples without engine log-probs (a custom "
                       "generate function?), so the trainer scored it", step - 1)
    metrics["perf/train_tok_s"] = sum(len(s.tokens) for s in samples) / (time.perf_counter() - start)
    if isinstance(c.source, AheadRollouts):
        wait = time.perf_counter()
        c.source.finish()  # never update an engine mid-generation
        metrics["perf/async_wait_s"] = time.perf_counter() - wait
    c.turns.for_sync()
    if c.transport is not None:
        sync = sync_weights(c, cfg, step)
        metrics["perf/weight_sync_s"] = sync.seconds
        if cfg.debug.alignment_check == "error" and sync.failed:
            raise CheckFailed(f"weight sync check failed at step {step} (see `weight_sync` lines)")
    return result


def sync_weights(c: Components, cfg: Configs, step: int) -> SyncStats:
    """Trainer -> engine, then the checks asked for: digests (--check-weight-update-equal,
    --debug-weight-sync) and, always, the engine's buffers."""
    debug = cfg.debug
    stats = c.trainer.send_weights(c.transport, step)
    stats.engines = len(getattr(c.engine, "servers", [c.engine]))
    if debug.check_weight_update_equal or debug.debug_weight_sync:
        engine_sums = c.engine.weights_checksum()  # None: the engine's digests are not comparable
        expected = c.trainer.weight_digests({name: s.dtype for name, s in (engine_sums or {}).items()})
        verify_digests(stats, expected, engine_sums if debug.check_weight_update_equal else None,
                       debug.debug_weight_sync)
        if engine_sums is None and debug.check_weight_update_equal:
            tokens = probe_tokens(c.tokenizer)
            compare_probe(stats, c.trainer.prompt_log_probs(tokens), c.engine.prompt_log_probs(tokens),
                          cfg.model.precision)
    stats.buffer_problems = c.engine.check_buffers()
    log_sync(stats)
    return stats


def save_root(cfg: Configs) -> Path:
    return Path(cfg.run.save) if cfg.run.save else Path(cfg.run.output_dir) / "checkpoints"


def build_components(cfg: Configs, data: PromptData | None, reward_fn: RewardFn | None, config: dict,
                     closers: contextlib.ExitStack) -> Components:
    model_cfg, run, debug = cfg.model, cfg.run, cfg.debug
    base = resolve_checkpoint(model_cfg.hf_checkpoint)
    tokenizer = load_tokenizer(base)
    resume, state = resume_point(cfg, config)
    start_step = state["step"] if state is not None else 0

    cluster = None
    if cfg.cluster.ranks is not None:
        from miles.cluster.run import ClusterRun

        cluster = ClusterRun(cfg, closers)
    engine = dataset = None
    if debug.load_debug_rollout_data:
        logger.info("--load-debug-rollout-data %s: replaying captured rollouts, so --debug-train-only is on",
                    debug.load_debug_rollout_data)
        replay = ReplaySource(debug.load_debug_rollout_data, vocab_size=_vocab_size(base, tokenizer),
                              rollout_batch_size=cfg.rollout.batch_size,
                              n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
                              needs_log_probs=cfg.train.use_tis or cfg.train.use_rollout_logprobs)
        replay.check_all(range(start_step, run.num_rollout))
        source: RolloutSource = replay
    else:
        records = drop_long_prompts(data.records, tokenizer, apply_chat_template=cfg.data.apply_chat_template,
                                    max_prompt_len=cfg.data.max_prompt_len,
                                    max_positions=_max_positions(base) - cfg.rollout.sampling.max_new_tokens)
        dataset = PromptDataset(records, shuffle=cfg.data.shuffle, seed=run.seed)
        if state is not None and "sha256" in state.get("data", {}):
            dataset.check_fingerprint(state["data"])
        engine = build_engine(resume or base, tokenizer, cfg, weight_version=start_step, closers=closers,
                              launch=cluster.launch_engines if cluster and cluster.placement.engines else None)
        name = f"--custom-rm-path {cfg.rollout.custom_rm_path}" if cfg.rollout.custom_rm_path else \
            f"--rm-type {cfg.rollout.rm_type}"
        reward_fn = guarded_reward(reward_fn, name, cfg.rollout.reward_timeout)  # the rollouts' and the evaluation's
        source = LiveRollout(cfg.rollout, engine, tokenizer, dataset, reward_fn,
                             apply_chat_template=cfg.data.apply_chat_template, seed=run.seed)
        if cfg.cluster.async_rollout:
            if isinstance(engine, LocalEngine) and cluster is not None:
                logger.warning("--async with --rollout-backend local generates in a thread of this process; with the "
                               "trainer on Ray that thread ran 5-7x slower on an H200 and the step 1.5-2.3x slower "
                               "than sync (benchmarks/BENCHMARKS.md): use a server backend (--rollout-backend sglang) "
                               "to overlap for real")
            pending = (state or {}).get("async_pending")
            source = AheadRollouts(source, pending=pending if pending and pending["rollout_id"] == start_step else None)

    trainer = checkpoints = None
    if debug.debug_rollout_only:
        logger.info("--debug-rollout-only: no trainer or reference model built; weight sync and checkpoint "
                    "saving are skipped")
    else:
        trainer = build_trainer(cfg, resume or base, base, tokenizer) if cluster is None else \
            cluster.start_trainer(resume or base, base, prepare=_worker_preparation(cfg))
        if engine is None:
            logger.info("--debug-train-only: no rollout engine built; weight sync is skipped")
        if cfg.train.use_rollout_logprobs:
            why = " (on with --true-on-policy-mode: they are the trainer's own computation)" \
                if debug.true_on_policy_mode else ""
            logger.info("--use-rollout-logprobs%s: the ratio's old log-probs are the engine's; the trainer scores "
                        "a rollout %s; its training forward is compared with them (forward_logp_max_diff)", why,
                        "never" if debug.alignment_check == "off" else "only for the step-1 alignment check")
        in_root = resume is not None and resume.parent.resolve() == save_root(cfg).resolve()

        def extra_state() -> dict:
            ahead = source.pending_state(c.done) if isinstance(source, AheadRollouts) else None
            return {"config": config, "rng": rng_state(), **({"data": dataset.fingerprint()} if dataset else {}),
                    **({"async_pending": ahead} if ahead else {})}

        checkpoints = Checkpointer(trainer.save_fn(tokenizer), root=save_root(cfg), interval=run.save_interval,
                                   keep=run.keep_checkpoints, last_step=run.num_rollout,
                                   saved_step=start_step if in_root else 0, extra_state=extra_state)
    logger.info("Models in memory: %s", _model_memory(engine, trainer))

    if state is not None:
        if trainer is not None:
            trainer.load_state_dict(state)
        if "rng" in state:  # last: loading models must not move the streams
            set_rng_state(state["rng"])
        logger.info("Resuming after step %d from %s", start_step, resume)
    transport = None
    if engine is not None and trainer is not None:
        transport = InProcessTransport(engine) if isinstance(engine, LocalEngine) else \
            DiskTransport(engine, Path(run.output_dir) / "engine_weights", untie=engine.untie)
    rm_type = None if cfg.rollout.custom_rm_path else cfg.rollout.rm_type  # a custom reward's format is unknown
    context = CheckContext(vocab_size=_vocab_size(base, tokenizer), precision=model_cfg.precision,
                           has_template=bool(tokenizer.chat_template), applied_template=cfg.data.apply_chat_template,
                           rm_type=rm_type, label_key=cfg.data.label_key)
    colocated = cfg.cluster.colocate and trainer is not None and engine is not None
    turns = Colocated(trainer, engine) if colocated else Apart()
    c = Components(tokenizer, source, engine, trainer, transport, checkpoints, dataset, start_step, context,
                   cluster=cluster, turns=turns, evaluator=build_evaluator(cfg, engine, tokenizer, reward_fn, base))
    return c


def build_evaluator(cfg: Configs, engine: Engine | None, tokenizer, reward_fn: RewardFn | None,
                    base: Path) -> Evaluator | None:
    """--eval-prompt-data's sets, each prompt checked to fit the model as the training prompts are;
    `reward_fn` is the rollouts' (guarded)."""
    if cfg.eval.interval is None or engine is None:
        return None
    from miles.data.prompts import load_prompt_data

    sets = []
    room = _max_positions(base) - cfg.eval.sampling.max_new_tokens
    for name, path in cfg.eval.datasets:
        data = load_prompt_data(path, cfg.data.input_key, cfg.data.label_key,
                                scalar_labels=cfg.rollout.custom_rm_path is None)
        records = drop_long_prompts(data.records, tokenizer, apply_chat_template=cfg.data.apply_chat_template,
                                    max_prompt_len=cfg.data.max_prompt_len, max_positions=room)
        sets.append(EvalSet(name, records))
        logger.info("eval set %s: %d prompts from %s, %d response(s) each, temperature %g, every %d step(s)", name,
                    len(records), path, cfg.eval.n_samples_per_prompt, cfg.eval.sampling.temperature,
                    cfg.eval.interval)
    return Evaluator(cfg.eval, sets, engine, tokenizer, reward_fn, apply_chat_template=cfg.data.apply_chat_template,
                     seed=cfg.run.seed)


def resume_point(cfg: Configs, config: dict) -> tuple[Path | None, dict | None]:
    """The checkpoint --load names and its trainer state (None, None for a fresh run), after the
    lineage checks: no resume past --num-rollout, no silent branch from an older step of the save
    dir; leftovers of a killed save are removed and changed flags listed."""
    run, root = cfg.run, save_root(cfg)
    if freed := clean_temporaries(root):
        logger.info("Removed unfinished checkpoint dirs (%.1f MiB) left in %s by a save that was killed", freed / 2**20,
                    root)
    if not run.load:
        return None, None
    resume = find_latest_checkpoint(run.load)
    state = load_trainer_state(resume)
    step = state["step"]
    if step >= run.num_rollout:
        raise UsageError(f"--load {run.load}: the checkpoint is at step {step}, so --num-rollout "
                         f"{run.num_rollout} leaves nothing to do; --num-rollout counts from step 1")
    if newer := newer_steps(root, step):
        if not run.allow_branch:
            raise UsageError(f"--load {resume}: the save dir {root} already holds later steps "
                             f"({', '.join(f'step_{n}' for n in newer)}) "
                             f"of this run; resuming from step {step} would mix two lineages. Resume the latest "
                             f"(--load {root}), pass --allow-branch (the later steps are moved aside), or a new --save")
        aside = abandon(root, step)
        logger.warning("--allow-branch: resuming from step %d; moved the later steps %s to %s", step,
                       ", ".join(f"step_{n}" for n in newer), aside)
    if changed := changed_flags(state.get("config", {}), config):
        logger.warning("Resuming with flags that differ from the checkpoint's run (this run's apply, the optimizer's "
                       "learning rate and weight decay included): %s", "; ".join(changed))
    return resume, state


def changed_flags(before: dict, now: dict) -> list[str]:
    bookkeeping = {"command_line", "invocations", "load", "output_dir", "allow_branch"}
    return [f"--{key.replace('_', '-')} {now[key]} (was {before[key]})" for key in sorted(now)
            if key not in bookkeeping and key in before and before[key] != now[key]]


def build_trainer(cfg: Configs, weights: Path, base: Path, tokenizer) -> Trainer:
    load = dict(device=cfg.model.device, attention_backend=cfg.model.attention_backend)
    policy = load_causal_lm(weights, **load)
    ref = load_causal_lm(cfg.model.ref_load or base, **load) if cfg.train.needs_ref else None
    return Trainer(cfg.train, policy, ref, temperature=cfg.rollout.sampling.temperature,
                   group_size=cfg.rollout.n_samples_per_prompt, pad_token_id=tokenizer.pad_token_id,
                   precision=cfg.model.precision, record_hashes=cfg.debug.debug_determinism,
                   strict_deterministic_backward=not cfg.cluster.async_rollout)


def _worker_preparation(cfg: Configs):
    """What each trainer rank runs before it loads a model: deterministic mode, when asked."""
    if not cfg.debug.deterministic_mode:
        return None
    return functools.partial(enable_deterministic_mode, cfg.run.seed, cfg.model.device, cfg.model.attention_backend)


def build_engine(path, tokenizer, cfg: Configs, *, weight_version: int, closers: contextlib.ExitStack,
                 launch=None) -> Engine:
    """The rollout engine. Local: bf16 weights in bf16 runs; in true on-policy mode the trainer's
    own numerics instead (fp32 weights under the trainer's autocast; on a GPU the batch-invariant
    kernels) and a check of every rollout against the trainer's scoring.
    Remote: the servers of --sglang-url / --vllm-url, or ones started on `path` (by `launch`, engine
    actors on Ray, when given); no model loaded here."""
    model_cfg = cfg.model
    if cfg.engines.backend != "local":
        from miles.rollout.remote import connect  # httpx and the launcher only for remote runs

        return connect(cfg.engines, model_dir=str(path), closers=closers, precision=model_cfg.precision,
                       seed=cfg.run.seed, max_model_len=_max_model_len(path, cfg),
                       vocab_size=_vocab_size(path, tokenizer),
                       eos_token_ids=eos_token_ids_of_dir(path, tokenizer), weight_version=weight_version,
                       work_dir=Path(cfg.run.output_dir) / "engine_weights", launch=launch, device=model_cfg.device,
                       mem_fraction=cfg.engines.mem_fraction_static)
    load = dict(device=model_cfg.device, attention_backend=model_cfg.attention_backend)
    engines = cfg.engines
    common = dict(pad_token_id=tokenizer.pad_token_id, weight_version=weight_version, decoder=engines.local_decoder,
                  cuda_graphs=engines.cuda_graphs, compile=engines.torch_compile,
                  mem_fraction=engines.mem_fraction_static)
    if not cfg.debug.true_on_policy_mode:
        dtype = torch.bfloat16 if model_cfg.precision == "bf16" else torch.float32
        model = load_causal_lm(path, dtype=dtype, **load)
        return LocalEngine(model, eos_token_ids=eos_token_ids(model, tokenizer), **common)
    if cfg.debug.true_on_policy_check == "stop" and model_cfg.device != "cuda":
        raise UsageError("--true-on-policy-check stop needs a GPU's batch-invariant kernels (--device cuda): on "
                         "the CPU the engine's decode and the trainer's forward differ in their last bits, so the "
                         "run would stop at step 1; use --true-on-policy-check rescore")
    model = load_causal_lm(path, dtype=torch.float32, **load)
    # Its decode steps replay the autocast's casts in CUDA graphs, so it casts without a cache.
    engine_autocast = functools.partial(mixed_precision, model_cfg.precision, model_cfg.device, cache=False)
    if cfg.debug.true_on_policy_check == "stop":
        logger.info("--true-on-policy-mode, --true-on-policy-check stop (auto's choice on a GPU): the engine reports "
                    "its own log-probs, no scoring pass; a step where they are not the trainer's bit for bit stops "
                    "the run")
        return LocalEngine(model, eos_token_ids=eos_token_ids(model, tokenizer), autocast=engine_autocast, **common)
    autocast = functools.partial(mixed_precision, model_cfg.precision, model_cfg.device)
    score = functools.partial(score_sequences, micro_batch_size=cfg.train.micro_batch_size,
                              temperature=cfg.rollout.sampling.temperature, pad_token_id=tokenizer.pad_token_id,
                              autocast=autocast, **cfg.train.scoring_layout)
    logger.info("--true-on-policy-mode: the engine samples from the trainer's own computation (score_rollout, "
                "micro-batch %d, %s, --qkv-format %s) and reports its log-probs", cfg.train.micro_batch_size,
                model_cfg.precision, cfg.train.qkv_format)
    return LocalEngine(model, eos_token_ids=eos_token_ids(model, tokenizer), autocast=engine_autocast,
                       verifier=TrainerComputationVerifier(score), **common)


def _use_batch_invariant_kernels(cfg: Configs) -> None:
    """--true-on-policy-mode on a GPU: the engine's decode and the trainer's forward run miles.utils.invariant's
    kernels, so that they compute the same numbers and the check after each rollout finds nothing to re-draw."""
    if cfg.train.qkv_format != "thd":
        raise UsageError(f"--true-on-policy-mode on a GPU runs batch-invariant attention over packed sequences: "
                         f"drop --qkv-format {cfg.train.qkv_format} (thd is the default)")
    if not invariant.available():
        raise UsageError("--true-on-policy-mode on a GPU needs Triton for its batch-invariant kernels "
                         "(it ships with torch's CUDA builds): pip install triton")
    invariant.enable()
    logger.info("--true-on-policy-mode: matmuls, RMSNorm, attention and the sampler's draw run batch-invariant "
                "kernels (miles.utils.invariant) in the engine and the trainer")


def _max_model_len(path, cfg: Configs) -> int:
    """What servers miles starts are sized for: the model's positions, capped at 4096 on a CPU."""
    return min(_max_positions(path), 4096 if cfg.model.device == "cpu" else 1 << 30)


def _max_positions(base: Path) -> int:
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(base), "max_position_embeddings", None) or 1 << 30


def _vocab_size(base: Path, tokenizer) -> int:
    from transformers import AutoConfig

    return max(AutoConfig.from_pretrained(base).vocab_size, len(tokenizer))


def _model_memory(engine: Engine | None, trainer: Trainer | None) -> str:
    sizes = {**({"engine": engine.memory_bytes()} if isinstance(engine, LocalEngine) else {}),
             **(trainer.memory_bytes() if trainer else {})}
    parts = [f"{name} {n / 2**20:.1f} MiB" for name, n in sizes.items()]
    if engine is not None and not isinstance(engine, LocalEngine):
        parts.append(f"engine in {len(engine.servers)} server process(es)")
    return ", ".join(parts) or "none"


def dump_metadata(cfg: Configs) -> dict:
    """What a replay needs to know about how a rollout was made."""
    sampling = cfg.rollout.sampling
    return {
        "miles_version": __version__,
        "hf_checkpoint": str(resolve_checkpoint(cfg.model.hf_checkpoint)),
        "load": cfg.run.load,
        "precision": cfg.model.precision,
        "seed": cfg.run.seed,
        "rollout_batch_size": cfg.rollout.batch_size,
        "n_samples_per_prompt": cfg.rollout.n_samples_per_prompt,
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "apply_chat_template": cfg.data.apply_chat_template,
        "rm_type": cfg.rollout.custom_rm_path or cfg.rollout.rm_type,
    }


def rollout_metrics(rollout_id: int, samples: list[Sample]) -> dict[str, float]:
    n = len(samples)
    metrics = {
        "rollout/reward_mean": sum(s.reward for s in samples) / n,
        "rollout/response_len_mean": sum(s.response_length for s in samples) / n,
        "rollout/truncated_frac": sum(s.status == "truncated" for s in samples) / n,
    }
    versions = [s.weight_version for s in samples if s.weight_version is not None]
    if versions:  # optimizer steps the weights that made it were behind the trainer's (1 with --async)
        metrics["rollout/staleness"] = rollout_id - sum(versions) / len(versions)
    mean_logp = mean_rollout_log_prob(samples)
    if mean_logp is not None:  # the engine's mean log-prob per trained token
        metrics["rollout/rollout_log_probs"] = mean_logp
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
