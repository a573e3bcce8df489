"""Typed configs, one per component, built once from the parsed flags.

Each component reads only its own section, so what it depends on is visible in its signature
rather than hidden in 40 `args.*` reads.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    hf_checkpoint: str | None  # None: the demo model
    ref_load: str | None  # None: the initial policy
    attention_backend: str  # sdpa | eager | flash
    precision: str  # fp32 | bf16
    device: str  # cpu | cuda


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float  # 0 means greedy
    top_p: float


@dataclass(frozen=True)
class RolloutConfig:
    batch_size: int  # prompts per rollout
    n_samples_per_prompt: int
    sampling: SamplingParams
    apply_chat_template: bool
    max_prompt_len: int | None
    shuffle: bool
    rm_type: str
    custom_rm_path: str | None
    seed: int
    label_key: str | None


@dataclass(frozen=True)
class TrainConfig:
    num_steps_per_rollout: int
    global_batch_size: int
    micro_batch_size: int
    lr: float
    weight_decay: float
    clip_grad: float  # 0 disables clipping
    advantage_estimator: str
    eps_clip: float
    eps_clip_high: float
    kl_coef: float  # reward shaping
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    use_tis: bool
    tis_clip: float
    rollout_temperature: float  # the trainer scores tokens at the temperature they were sampled at
    n_samples_per_prompt: int

    @property
    def needs_ref(self) -> bool:
        return (self.use_kl_loss and self.kl_loss_coef > 0) or self.kl_coef > 0


@dataclass(frozen=True)
class RunConfig:
    output_dir: str
    num_rollout: int
    seed: int
    save: str | None
    save_interval: int | None
    load: str | None
    use_tensorboard: bool
    use_wandb: bool
    wandb_project: str
    wandb_group: str | None
    debug_rollout_only: bool  # build no trainer
    save_debug_rollout_data: str | None  # dump template, with {rollout_id}
    load_debug_rollout_data: str | None  # replay template; implies train-only (no engine)
    debug_rollout_print_every: int | None
    alignment_check: str  # off | warn | error
    check_weight_update_equal: bool
    debug_weight_sync: int
    deterministic_mode: bool
    debug_determinism: bool  # hashes.jsonl
    true_on_policy_mode: bool  # the engine samples from the trainer's computation


def build_configs(args: argparse.Namespace) -> tuple[ModelConfig, RolloutConfig, TrainConfig, RunConfig]:
    model = ModelConfig(args.hf_checkpoint, args.ref_load, args.attention_backend, args.precision, args.device)
    sampling = SamplingParams(args.rollout_max_response_len, args.rollout_temperature, args.rollout_top_p)
    rollout = RolloutConfig(
        args.rollout_batch_size, args.n_samples_per_prompt, sampling, args.apply_chat_template,
        args.rollout_max_prompt_len, args.rollout_shuffle, args.rm_type, args.custom_rm_path, args.seed,
        args.label_key)
    train = TrainConfig(
        args.num_steps_per_rollout, args.global_batch_size, args.micro_batch_size, args.lr, args.weight_decay,
        args.clip_grad, args.advantage_estimator, args.eps_clip, args.eps_clip_high, args.kl_coef,
        args.use_kl_loss, args.kl_loss_coef, args.kl_loss_type, args.use_tis, args.tis_clip,
        args.rollout_temperature, args.n_samples_per_prompt)
    run = RunConfig(args.output_dir, args.num_rollout, args.seed, args.save, args.save_interval, args.load,
                    args.use_tensorboard, args.use_wandb, args.wandb_project, args.wandb_group,
                    args.debug_rollout_only, args.save_debug_rollout_data, args.load_debug_rollout_data,
                    args.debug_rollout_print_every, args.alignment_check, args.check_weight_update_equal,
                    args.debug_weight_sync, args.deterministic_mode, args.debug_determinism,
                    args.true_on_policy_mode)
    return model, rollout, train, run
