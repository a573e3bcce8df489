"""`miles serve`: flags, checks that need no model, then the model, the scheduler and uvicorn.

    miles serve                                        # the demo model on http://127.0.0.1:30000
    miles serve --hf-checkpoint DIR --port 0           # a free port; the ready line names it
    miles serve --host 0.0.0.0 --api-key KEY           # any non-loopback bind needs a key

When the server accepts requests it prints one line to stdout:
`miles serve: ready on http://HOST:PORT (model PATH, weight_version V)`. SIGTERM or SIGINT aborts
what is in flight (finish_reason abort) and stops the server within seconds; the process then
ends by that signal, as uvicorn does (status 143 for SIGTERM, 130 for SIGINT).
"""

from __future__ import annotations

import argparse
import ipaddress
import socket

from miles.errors import UsageError
from miles.utils.io import check_model_dir

ATTENTION_BACKENDS = ("sdpa", "eager", "flash")  # miles.utils.models.ATTENTION_IMPLEMENTATIONS


def register(commands) -> None:
    p = commands.add_parser("serve", help="the rollout engine alone, as an HTTP server speaking SGLang's native API",
                            description="miles' engine behind SGLang's native HTTP endpoints (/generate, "
                                        "/update_weights_from_disk, /pause_generation, ...), with continuous batching.")
    g = p.add_argument_group("model")
    g.add_argument("--hf-checkpoint", metavar="DIR", help="HF causal LM + tokenizer dir (default: the demo model, "
                                                           "SmolLM2-135M-Instruct)")
    g.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                   help="weights and compute dtype (default: bf16 on GPU, fp32 on CPU)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="(default: cuda if available)")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="sdpa", help="(default: sdpa)")
    g.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                   help="torch's intra-op threads (default on a CPU: one per core this process may use, logged as "
                        "`CPU threads:`; on a GPU torch's); several "
                        "servers on one host run far faster with cores / servers each than all on every core")
    g.add_argument("--mem-fraction-static", type=float, default=None, metavar="F",
                   help="on CUDA, the most of the GPU's memory this server may take, as a fraction in (0, 1] "
                        "(torch.cuda.set_per_process_memory_fraction; SGLang's flag name): room for a colocated "
                        "trainer. No effect on a CPU (default: no cap)")
    g.add_argument("--weight-version", default="default",
                   help="meta_info.weight_version until the first weight update (default: default, as SGLang)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1); any non-loopback "
                                                       "address needs --api-key")
    g.add_argument("--port", type=int, default=30000, help="(default: 30000; 0 picks a free port)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every request but /health*")
    g = p.add_argument_group("scheduling")
    g.add_argument("--max-running-requests", type=int, default=64, metavar="N",
                   help="sequences decoded together at most (default: 64)")
    g.add_argument("--max-total-tokens", type=int, default=65536, metavar="N",
                   help="KV-cache budget in tokens: running sequences x the longest one's prompt + max_new_tokens "
                        "never exceeds it; a single longer request is refused (default: 65536)")
    g.add_argument("--max-queued-requests", type=int, default=4096, metavar="N",
                   help="sequences waiting at most; beyond it /generate answers 503 (default: 4096)")
    g.add_argument("--seed", type=int, default=42,
                   help="draws the random streams of requests sent without sampling_seed (default: 42)")
    p.set_defaults(run=run)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def validate(args: argparse.Namespace) -> None:
    """Every check that needs no model, before torch is imported."""
    if not is_loopback(args.host) and not args.api_key:
        raise UsageError(f"--host {args.host} is not a loopback address: pass --api-key KEY too (every request "
                         "but /health* must then carry `Authorization: Bearer KEY`)")
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("--api-key must not be empty")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: must be in [0, 65535]")
    fraction = args.mem_fraction_static
    if fraction is not None and not 0 < fraction <= 1:  # also NaN
        raise UsageError(f"--mem-fraction-static {fraction:g}: must be in (0, 1], a fraction of the GPU's memory")
    for flag in ("max_running_requests", "max_total_tokens", "max_queued_requests", "cpu_threads"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    if args.hf_checkpoint is not None:
        check_model_dir(args.hf_checkpoint, "--hf-checkpoint")


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a port in use fails in a second, not a minute."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"--host {host} --port {port}: cannot bind ({e.strerror or e})") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run(args: argparse.Namespace) -> int:
    from miles.utils.cpu_threads import set_wait_policy

    validate(args)
    set_wait_policy()  # before miles.serve.server imports torch: libgomp reads it once, when torch loads it
    sock = bind(args.host, args.port)
    try:
        from miles.serve.server import build_state, serve

        state = build_state(args)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        ready = (f"miles serve: ready on http://{shown}:{port} (model {state.scheduler.model_path}, "
                 f"weight_version {state.scheduler.weight_version})")
        serve(state, sock, ready_line=ready)
    finally:
        sock.close()
    return 0
