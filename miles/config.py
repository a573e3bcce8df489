"""Typed configs, one per component, built once from the parsed flags.

Each component reads only its own section, so what it depends on is visible in its signature
rather than hidden in 40 `args.*` reads. Every config is keyword-only and built by keyword; a flag
lives in exactly one section (a component that needs another's value gets it as an argument).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    hf_checkpoint: str | None
    """HF model + tokenizer dir; None: the demo model."""
    ref_load: str | None
    """Reference model for the KL; None: the initial policy."""
    attention_backend: str
    """sdpa | eager | flash, for trainer and engine."""
    precision: str
    """fp32 | bf16 compute; master weights stay fp32."""
    device: str
    """cpu | cuda."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    prompt_data: str
    input_key: str
    label_key: str | None
    apply_chat_template: bool
    max_prompt_len: int | None
    """--rollout-max-prompt-len: longer prompts are dropped at load time."""
    shuffle: bool
    """--rollout-shuffle: a new order each epoch, seeded by --seed."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float
    """0 means greedy."""
    top_p: float


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    batch_size: int
    """Prompts per rollout."""
    n_samples_per_prompt: int
    """Responses per prompt: one GRPO group."""
    sampling: SamplingParams
    rm_type: str
    custom_rm_path: str | None
    reward_timeout: float
    """Seconds one sample's reward may take before the run stops with an error naming the function."""
    custom_generate_path: str | None = None
    """module:function of an async generate(client, sample, sampling) -> Sample (multi-turn, tools)."""
    dynamic_filter_path: str | None = None
    """Dynamic sampling: module:function deciding which groups a rollout keeps (None: every group)."""
    over_sampling_batch_size: int | None = None
    """Dynamic sampling: prompts generated per round (None: batch_size)."""
    dynamic_max_rounds: int = 8
    """Dynamic sampling: rounds of generation a rollout may take to find batch_size kept groups."""


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    interval: int | None
    """Evaluate before step 1 and after every `interval` steps; None: no evaluation."""
    datasets: tuple[tuple[str, str], ...]
    """(name, path) of each held-out prompt set."""
    n_samples_per_prompt: int
    sampling: SamplingParams
    """Greedy (temperature 0) by default."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    num_steps_per_rollout: int
    global_batch_size: int
    micro_batch_size: int
    lr: float
    weight_decay: float
    clip_grad: float
    """0 disables clipping."""
    advantage_estimator: str
    eps_clip: float
    eps_clip_high: float
    kl_coef: float
    """KL folded into the reward (reward shaping)."""
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    use_tis: bool
    tis_clip: float
    use_rollout_logprobs: bool = False
    """The ratio's old log-probs are the engine's (no trainer scoring pass, except at the step-1 alignment check)."""
    calculate_per_token_loss: bool
    """Loss summed over the global batch's response tokens and divided by their count (DAPO)."""
    qkv_format: str = "thd"
    """thd: each micro-batch packed into one row of its real tokens (varlen attention); bshd: padded rows."""
    log_probs_chunk_size: int = 1024
    """Response tokens per lm_head + logsumexp chunk (-1: all of a micro-batch's at once)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them."""
    torch_compile: bool = False
    """The decoder layers and the log-prob chunks through torch.compile (miles/train/compile.py)."""
    use_rollout_routing_replay: bool = False
    """MoE (R3): the policy's forwards route each token to the experts the engine chose for it."""
    max_tokens_per_gpu: int | None = None
    """--use-dynamic-batch-size: training micro-batches hold as many samples as fit this many tokens
    (micro_batch_size is then not used); None: micro_batch_size samples each."""
    log_probs_max_tokens_per_gpu: int | None = None
    """The same budget for the scoring forwards (no gradients); None: max_tokens_per_gpu."""

    @property
    def needs_ref(self) -> bool:
        return (self.use_kl_loss and self.kl_loss_coef > 0) or self.kl_coef > 0

    @property
    def scoring_layout(self) -> dict:
        """How micro-batches are laid out and scored: the keywords of miles.train.batch's scoring
        functions, the same for the trainer and for the engine's true on-policy verifier."""
        return dict(packed=self.qkv_format == "thd", chunk_size=self.log_probs_chunk_size, compiled=self.torch_compile)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    output_dir: str
    num_rollout: int
    seed: int
    """Seeds Python/NumPy/torch and every sample's sampling stream."""
    save: str | None
    save_interval: int | None
    keep_checkpoints: int | None
    """Keep the newest N step dirs (None: all)."""
    load: str | None
    allow_branch: bool
    """Resume from a step older than the save dir's newest, moving the newer ones aside."""
    max_nonfinite_steps: int
    """Consecutive steps skipped for NaN/Inf before the run stops (exit 3)."""
    use_tensorboard: bool
    use_wandb: bool
    wandb_project: str
    wandb_group: str | None


@dataclass(frozen=True, kw_only=True)
class DebugConfig:
    debug_rollout_only: bool
    """Build no trainer."""
    debug_train_only: bool
    """Build no engine (implied by load_debug_rollout_data)."""
    save_debug_rollout_data: str | None
    """Dump template with {rollout_id}."""
    load_debug_rollout_data: str | None
    """Replay template with {rollout_id}."""
    debug_rollout_print_every: int | None
    alignment_check: str
    """off | warn | error."""
    check_weight_update_equal: bool
    debug_weight_sync: int
    deterministic_mode: bool
    debug_determinism: bool
    """Write hashes.jsonl."""
    true_on_policy_mode: bool
    """The engine samples from the trainer's own computation."""
    true_on_policy_check: str = "rescore"
    """rescore (each rollout scored by the trainer's computation) | stop (no such pass; a step that differs stops);
    --true-on-policy-check auto is resolved to one of them by the device (miles.cli.train.resolve_device)."""


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Where rollouts are generated: in process, or on inference servers (given or started by miles)."""

    backend: str
    """local | sglang (SGLang's native API: SGLang, or `miles serve`) | vllm (vLLM's OpenAI server)."""
    urls: tuple[str, ...]
    """--sglang-url / --vllm-url; empty: miles starts `num_engines` servers itself."""
    num_engines: int
    vllm_python: str | None
    """The Python of a vLLM install (its own venv), for servers miles starts."""
    log_dir: str
    """Logs of the servers miles starts."""
    concurrency: int
    """Requests in flight per server."""
    request_timeout: float
    """Seconds one request may take before it is retried."""
    retries: int
    """Attempts per request on a connection error, timeout or 5xx (4xx are never retried)."""
    start_timeout: float
    """Seconds a server miles starts may take to become healthy."""
    mem_fraction_static: float | None
    """The share of each GPU an engine miles runs may take (None: the engine's default)."""
    local_decoder: str
    """The local engine's decode path: fast | hf."""
    cuda_graphs: bool
    """The local engine's fast path replays its decode steps as CUDA graphs (on a GPU)."""
    torch_compile: bool
    """The local engine's fast path runs its layers through torch.compile."""


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """Where the trainer runs (one process, or Ray-hosted ranks) and how the two sides share time."""

    actor_num_nodes: int | None
    actor_num_gpus_per_node: int | None
    """Either given: the trainer runs as nodes x gpus ranks on Ray; neither: in this process."""
    rollout_num_gpus: int | None
    """Devices for the engines miles starts on Ray (None: --rollout-num-engines engines of one each)."""
    rollout_num_gpus_per_engine: int
    colocate: bool
    """Engines share the trainer's devices, taking turns (the trainer offloads while they generate)."""
    distributed_timeout_minutes: float
    """How long a collective (weight gather, gradient reduce) may wait before it is an error."""
    async_rollout: bool
    """--async: rollout k+1 is generated while the trainer trains on rollout k."""

    @property
    def ranks(self) -> int | None:
        """Trainer ranks on Ray, or None for a 1-process run."""
        if self.actor_num_nodes is None and self.actor_num_gpus_per_node is None:
            return None
        return (self.actor_num_nodes or 1) * (self.actor_num_gpus_per_node or 1)


@dataclass(frozen=True, kw_only=True)
class Configs:
    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig
    engines: EngineConfig
    train: TrainConfig
    run: RunConfig
    debug: DebugConfig
    cluster: ClusterConfig
    eval: EvalConfig


def build_configs(args: argparse.Namespace) -> Configs:
    a = args
    return Configs(
        model=ModelConfig(hf_checkpoint=a.hf_checkpoint, ref_load=a.ref_load, attention_backend=a.attention_backend,
                          precision=a.precision, device=a.device),
        data=DataConfig(prompt_data=a.prompt_data, input_key=a.input_key, label_key=a.label_key,
                        apply_chat_template=a.apply_chat_template, max_prompt_len=a.rollout_max_prompt_len,
                        shuffle=a.rollout_shuffle),
        rollout=RolloutConfig(
            batch_size=a.rollout_batch_size, n_samples_per_prompt=a.n_samples_per_prompt,
            custom_generate_path=a.custom_generate_function_path, dynamic_filter_path=a.dynamic_sampling_filter_path,
            over_sampling_batch_size=a.over_sampling_batch_size,
            dynamic_max_rounds=a.dynamic_sampling_max_rounds,
            sampling=SamplingParams(max_new_tokens=a.rollout_max_response_len, temperature=a.rollout_temperature,
                                    top_p=a.rollout_top_p),
            rm_type=a.rm_type, custom_rm_path=a.custom_rm_path, reward_timeout=a.reward_timeout),
        engines=EngineConfig(
            backend=a.rollout_backend, urls=tuple(a.sglang_url or a.vllm_url or ()), num_engines=a.rollout_num_engines,
            vllm_python=a.vllm_python, log_dir=a.sglang_log_dir, concurrency=a.sglang_server_concurrency,
            request_timeout=a.rollout_request_timeout, retries=a.rollout_request_retries,
            start_timeout=a.engine_start_timeout, mem_fraction_static=a.sglang_mem_fraction_static,
            local_decoder=a.local_decoder, cuda_graphs=not a.disable_cuda_graph, torch_compile=a.enable_torch_compile),
        train=TrainConfig(
            num_steps_per_rollout=a.num_steps_per_rollout, global_batch_size=a.global_batch_size,
            micro_batch_size=a.micro_batch_size, lr=a.lr, weight_decay=a.weight_decay, clip_grad=a.clip_grad,
            advantage_estimator=a.advantage_estimator, eps_clip=a.eps_clip, eps_clip_high=a.eps_clip_high,
            kl_coef=a.kl_coef, use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type,
            use_tis=a.use_tis, tis_clip=a.tis_clip, use_rollout_logprobs=a.use_rollout_logprobs,
            calculate_per_token_loss=a.calculate_per_token_loss,
            qkv_format=a.qkv_format, log_probs_chunk_size=a.log_probs_chunk_size,
            gradient_checkpointing=a.gradient_checkpointing, torch_compile=a.trainer_torch_compile,
            use_rollout_routing_replay=a.use_rollout_routing_replay,
            max_tokens_per_gpu=a.max_tokens_per_gpu if a.use_dynamic_batch_size else None,
            log_probs_max_tokens_per_gpu=a.log_probs_max_tokens_per_gpu if a.use_dynamic_batch_size else None),
        run=RunConfig(output_dir=a.output_dir, num_rollout=a.num_rollout, seed=a.seed, save=a.save,
                      save_interval=a.save_interval, keep_checkpoints=a.keep_checkpoints, load=a.load,
                      allow_branch=a.allow_branch, max_nonfinite_steps=a.max_nonfinite_steps,
                      use_tensorboard=a.use_tensorboard,
                      use_wandb=a.use_wandb, wandb_project=a.wandb_project, wandb_group=a.wandb_group),
        debug=DebugConfig(
            debug_rollout_only=a.debug_rollout_only, debug_train_only=a.debug_train_only,
            save_debug_rollout_data=a.save_debug_rollout_data, load_debug_rollout_data=a.load_debug_rollout_data,
            debug_rollout_print_every=a.debug_rollout_print_every, alignment_check=a.alignment_check,
            check_weight_update_equal=a.check_weight_update_equal, debug_weight_sync=a.debug_weight_sync,
            deterministic_mode=a.deterministic_mode, debug_determinism=a.debug_determinism,
            true_on_policy_mode=a.true_on_policy_mode, true_on_policy_check=a.true_on_policy_check),
        cluster=ClusterConfig(
            actor_num_nodes=a.actor_num_nodes, actor_num_gpus_per_node=a.actor_num_gpus_per_node,
            rollout_num_gpus=a.rollout_num_gpus, rollout_num_gpus_per_engine=a.rollout_num_gpus_per_engine,
            colocate=a.colocate, distributed_timeout_minutes=a.distributed_timeout_minutes,
            async_rollout=a.async_rollout),
        eval=EvalConfig(
            interval=a.eval_interval,
            datasets=tuple(zip(a.eval_prompt_data[0::2], a.eval_prompt_data[1::2])) if a.eval_prompt_data else (),
            n_samples_per_prompt=a.n_samples_per_eval_prompt,
            sampling=SamplingParams(max_new_tokens=a.eval_max_response_len or a.rollout_max_response_len,
                                    temperature=a.eval_temperature, top_p=a.eval_top_p)),
    )
