"""Flags of `miles train`, in the groups `--help` shows, and their validation.

Names follow Miles/slime so existing launch scripts read the same. Everything here runs before
torch is imported: `--help` is instant and a bad flag costs nothing.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from miles.errors import UsageError
from miles.rollout.rewards import RM_TYPES  # torch-free: the reward names, without their libraries
from miles.utils.io import check_model_dir

# Choice lists, torch-free; tests/test_cli.py checks each equals the registry it names.
ADVANTAGE_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus")  # miles.train.advantages.ADVANTAGE_ESTIMATORS
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")  # miles.train.losses.KL_ESTIMATORS
ATTENTION_BACKENDS = ("sdpa", "eager", "flash")  # miles.utils.models.ATTENTION_IMPLEMENTATIONS
BACKENDS = ("local", "sglang", "vllm")  # miles.rollout.remote.BACKENDS


def add_train_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and checkpoints")
    g.add_argument("--hf-checkpoint", metavar="DIR",
                   help="HF causal LM + tokenizer dir (default: the demo model, SmolLM2-135M-Instruct)")
    g.add_argument("--ref-load", metavar="DIR", help="reference model for the KL (default: the initial policy)")
    g.add_argument("--load", metavar="DIR",
                   help="resume from the latest complete checkpoint under DIR "
                        "(a run dir, its checkpoints/, or one step_N)")
    g.add_argument("--save", metavar="DIR", help="where checkpoints go (default: OUTPUT_DIR/checkpoints)")
    g.add_argument("--save-interval", type=int, metavar="N",
                   help="save every N rollout steps (the last step is always saved)")
    g.add_argument("--keep-checkpoints", type=int, metavar="N",
                   help="keep only the newest N checkpoints (default: all)")
    g.add_argument("--allow-branch", action="store_true",
                   help="--load an older step of a save dir holding newer ones: the newer ones are moved aside")
    g.add_argument("--output-dir", metavar="DIR", help="run directory (default: runs/<timestamp>)")

    g = p.add_argument_group("data")
    g.add_argument("--prompt-data", metavar="PATH",
                   help=".jsonl or .parquet prompts (default: the bundled arithmetic task)")
    g.add_argument("--input-key", default=None,
                   help="row key holding the prompt: text or chat messages (default: prompt)")
    g.add_argument("--label-key", default=None, help="row key holding the ground truth for the reward")
    g.add_argument("--apply-chat-template", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap prompts in the tokenizer's chat template "
                        "(default: on for the bundled task, off otherwise)")
    g.add_argument("--rollout-shuffle", action="store_true", help="shuffle prompts each epoch (seeded by --seed)")
    g.add_argument("--rollout-max-prompt-len", type=int, metavar="N", help="drop prompts longer than N tokens")

    g = p.add_argument_group("rollout")
    g.add_argument("--rollout-batch-size", type=int, default=8, help="prompts per rollout (default: 8)")
    g.add_argument("--n-samples-per-prompt", type=int, default=4,
                   help="responses per prompt, a GRPO group (default: 4)")
    g.add_argument("--rollout-max-response-len", type=int, default=24, help="max new tokens per response (default: 24)")
    g.add_argument("--rollout-temperature", type=float, default=0.7,
                   help="sampling temperature; 0 is greedy (default: 0.7)")
    g.add_argument("--rollout-top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    g.add_argument("--rm-type", default=None, choices=RM_TYPES, help=f"reward function: {', '.join(RM_TYPES)} "
                   "(default: math; see miles/rollout/rewards.py for what each accepts)")
    g.add_argument("--custom-rm-path", metavar="MODULE:FUNCTION",
                   help="custom reward, fn(sample) -> float (async allowed)")
    g.add_argument("--reward-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="seconds one sample's reward may take; a reward that hangs stops the run with an error "
                        "naming it (default: 60)")

    g.add_argument("--custom-generate-function-path", metavar="MODULE:FUNCTION",
                   help="async fn(client, sample, sampling) -> Sample that makes each sample itself: several engine "
                        "calls (multi-turn, tools), loss_mask 0 on tokens the policy did not produce (example: "
                        "miles.rollout.examples.calculator:generate)")

    g = p.add_argument_group("dynamic sampling (DAPO): keep only the groups that carry a signal")
    g.add_argument("--dynamic-sampling-filter-path", metavar="MODULE:FUNCTION",
                   help="fn(args, samples) -> bool | DynamicFilterOutput, one call per prompt's group; a rollout "
                        "keeps generating until --rollout-batch-size groups passed (built in: "
                        "miles.rollout.filters:check_reward_nonzero_std drops groups whose rewards are all equal)")
    g.add_argument("--over-sampling-batch-size", type=int, metavar="N",
                   help="prompts generated per round of dynamic sampling (default: --rollout-batch-size)")
    g.add_argument("--dynamic-sampling-max-rounds", type=int, default=8, metavar="R",
                   help="rounds a rollout may generate before the run stops saying the filter starves it "
                        "(default: 8)")

    g = p.add_argument_group("evaluation (held-out prompts, through the rollout engine; never trained on)")
    g.add_argument("--eval-interval", type=int, metavar="N",
                   help="evaluate before the first step and after every N steps (needs --eval-prompt-data; the "
                        "bundled task evaluates its held-out problems before the first step and after the last "
                        "by default); 0: no evaluation")
    g.add_argument("--eval-prompt-data", nargs="+", metavar="NAME PATH",
                   help="evaluation sets as NAME PATH pairs (.jsonl or .parquet, the --input-key / --label-key of the "
                        "training data); metrics eval/NAME...")
    g.add_argument("--n-samples-per-eval-prompt", type=int, default=1, metavar="K",
                   help="responses per evaluation prompt; K > 1 adds eval/NAME/pass@K (default: 1)")
    g.add_argument("--eval-max-response-len", type=int, metavar="N",
                   help="max new tokens per evaluation response (default: --rollout-max-response-len)")
    g.add_argument("--eval-temperature", type=float, default=0.0,
                   help="evaluation sampling temperature (default: 0, greedy)")
    g.add_argument("--eval-top-p", type=float, default=1.0, help="evaluation nucleus mass (default: 1.0)")

    g = p.add_argument_group("rollout engines")
    g.add_argument("--rollout-backend", choices=BACKENDS, default="local",
                   help="local: miles' engine in process; sglang: servers speaking SGLang's native API (SGLang, or "
                        "`miles serve`); vllm: vLLM OpenAI servers (default: local)")
    g.add_argument("--sglang-url", type=_urls, metavar="URL[,URL...]",
                   help="SGLang-API servers to use (with --rollout-backend sglang)")
    g.add_argument("--vllm-url", type=_urls, metavar="URL[,URL...]",
                   help="vLLM servers to use (with --rollout-backend vllm)")
    g.add_argument("--rollout-num-engines", type=int, default=1, metavar="N",
                   help="servers miles starts itself when no URL is given (default: 1)")
    g.add_argument("--vllm-python", metavar="PATH",
                   help="the python of a vLLM install, for the vLLM servers miles starts "
                        "(default: the interpreter of the `vllm` on PATH)")
    g.add_argument("--sglang-log-dir", metavar="DIR", default="/tmp/sglang",
                   help="logs of the servers miles starts, SGLang's and vLLM's (default: /tmp/sglang)")
    g.add_argument("--sglang-server-concurrency", type=int, default=64, metavar="N",
                   help="requests in flight per server (default: 64)")
    g.add_argument("--rollout-request-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="seconds one request to a server may take (default: 600)")
    g.add_argument("--rollout-request-retries", type=int, default=3, metavar="N",
                   help="attempts per request on a connection error, timeout or 5xx; 4xx is never retried (default: 3)")
    g.add_argument("--sglang-mem-fraction-static", type=float, default=None, metavar="F",
                   help="the share of each GPU an engine may take, in (0, 1]: for the local engine its weights plus KV "
                        "cache (the cache is sized to the rollout, at most this share less what the process holds); "
                        "--mem-fraction-static for miles serve / SGLang, --gpu-memory-utilization for vLLM servers "
                        "miles starts; with --colocate leave room for the trainer (default: 0.9 local, the server's "
                        "own otherwise; no effect on CPUs)")
    g.add_argument("--local-decoder", choices=("fast", "hf"), default="fast",
                   help="the local engine's decode path: fast (continuous batching over a slot KV cache, packed "
                        "prefill, CUDA graphs on a GPU) or hf (the HF model's own forward and KV cache: the reference, "
                        "to rule the fast path in or out); models the fast path cannot run use hf (default: fast)")
    g.add_argument("--disable-cuda-graph", action="store_true",
                   help="the local engine's decode steps run eagerly instead of as CUDA graph replays "
                        "(as SGLang's flag)")
    g.add_argument("--enable-torch-compile", action="store_true",
                   help="the local engine's layers and sampler through torch.compile (fused elementwise kernels; "
                        "compiles once at the first rollout; as SGLang's flag)")
    g.add_argument("--engine-start-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="seconds a server miles starts may take to answer its health check (default: 600)")

    g = p.add_argument_group("scale-out (Ray)")
    g.add_argument("--actor-num-nodes", type=int, metavar="N",
                   help="train on N nodes x --actor-num-gpus-per-node ranks, Ray actors with FSDP2 "
                        "(default: one process)")
    g.add_argument("--actor-num-gpus-per-node", type=int, metavar="G",
                   help="trainer ranks per node: one per GPU, or on a host without GPUs one CPU rank each (gloo)")
    g.add_argument("--rollout-num-gpus", type=int, metavar="N",
                   help="devices for the engine servers miles starts on Ray (default: --rollout-num-engines x "
                        "--rollout-num-gpus-per-engine; with --colocate the trainer's)")
    g.add_argument("--rollout-num-gpus-per-engine", type=int, default=1, metavar="N",
                   help="devices per engine server (its tensor-parallel size; default: 1)")
    g.add_argument("--colocate", action="store_true",
                   help="engines share the trainer's devices: the trainer offloads to CPU while they generate, "
                        "they release memory while it trains")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0, metavar="M",
                   help="a collective (gradient reduce, weight gather) waiting longer, or a worker leaving the "
                        "driver's ping unanswered this long, is an error naming the stuck rank; NCCL_TIMEOUT "
                        "(seconds) in the environment overrides it (default: 10)")
    g.add_argument("--async", dest="async_rollout", action="store_true",
                   help="one step ahead: rollout k+1 is generated while training on rollout k (samples are one "
                        "weight version stale; --use-tis corrects for it)")

    g = p.add_argument_group("training")
    g.add_argument("--num-rollout", type=int, default=4,
                   help="rollout steps in the whole run, counted from step 1 (default: 4)")
    g.add_argument("--num-steps-per-rollout", type=int, default=None, help="optimizer steps per rollout (default: 1)")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per optimizer step (default: all samples of the rollout)")
    g.add_argument("--micro-batch-size", type=int, default=8,
                   help="samples per forward/backward; gradients accumulate (default: 8)")
    g.add_argument("--use-dynamic-batch-size", action="store_true",
                   help="micro-batches hold as many samples as fit --max-tokens-per-gpu tokens (their real tokens with "
                        "--qkv-format thd, the padded grid with bshd), cut in order; --micro-batch-size is not used")
    g.add_argument("--max-tokens-per-gpu", type=int, default=None, metavar="N",
                   help="with --use-dynamic-batch-size: tokens of one training forward/backward on a rank")
    g.add_argument("--log-probs-max-tokens-per-gpu", type=int, default=None, metavar="N",
                   help="with --use-dynamic-batch-size: tokens of one scoring forward (no gradients, so it can be "
                        "larger; default: --max-tokens-per-gpu)")
    g.add_argument("--lr", type=float, default=2e-5, help="AdamW learning rate (default: 2e-5)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default: 0)")
    g.add_argument("--clip-grad", type=float, default=1.0, help="max gradient norm; 0 disables (default: 1.0)")
    g.add_argument("--advantage-estimator", choices=ADVANTAGE_ESTIMATORS, default="grpo")
    g.add_argument("--eps-clip", type=float, default=0.2, help="PPO clip range, lower side (default: 0.2)")
    g.add_argument("--eps-clip-high", type=float, default=None, help="PPO clip range, upper side (default: --eps-clip)")
    g.add_argument("--kl-coef", type=float, default=0.0, help="KL penalty folded into the reward (default: 0)")
    g.add_argument("--use-kl-loss", action="store_true", help="add a KL(policy || ref) term to the loss")
    g.add_argument("--kl-loss-coef", type=float, default=0.0, help="weight of the KL loss (default: 0)")
    g.add_argument("--kl-loss-type", choices=KL_TYPES, default="k1", help="KL estimator (default: k1)")
    g.add_argument("--use-tis", action="store_true", help="truncated importance sampling on the trainer/engine ratio")
    g.add_argument("--tis-clip", type=float, default=2.0, help="upper clip of the TIS weight (default: 2.0)")
    g.add_argument("--use-rollout-logprobs", action=argparse.BooleanOptionalAction, default=None,
                   help="the PPO/GRPO ratio's old log-probs are the engine's, not re-scored by the trainer (no scoring "
                        "pass; the step-1 alignment check still scores); default: on with --true-on-policy-mode, "
                        "whose rollout log-probs are the trainer's own computation, off otherwise")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="loss summed over every response token of the global batch and divided by their count "
                        "(DAPO; TRL loss_type=dapo) instead of each sample's mean averaged over samples (TRL grpo)")
    g.add_argument("--qkv-format", choices=("thd", "bshd"), default="thd",
                   help="thd: each micro-batch packed into one row of its real tokens, attention within each "
                        "sequence (varlen), no padding computed; bshd: right-padded rows (verl: "
                        "use_remove_padding=False). On the H200 thd runs as fast as bshd on equal lengths and 1.28x "
                        "faster on ragged responses (default: thd)")
    g.add_argument("--log-probs-chunk-size", type=int, default=1024, metavar="N",
                   help="response tokens whose full-vocabulary logits are computed at once, forward and backward; "
                        "-1: all of a micro-batch's (default: 1024)")
    g.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute each decoder layer's activations in backward (less memory, about a third more "
                        "compute)")
    g.add_argument("--trainer-torch-compile", action="store_true",
                   help="the trainer's decoder layers and log-prob chunks through torch.compile (fused elementwise "
                        "kernels; compiles at the first step; dense models; 1.9x the trainer's tokens/s on the H200)")
    g.add_argument("--use-rollout-routing-replay", action="store_true",
                   help="MoE (R3): the policy's scoring and training forwards route every token to the experts the "
                        "engine chose for it (Sample.rollout_routed_experts), the router's weights recomputed for "
                        "those experts so it still learns; the reference model routes on its own")
    g.add_argument("--max-nonfinite-steps", type=int, default=3, metavar="N",
                   help="steps in a row skipped for a NaN/Inf reward, loss or gradient before the run stops with "
                        "exit 3 (default: 3)")
    g.add_argument("--seed", type=int, default=42)
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="sdpa",
                   help="attention kernels of trainer and engine; flash needs flash-attn (default: sdpa)")
    g.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                   help="compute precision (default: bf16 on GPU, fp32 on CPU); master weights stay fp32")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")

    g = p.add_argument_group("debug: rollout or training?")
    g.add_argument("--debug-rollout-only", action="store_true",
                   help="build the engine only: generate and reward rollouts, no trainer "
                        "(pair with --save-debug-rollout-data)")
    g.add_argument("--debug-train-only", action="store_true",
                   help="build the trainer only, no engine; trains on --load-debug-rollout-data dumps")
    g.add_argument("--save-debug-rollout-data", metavar="TEMPLATE",
                   help="dump every rollout to TEMPLATE, e.g. dumps/data_{rollout_id}.pt")
    g.add_argument("--load-debug-rollout-data", metavar="TEMPLATE",
                   help="train rollout i on the dump for id i (fixed inputs); implies --debug-train-only")
    g.add_argument("--debug-rollout-print-every", type=int, metavar="N",
                   help="log the samples of every Nth rollout (prompt, response, reward, mean log-prob)")

    g = p.add_argument_group("debug: alignment and weight sync")
    g.add_argument("--alignment-check", choices=("off", "warn", "error"), default="warn",
                   help="step-1 precision-alignment report; error: any FAIL exits with status 3 (default: warn)")
    g.add_argument("--check-weight-update-equal", action="store_true",
                   help="after each sync, compare every engine tensor with the trainer's by digest, "
                        "and the engine's buffers")
    g.add_argument("--debug-weight-sync", type=int, choices=(0, 1, 2), default=0, metavar="LEVEL",
                   help="1: a checksum on each weight_sync line; 2: also one line per tensor")

    g = p.add_argument_group("debug: determinism")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="bitwise-reproducible runs: seeds, deterministic kernels and attention (logged)")
    g.add_argument("--true-on-policy-mode", action="store_true",
                   help="the engine samples from exactly the trainer's computation: engine and trainer log-probs "
                        "equal bitwise (needs --rollout-top-p 1)")
    g.add_argument("--true-on-policy-check", choices=("auto", "rescore", "stop"), default="auto",
                   help="with --true-on-policy-mode: stop (auto's choice on a GPU, whose batch-invariant kernels make "
                        "the engine compute the trainer's numbers) reports the engine's log-probs and stops the run at "
                        "a step where the training forward's are not the same bit for bit; rescore (auto's choice on "
                        "a CPU) scores each rollout with the trainer's computation and re-draws a token drawn across "
                        "a rounding boundary")
    g.add_argument("--debug-determinism", action="store_true",
                   help="write per-step hashes (tokens, log-probs, rewards, loss, gradients, parameters) "
                        "to hashes.jsonl")

    g = p.add_argument_group("logging")
    g.add_argument("--use-tensorboard", action="store_true",
                   help="also write TensorBoard events to OUTPUT_DIR/tensorboard")
    g.add_argument("--use-wandb", action="store_true",
                   help="also log to Weights & Biases (WANDB_MODE=offline works without network)")
    g.add_argument("--wandb-project", default="miles")
    g.add_argument("--wandb-group", default=None)


def _positive(args: argparse.Namespace, *names: str, allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(args, name)
        if value is None:
            continue
        if value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise UsageError(f"--{name.replace('_', '-')} must be {bound} (got {value})")


def validate_train_args(args: argparse.Namespace) -> None:
    """Checks flags that need no data and no model. Raises UsageError naming the flag."""
    _check_debug_flags(args)
    _check_engine_flags(args)
    _positive(args, "rollout_batch_size", "n_samples_per_prompt", "rollout_max_response_len", "num_rollout",
              "num_steps_per_rollout", "global_batch_size", "micro_batch_size", "save_interval",
              "rollout_max_prompt_len", "lr", "tis_clip", "keep_checkpoints", "max_nonfinite_steps", "reward_timeout")
    _positive(args, "rollout_temperature", "clip_grad", "eps_clip", "eps_clip_high", "kl_coef",
              "kl_loss_coef", "weight_decay", allow_zero=True)
    if not 0 <= args.seed < 2 ** 32:  # NumPy's seed range; torch's and the per-sample streams' hold it
        raise UsageError(f"--seed must be in [0, 2**32 - 1] (got {args.seed})")
    if not 0 < args.rollout_top_p <= 1:
        raise UsageError(f"--rollout-top-p must be in (0, 1] (got {args.rollout_top_p})")
    if args.log_probs_chunk_size == 0 or args.log_probs_chunk_size < -1:
        raise UsageError(f"--log-probs-chunk-size must be > 0, or -1 for no chunking (got {args.log_probs_chunk_size})")

    _check_batch_sizes(args)
    _check_dynamic_batch_flags(args)
    _check_compile_flags(args)
    _check_cluster_flags(args)
    _check_eval_flags(args)
    _check_dynamic_sampling_flags(args)
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
    _resolve_rollout_logprobs(args)
    if args.advantage_estimator in ("grpo", "gspo") and args.n_samples_per_prompt < 2:
        raise UsageError(f"--advantage-estimator {args.advantage_estimator} normalises rewards within a group: it "
                         f"needs --n-samples-per-prompt >= 2 (got {args.n_samples_per_prompt}), or use "
                         f"--advantage-estimator reinforce_plus_plus")
    if args.use_kl_loss and args.kl_loss_coef == 0:
        raise UsageError("--use-kl-loss needs --kl-loss-coef > 0 (a zero coefficient trains no KL)")

    for flag in ("hf_checkpoint", "ref_load"):
        if getattr(args, flag) is not None:
            check_model_dir(getattr(args, flag), f"--{flag.replace('_', '-')}")
    if args.load is not None and not Path(args.load).is_dir():
        raise UsageError(f"--load {args.load}: no such directory")
    if args.output_dir is None:
        from datetime import datetime

        args.output_dir = os.path.join("runs", datetime.now().strftime("%Y%m%d-%H%M%S"))
    if args.load is None:
        check_not_a_finished_lineage(args.output_dir, args.save)
    if args.use_tensorboard:
        _require("tensorboard", "--use-tensorboard")
    if args.use_wandb:
        _require("wandb", "--use-wandb")


def _resolve_rollout_logprobs(args: argparse.Namespace) -> None:
    """--use-rollout-logprobs: on by default with --true-on-policy-mode (the engine reports the trainer's own
    log-probs, so the trainer's scoring pass would compute them a second time), off otherwise."""
    if args.use_rollout_logprobs and args.use_tis:
        raise UsageError("--use-tis weighs each token by the trainer's over the engine's log-prob; with "
                         "--use-rollout-logprobs the trainer takes the engine's, so the weight is always 1: drop one")
    if args.use_rollout_logprobs is None:
        args.use_rollout_logprobs = bool(args.true_on_policy_mode and not args.use_tis)


def _check_dynamic_sampling_flags(args: argparse.Namespace) -> None:
    _positive(args, "over_sampling_batch_size", "dynamic_sampling_max_rounds")
    if args.dynamic_sampling_filter_path is None:
        if args.over_sampling_batch_size is not None:
            raise UsageError("--over-sampling-batch-size sizes the rounds of dynamic sampling: it needs "
                             "--dynamic-sampling-filter-path (e.g. miles.rollout.filters:check_reward_nonzero_std)")
        return
    if args.over_sampling_batch_size is not None and args.over_sampling_batch_size < args.rollout_batch_size:
        raise UsageError(f"--over-sampling-batch-size {args.over_sampling_batch_size} must be at least "
                         f"--rollout-batch-size {args.rollout_batch_size} (the groups one rollout keeps)")
    if args.load_debug_rollout_data is not None or args.debug_train_only:
        raise UsageError("--dynamic-sampling-filter-path filters the groups a rollout generates; a replay of dumps "
                         "(--load-debug-rollout-data) trains on the groups already kept")


def _check_eval_flags(args: argparse.Namespace) -> None:
    _positive(args, "n_samples_per_eval_prompt", "eval_max_response_len")
    _positive(args, "eval_interval", "eval_temperature", allow_zero=True)  # --eval-interval 0: no evaluation
    if not 0 < args.eval_top_p <= 1:
        raise UsageError(f"--eval-top-p must be in (0, 1] (got {args.eval_top_p})")
    if args.eval_interval == 0:
        return
    if args.eval_prompt_data is None:
        if args.eval_interval is not None and args.prompt_data is not None:  # the bundled task brings its own
            raise UsageError("--eval-interval needs --eval-prompt-data NAME PATH [NAME PATH ...]")
        return
    pairs = args.eval_prompt_data
    if len(pairs) % 2:
        raise UsageError(f"--eval-prompt-data takes NAME PATH pairs; got {len(pairs)} value(s): {' '.join(pairs)}")
    names = pairs[0::2]
    if len(set(names)) != len(names):
        raise UsageError(f"--eval-prompt-data: each set needs its own name (got {', '.join(names)})")
    for name in names:
        if not name.replace("_", "").replace("-", "").isalnum():
            raise UsageError(f"--eval-prompt-data: the name {name!r} must be letters, digits, - or _ (it names the "
                             "metric eval/NAME); give NAME PATH pairs")
    if args.eval_interval is None:
        raise UsageError("--eval-prompt-data needs --eval-interval N "
                         "(evaluate before the first step and every N steps)")
    if args.debug_train_only or args.load_debug_rollout_data is not None:
        raise UsageError("--eval-prompt-data evaluates through the rollout engine; a --debug-train-only run (or a "
                         "replay of dumps) has none")
    if args.async_rollout:
        raise UsageError("--eval-prompt-data with --async is not supported yet (the engine is generating the next "
                         "rollout while a step trains)")


def _check_batch_sizes(args: argparse.Namespace) -> None:
    """Derives whichever of --global-batch-size / --num-steps-per-rollout was not given; an error
    names a derived value as derived, so the user is not told about a flag they never passed."""
    n_samples = args.rollout_batch_size * args.n_samples_per_prompt
    steps, gbs = args.num_steps_per_rollout, args.global_batch_size
    gbs_text = f"--global-batch-size {gbs}"
    steps_text = f"--num-steps-per-rollout {steps}"
    if steps is None and gbs is None:
        steps, gbs = 1, n_samples
        gbs_text = f"the global batch ({gbs}: every sample of a rollout, as --global-batch-size is not given)"
    elif gbs is None:
        gbs = n_samples // steps
        gbs_text = f"the global batch ({gbs}, derived from {n_samples} samples // --num-steps-per-rollout {steps})"
    elif steps is None:
        steps = n_samples // gbs
        steps_text = f"the derived step count {steps} ({n_samples} samples // --global-batch-size {gbs})"
    if gbs * steps != n_samples or gbs == 0:
        raise UsageError(f"{gbs_text} x {steps_text} must equal the samples of a rollout, "
                         f"--rollout-batch-size x --n-samples-per-prompt = {n_samples}")
    if gbs % args.n_samples_per_prompt:
        raise UsageError(f"{gbs_text} must hold whole groups of --n-samples-per-prompt {args.n_samples_per_prompt}")
    args.num_steps_per_rollout, args.global_batch_size = steps, gbs
    args.micro_batch_size = min(args.micro_batch_size, gbs)
    if gbs % args.micro_batch_size and not args.use_dynamic_batch_size:
        raise UsageError(f"--micro-batch-size {args.micro_batch_size} must divide {gbs_text}")


def _check_dynamic_batch_flags(args: argparse.Namespace) -> None:
    _positive(args, "max_tokens_per_gpu", "log_probs_max_tokens_per_gpu")
    if not args.use_dynamic_batch_size:
        given = [f for f in ("max_tokens_per_gpu", "log_probs_max_tokens_per_gpu") if getattr(args, f) is not None]
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')} is read only with --use-dynamic-batch-size: add it, "
                             "or drop the budget")
        return
    if args.max_tokens_per_gpu is None:
        raise UsageError("--use-dynamic-batch-size needs --max-tokens-per-gpu N (tokens per training micro-batch)")
    if args.true_on_policy_mode:
        raise UsageError("--true-on-policy-mode scores the engine's tokens in micro-batches of --micro-batch-size "
                         "samples, as the trainer must: drop --use-dynamic-batch-size")


def _check_compile_flags(args: argparse.Namespace) -> None:
    if args.trainer_torch_compile and args.true_on_policy_mode:
        raise UsageError("--trainer-torch-compile runs Inductor's kernels, which --true-on-policy-mode does not cover "
                         "(its engine decodes with the trainer's eager kernels): drop one of the two")
    if args.enable_torch_compile and args.true_on_policy_mode:
        raise UsageError("--enable-torch-compile runs the engine's layers through Inductor's kernels, which "
                         "--true-on-policy-mode does not cover (the engine must compute what the trainer computes): "
                         "drop one of the two")


def _check_cluster_flags(args: argparse.Namespace) -> None:
    _positive(args, "actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus", "rollout_num_gpus_per_engine",
              "distributed_timeout_minutes")
    ray_mode = args.actor_num_nodes is not None or args.actor_num_gpus_per_node is not None
    ranks = (args.actor_num_nodes or 1) * (args.actor_num_gpus_per_node or 1)
    if ray_mode and args.use_dynamic_batch_size and args.global_batch_size % ranks:
        raise UsageError(f"--global-batch-size {args.global_batch_size} must split evenly into {ranks} trainer ranks "
                         f"(--actor-num-nodes x --actor-num-gpus-per-node): make it a multiple of {ranks}")
    if ray_mode and not args.use_dynamic_batch_size and args.global_batch_size % (ranks * args.micro_batch_size):
        raise UsageError(f"--global-batch-size {args.global_batch_size} must split evenly into {ranks} trainer ranks "
                         f"(--actor-num-nodes x --actor-num-gpus-per-node) of whole micro-batches of "
                         f"--micro-batch-size {args.micro_batch_size}: make it a multiple of "
                         f"{ranks * args.micro_batch_size}")
    if ray_mode and args.true_on_policy_mode:
        raise UsageError("--true-on-policy-mode needs the engine to compute in the trainer's process what the trainer "
                         "computes; with --actor-num-nodes / --actor-num-gpus-per-node the trainer runs in Ray "
                         "workers: drop one of the two")
    if args.colocate and not ray_mode:
        raise UsageError("--colocate places engines on the trainer ranks' devices: it needs --actor-num-gpus-per-node "
                         "(a 1-process run shares its one device already)")
    if args.colocate and args.rollout_num_gpus_per_engine != 1:
        raise UsageError(f"--colocate runs one engine beside each trainer rank: --rollout-num-gpus-per-engine "
                         f"{args.rollout_num_gpus_per_engine} (an engine spanning ranks' devices) is not supported yet")
    if args.rollout_num_gpus_per_engine > 1 and args.rollout_backend != "vllm":
        raise UsageError(f"--rollout-num-gpus-per-engine {args.rollout_num_gpus_per_engine}: the servers miles starts "
                         f"for --rollout-backend {args.rollout_backend} run on one device each; a tensor-parallel "
                         f"engine needs --rollout-backend vllm (--tensor-parallel-size), or an SGLang you start "
                         f"(--sglang-url)")
    if args.rollout_num_gpus is not None and args.rollout_num_gpus % args.rollout_num_gpus_per_engine:
        raise UsageError(f"--rollout-num-gpus {args.rollout_num_gpus} must be a multiple of "
                         f"--rollout-num-gpus-per-engine {args.rollout_num_gpus_per_engine}")
    if (args.rollout_num_gpus is not None or args.rollout_num_gpus_per_engine != 1) and not ray_mode:
        raise UsageError("--rollout-num-gpus / --rollout-num-gpus-per-engine place engines on Ray: they need "
                         "--actor-num-gpus-per-node (without Ray, --rollout-num-engines says how many servers)")
    if args.async_rollout:
        if args.debug_rollout_only or args.debug_train_only:
            raise UsageError("--async overlaps generation with training: it needs both sides (drop "
                             "--debug-rollout-only / --debug-train-only / --load-debug-rollout-data)")
        if args.colocate:
            raise UsageError("--async generates while the trainer trains; with --colocate they take turns on one "
                             "device: pick one")
        if args.true_on_policy_mode:
            raise UsageError("--async trains on rollouts of the previous weights: --true-on-policy-mode cannot hold")


def check_not_a_finished_lineage(output_dir: str, save: str | None) -> None:
    """A dir holding a run with checkpoints is resumed with --load, not overwritten. (One whose run
    stopped before its first checkpoint holds nothing to resume: it is restarted in place.)"""
    from miles.utils.run_dirs import holds_rows, step_dirs

    if holds_rows(output_dir) and (steps := step_dirs(save or Path(output_dir) / "checkpoints")):
        raise UsageError(f"--output-dir {output_dir} already holds a run (checkpoints up to step_{max(steps)}); "
                         f"resume it with --load {output_dir}, or pick a new --output-dir")


def _urls(text: str) -> list[str]:
    """URL[,URL...]: each http(s)://host:port, without a trailing slash."""
    from urllib.parse import urlsplit

    urls = [u.strip().rstrip("/") for u in text.split(",") if u.strip()]
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise argparse.ArgumentTypeError(f"{url!r} is not an http(s)://HOST:PORT URL")
    if not urls:
        raise argparse.ArgumentTypeError("no URL given")
    return urls


def _check_engine_flags(args: argparse.Namespace) -> None:
    backend = args.rollout_backend
    for flag, value, wants in (("--sglang-url", args.sglang_url, "sglang"), ("--vllm-url", args.vllm_url, "vllm")):
        if value and backend != wants:
            raise UsageError(f"{flag} is for --rollout-backend {wants} (this run's is {backend}): pass "
                             f"--rollout-backend {wants}, or drop {flag}")
    _positive(args, "rollout_num_engines", "sglang_server_concurrency", "rollout_request_retries")
    for name in ("rollout_request_timeout", "engine_start_timeout"):
        if not getattr(args, name) > 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0 (got {getattr(args, name)})")
    fraction = args.sglang_mem_fraction_static
    if fraction is not None and not 0 < fraction <= 1:  # NaN fails this too
        raise UsageError(f"--sglang-mem-fraction-static {fraction:g}: must be in (0, 1]")
    if fraction is not None and (args.sglang_url or args.vllm_url):
        raise UsageError("--sglang-mem-fraction-static sizes the engines miles runs: drop it with --sglang-url / "
                         "--vllm-url (a server you started has its own flag)")
    if backend == "local":
        return
    for flag in ("disable_cuda_graph", "enable_torch_compile"):
        if getattr(args, flag):
            raise UsageError(f"--{flag.replace('_', '-')} is for the local engine (--rollout-backend local); a server "
                             f"takes its own flags")
    if args.local_decoder != "fast":
        raise UsageError("--local-decoder is for the local engine (--rollout-backend local)")
    if args.true_on_policy_mode:
        raise UsageError(f"--true-on-policy-mode needs the engine to run the trainer's own kernels in the trainer's "
                         f"process: only --rollout-backend local can; drop it with --rollout-backend {backend}")
    if args.vllm_python is not None and not os.access(args.vllm_python, os.X_OK):
        raise UsageError(f"--vllm-python {args.vllm_python}: not an executable file")


def _check_debug_flags(args: argparse.Namespace) -> None:
    from miles.bridge.dump_paths import check_template

    if args.load_debug_rollout_data is not None:
        check_template(args.load_debug_rollout_data, "--load-debug-rollout-data")
        args.debug_train_only = True  # replaying needs no engine (logged when the run starts)
    if args.save_debug_rollout_data is not None:
        check_template(args.save_debug_rollout_data, "--save-debug-rollout-data")
    if args.debug_rollout_only and args.debug_train_only:
        implied = " (implied by --load-debug-rollout-data)" if args.load_debug_rollout_data else ""
        raise UsageError(f"--debug-rollout-only and --debug-train-only{implied} exclude each other: "
                         "one builds no trainer, the other no engine")
    if args.debug_train_only and args.load_debug_rollout_data is None:
        raise UsageError("--debug-train-only builds no engine, so it needs rollouts to train on: pass "
                         "--load-debug-rollout-data TEMPLATE (dumps written by --save-debug-rollout-data)")
    if args.true_on_policy_mode and args.load_debug_rollout_data is not None:
        raise UsageError("--true-on-policy-mode changes how the engine samples; a replay of "
                         "--load-debug-rollout-data has no engine: capture the dumps with --true-on-policy-mode")
    if args.true_on_policy_check == "stop" and not args.true_on_policy_mode:
        raise UsageError("--true-on-policy-check stop is how --true-on-policy-mode checks its rollouts: add "
                         "--true-on-policy-mode, or drop --true-on-policy-check")
    if args.true_on_policy_mode and args.rollout_top_p < 1:
        raise UsageError(f"--true-on-policy-mode needs --rollout-top-p 1 (got {args.rollout_top_p}): with top-p the "
                         "engine samples from a truncated distribution, not the one both sides compute")
    if args.debug_rollout_print_every is not None and args.debug_rollout_print_every <= 0:
        raise UsageError(f"--debug-rollout-print-every must be > 0 (got {args.debug_rollout_print_every})")


def _require(module: str, flag: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise UsageError(f"{flag} needs the '{module}' package: pip install {module}")
