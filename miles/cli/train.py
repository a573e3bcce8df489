"""`miles train`: validate everything that needs no model, then run the RL loop."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from miles.cli.train_args import add_train_args, validate_train_args
from miles.data.prompts import BUNDLED_INPUT_KEY, BUNDLED_LABEL_KEY, BUNDLED_TASK, load_prompt_data
from miles.errors import UsageError


def register(commands) -> None:
    p = commands.add_parser("train", help="run GRPO-family RL training (no flags: the built-in demo recipe)",
                            description="Generate, reward, train and sync weights, step after step. "
                                        "With no flags: the demo model on the bundled arithmetic task.")
    add_train_args(p)
    p.set_defaults(run=run)


def resolve_data_args(args: argparse.Namespace) -> None:
    """The bundled task when --prompt-data is absent; keys, template and reward to match."""
    bundled = args.prompt_data is None
    if bundled:
        args.prompt_data = str(BUNDLED_TASK)
        args.input_key = args.input_key or BUNDLED_INPUT_KEY
        args.label_key = args.label_key or BUNDLED_LABEL_KEY
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
    data = reward_fn = None
    if args.load_debug_rollout_data is None:  # a replay takes prompts and rewards from the dumps
        data = load_prompt_data(args.prompt_data, args.input_key, args.label_key)
        if args.label_key is None and args.custom_rm_path is None:
            raise UsageError(f"--rm-type {args.rm_type} needs labels: pass --label-key (keys in {args.prompt_data}: "
                             f"{', '.join(data.keys)}), or a --custom-rm-path that needs none")
        from miles.rollout.rewards import get_reward_fn

        reward_fn = get_reward_fn(args.rm_type, args.custom_rm_path)
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


def run(args: argparse.Namespace) -> int:
    data, reward_fn = prepare(args)
    from miles.config import build_configs
    from miles.loop import run_training
    from miles.utils.io import atomic_write_json
    from miles.utils.logging import close_logging, setup_logging

    output_dir = Path(args.output_dir)
    setup_logging(output_dir)
    config = run_config(args, output_dir / "config.json")
    atomic_write_json(output_dir / "config.json", config)
    if data is not None and data.missing_labels:
        import logging

        logging.getLogger("miles").warning("%d of %d rows of %s have no %r label: their reward is 0",
                                           data.missing_labels, len(data.records), data.path, args.label_key)
    try:
        run_training(build_configs(args), data=data, reward_fn=reward_fn, config=config)
    finally:
        close_logging()
    return 0
