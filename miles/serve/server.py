"""Building what `miles serve` serves — tokenizer, model, LocalEngine, scheduler — and running it
under uvicorn.

The model is loaded as `miles train` loads its engine's (miles.utils.models: the demo model by
default, `Loaded checkpoint from` logged), in the precision asked for, and wrapped in a
LocalEngine, whose `update_weights` and `weights_checksum` the weight endpoints use and whose
`release_memory` / `resume_memory` the memory endpoints use; the scheduler thread decodes with
the same model. `--mem-fraction-static F` caps this process's CUDA allocations at F of the GPU
before the model loads (on a CPU it is logged and ignored).
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

import uvicorn

from miles.serve.app import ServeState, build_app
from miles.serve.protocol import ModelLimits
from miles.serve.scheduler import Scheduler, SchedulerLimits
from miles.serve.weights import ParameterSpecs
from miles.utils.cpu_threads import setup_cpu_threads

logger = logging.getLogger("miles")


def setup_console_logging() -> None:
    """The `miles` logger to stderr (stdout carries the ready line)."""
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", datefmt="%Y-%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _device_and_dtype(args: argparse.Namespace):
    import torch

    from miles.errors import UsageError

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    precision = args.precision or ("bf16" if device == "cuda" else "fp32")
    return device, precision, torch.bfloat16 if precision == "bf16" else torch.float32


def _cap_memory(fraction: float | None, device: str) -> None:
    """torch.cuda.set_per_process_memory_fraction: allocations past `fraction` of the GPU raise OOM."""
    if fraction is None:
        return
    if device != "cuda":
        logger.info("miles serve: --mem-fraction-static %g applies to CUDA devices only; ignored on %s", fraction,
                    device)
        return
    import torch

    torch.cuda.set_per_process_memory_fraction(fraction)
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    logger.info("miles serve: --mem-fraction-static %g: this server takes at most %.1f GiB of the GPU's %.1f GiB",
                fraction, fraction * total / (1 << 30), total / (1 << 30))


def build_state(args: argparse.Namespace) -> ServeState:
    from miles.bridge import routing
    from miles.rollout.local import LocalEngine
    from miles.utils.models import eos_token_ids, load_causal_lm, load_tokenizer, quiet_transformers, resolve_checkpoint

    setup_console_logging()
    quiet_transformers()
    device, precision, dtype = _device_and_dtype(args)
    _cap_memory(args.mem_fraction_static, device)
    if device == "cpu":
        setup_cpu_threads(args.cpu_threads)  # logs `CPU threads: ...`
    elif args.cpu_threads is not None:
        import torch

        torch.set_num_threads(args.cpu_threads)
    path = resolve_checkpoint(args.hf_checkpoint)
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path, device=device, attention_backend=args.attention_backend, dtype=dtype)
    eos = eos_token_ids(model, tokenizer)
    engine = LocalEngine(model, eos_token_ids=eos, pad_token_id=tokenizer.pad_token_id)
    config = model.config

    def decode(ids: list[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> str:
        # Fast tokenizers have no spaces_between_special_tokens; SGLang passes it to slow ones only.
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    limits = ModelLimits(vocab_size=config.vocab_size, context_len=getattr(config, "max_position_embeddings", 1 << 30),
                         max_total_tokens=args.max_total_tokens, max_sequences=args.max_queued_requests,
                         moe=bool(routing.routers(model)))
    scheduler = Scheduler(engine, pad_token_id=tokenizer.pad_token_id, eos_token_ids=eos,
                          limits=SchedulerLimits(max_running_requests=args.max_running_requests,
                                                 max_total_tokens=args.max_total_tokens,
                                                 max_queued_requests=args.max_queued_requests),
                          weight_version=args.weight_version, model_path=str(path), decode=decode)
    server_args = {k: v for k, v in vars(args).items() if k not in ("run", "api_key", "command", "command_line")}
    server_args.update(device=device, precision=precision, model_path=str(path))
    logger.info("miles serve: %s on %s (%s), eos %s, context %d, max running %d, max total tokens %d", path, device,
                precision, eos, limits.context_len, args.max_running_requests, args.max_total_tokens)
    return ServeState(scheduler=scheduler, tokenize=tokenizer.encode, decode=decode, limits=limits,
                      specs=ParameterSpecs.of(model),
                      model_info={"tokenizer_path": str(path), "model_type": getattr(config, "model_type", None),
                                  "architectures": getattr(config, "architectures", None)},
                      server_args=server_args, api_key=args.api_key, seed=args.seed)


class _Server(uvicorn.Server):
    """uvicorn, plus: the ready line once it accepts requests, and on SIGTERM/SIGINT every sequence
    in flight aborted first, so open requests answer (finish_reason abort) and shutdown is prompt."""

    def __init__(self, config: uvicorn.Config, state: ServeState, ready_line: str):
        super().__init__(config)
        self.state = state
        self.ready_line = ready_line

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            print(self.ready_line, flush=True)
            logger.info(self.ready_line)

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            logger.info("miles serve: signal %d: aborting requests in flight and shutting down", sig)
            self.state.scheduler.abort("", abort_all=True)
        super().handle_exit(sig, frame)


def serve(state: ServeState, sock: socket.socket, *, ready_line: str) -> None:
    """Runs until SIGTERM/SIGINT; the scheduler thread is stopped on the way out."""
    app = build_app(state)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                            timeout_keep_alive=30, lifespan="off")
    state.scheduler.start()
    try:
        _Server(config, state, ready_line).run(sockets=[sock])
    finally:
        state.scheduler.stop()
