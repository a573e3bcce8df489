"""`miles train`: validate everything that needs no model, then run the RL loop."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from miles.cli.train_args import add_train_args, validate_train_args
from miles.data.prompts import (
    BUNDLED_EVAL,
    BUNDLED_EVAL_NAME,
    BUNDLED_INPUT_KEY,
    BUNDLED_LABEL_KEY,
    BUNDLED_TASK,
    load_prompt_data,
)
from miles.errors import UsageError


def register(commands) -> None:
    p = commands.add_parser("train", help="run GRPO-family RL training (no flags: the built-in demo recipe)",
                            description="Generate, reward, train and sync weights, step after step. "
                                        "With no flags: the demo model on the bundled arithmetic task.")
    add_train_args(p)
    p.set_defaults(run=run)


def resolve_data_args(args: argparse.Namespace) -> None:
    """The bundled task when --prompt-data is absent; keys, template and reward to match, and its
    held-out problems evaluated before the first step and after the last (unless --eval-* say
    otherwise; --eval-interval 0 turns evaluation off)."""
    bundled = args.prompt_data is None
    if bundled:
        args.prompt_data = str(BUNDLED_TASK)
        args.input_key = args.input_key or BUNDLED_INPUT_KEY
        args.label_key = args.label_key or BUNDLED_LABEL_KEY
        replay = args.load_debug_rollout_data is not None or args.debug_train_only
        if args.eval_prompt_data is None and args.eval_interval != 0 and not replay and not args.async_rollout:
            args.eval_prompt_data = [BUNDLED_EVAL_NAME, str(BUNDLED_EVAL)]
            args.eval_interval = args.eval_interval or args.num_rollout
    if args.eval_interval == 0:
        args.eval_interval = args.eval_prompt_data = None
    args.input_key = args.input_key or "prompt"
    if args.apply_chat_template is None:
        args.apply_chat_template = bundled
    if args.rm_type is None:
        args.rm_type = "math"


def resolve_device(args: argparse.Namespace) -> None:
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    if args.precision is None:
        args.precision = "bf16" if args.device == "cuda" else "fp32"
    if args.true_on_policy_check == "auto":
        # On a GPU the engine's decode runs the trainer's batch-invariant kernels, so its log-probs are the training
        # forward's by construction and that forward checks them; on a CPU they may differ in the last bits.
        args.true_on_policy_check = "stop" if args.device == "cuda" and args.true_on_policy_mode else "rescore"


PATH_FLAGS = ("hf_checkpoint", "ref_load", "load", "save", "output_dir", "prompt_data", "save_debug_rollout_data",
              "load_debug_rollout_data")


def resolve_paths(args: argparse.Namespace) -> None:
    """Makes every path flag absolute, once: config.json then names the same files from any working
    directory (`miles report`, `miles doctor`, a resume started elsewhere)."""
    for flag in PATH_FLAGS:
        value = getattr(args, flag)
        if value is not None:
            setattr(args, flag, os.path.abspath(os.path.expanduser(value)))


def prepare(args: argparse.Namespace):
    """Checks and resolves the flags, loads the prompt data and the reward function.

    Returns (data, reward_fn); both None for a replay, which takes them from the dumps.
    """
    validate_train_args(args)
    resolve_data_args(args)
    resolve_paths(args)
    if args.eval_prompt_data:  # NAME PATH pairs: the paths absolute, each set readable with the run's keys
        args.eval_prompt_data = [v if i % 2 == 0 else os.path.abspath(os.path.expanduser(v))
                                 for i, v in enumerate(args.eval_prompt_data)]
        for path in args.eval_prompt_data[1::2]:
            load_prompt_data(path, args.input_key, args.label_key, scalar_labels=args.custom_rm_path is None)
    data = reward_fn = None
    if args.load_debug_rollout_data is None:  # a replay takes prompts and rewards from the dumps
        data = load_prompt_data(args.prompt_data, args.input_key, args.label_key,
                                scalar_labels=args.custom_rm_path is None)
        if args.label_key is None and args.custom_rm_path is None:
            raise UsageError(f"--rm-type {args.rm_type} needs labels: pass --label-key (keys in {args.prompt_data}: "
                             f"{', '.join(data.keys)}), or a --custom-rm-path that needs none")
        from miles.rollout.rewards import get_reward_fn

        reward_fn = get_reward_fn(args.rm_type, args.custom_rm_path)
        if args.custom_generate_function_path:  # importable and async, before any model loads
            from miles.rollout.custom_generate import load_generate

            load_generate(args.custom_generate_function_path)
        if args.dynamic_sampling_filter_path:  # importable and callable, before any model loads
            from miles.rollout.filters import FLAG
            from miles.utils.imports import load_function

            load_function(args.dynamic_sampling_filter_path, FLAG)
    # Only now, with every flag and the data checked, pay for torch.
    resolve_device(args)
    return data, reward_fn


def run_config(args: argparse.Namespace, path: Path) -> dict:
    """config.json: every resolved flag of this invocation, the command line that started the run
    (kept when a run is resumed into its own directory) and every invocation since, in order."""
    import json
    from datetime import datetime

    previous = json.loads(path.read_text()) if path.is_file() else {}
    invocation = {"command_line": args.command_line, "started": datetime.now().isoformat(timespec="seconds"),
                  "load": args.load}
    flags = {k: v for k, v in vars(args).items() if k not in ("run", "command_line")}
    return {**flags, "command_line": previous.get("command_line", args.command_line),
            "invocations": previous.get("invocations", []) + [invocation]}


def check_writable(args: argparse.Namespace) -> None:
    """The output dir, the save dir and the dump dir, before any model loads (an unwritable --save
    found at the final save would cost the whole run)."""
    from miles.bridge.dump_paths import dump_path
    from miles.utils.io import check_writable_dir

    check_writable_dir(args.output_dir, "--output-dir")
    if args.save:
        check_writable_dir(args.save, "--save")
    if args.save_debug_rollout_data:
        check_writable_dir(dump_path(args.save_debug_rollout_data, 0).parent, "--save-debug-rollout-data")


def claim_run_dirs(args: argparse.Namespace) -> tuple[list, list[str]]:
    """Locks the output dir (and a --save dir elsewhere): one run per directory. Returns the locks
    and notes for the log. A dir that already holds a run with checkpoints needs --load; one whose
    run stopped before its first checkpoint is restarted in place."""
    from miles.cli.train_args import check_not_a_finished_lineage
    from miles.utils.run_dirs import holds_rows
    from miles.utils.run_lock import RunLock

    output = Path(args.output_dir)
    save = Path(args.save) if args.save else output / "checkpoints"
    locks, notes = [RunLock(output, flag="--output-dir", command_line=args.command_line)], []
    if save.parent != output:
        locks.append(RunLock(save, flag="--save", command_line=args.command_line))
    try:
        for lock in locks:
            if note := lock.acquire():
                notes.append(f"{lock.path.parent}: {note}")
        if args.load is None and holds_rows(output):  # again, now that no other run can be writing it
            check_not_a_finished_lineage(args.output_dir, args.save)
            notes.append(f"{output} holds a run that stopped before its first checkpoint: restarting it in place")
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks, notes


def run(args: argparse.Namespace) -> int:
    from miles.utils.cpu_threads import set_wait_policy

    set_wait_policy()  # before prepare() imports torch: libgomp reads it once, when torch loads it
    data, reward_fn = prepare(args)
    check_writable(args)
    locks, notes = claim_run_dirs(args)
    try:
        return run_locked(args, data, reward_fn, notes)
    finally:
        for lock in locks:
            lock.release()


def run_locked(args: argparse.Namespace, data, reward_fn, notes: list[str]) -> int:
    import logging
    import traceback

    from miles.config import build_configs
    from miles.errors import CheckFailed, RunFailed
    from miles.loop import run_training
    from miles.utils.io import atomic_write_json
    from miles.utils.logging import close_logging, setup_logging

    output_dir = Path(args.output_dir)
    setup_logging(output_dir)
    logger = logging.getLogger("miles")
    try:
        for note in notes:
            logger.info(note)
        if args.device == "cpu":  # the local engine and the trainer of this process
            from miles.utils.cpu_threads import setup_cpu_threads

            setup_cpu_threads()
        config = run_config(args, output_dir / "config.json")
        atomic_write_json(output_dir / "config.json", config)
        if data is not None and data.missing_labels:
            logger.warning("%d of %d rows of %s have no %r label: their reward is 0", data.missing_labels,
                           len(data.records), data.path, args.label_key)
        run_training(build_configs(args), data=data, reward_fn=reward_fn, config=config)
    except (UsageError, CheckFailed, RunFailed) as e:  # the `error:` line goes to stderr too (cli/main.py)
        logger.error("error: %s", e)
        raise
    except OSError as e:  # the disk filled, a directory went read-only, ...
        message = f"{e.strerror or e} writing {e.filename}" if e.filename else f"{e}"
        logger.error("error: %s", message)
        raise RunFailed(f"{message}; the last checkpoint on disk is intact, resume from it once this is fixed") from e
    except Exception as e:
        logger.error("Crashed: %s: %s\n%s", type(e).__name__, e, traceback.format_exc().rstrip())
        raise
    finally:
        close_logging()
    return 0
