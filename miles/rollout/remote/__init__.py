"""Rollout through inference servers: SGLang's native API (SGLang, `miles serve`) or vLLM's.

`connect` gives a `RemoteEngine` over the servers of `--sglang-url` / `--vllm-url`, or over
servers it starts (launcher.py) when no URL is given. No model is loaded in this process.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from miles.config import EngineConfig
from miles.rollout.remote.engine import RemoteEngine
from miles.rollout.remote.http import EngineError, ServerClient
from miles.rollout.remote.launcher import ServerFleet
from miles.rollout.remote.sglang import SGLangServer
from miles.rollout.remote.untie import is_tied, untied_copy
from miles.rollout.remote.vllm import VLLMServer

BACKENDS = ("local", "sglang", "vllm")
_SERVERS = {"sglang": SGLangServer, "vllm": VLLMServer}

logger = logging.getLogger("miles")

__all__ = ["BACKENDS", "EngineError", "RemoteEngine", "connect"]


def routed_top_k(model_dir: str) -> int | None:
    """An MoE checkpoint's experts per token (a family of miles.bridge.routing), else None."""
    from transformers import AutoConfig

    from miles.bridge.routing import FAMILIES

    config = AutoConfig.from_pretrained(model_dir)
    return config.num_experts_per_tok if config.model_type in FAMILIES else None


def connect(cfg: EngineConfig, *, model_dir: str, closers: contextlib.ExitStack, precision: str, seed: int,
            max_model_len: int, eos_token_ids: list[int], vocab_size: int, weight_version: int,
            work_dir: Path, device: str | None = None, mem_fraction: float | None = None,
            launch=None) -> RemoteEngine:
    """`work_dir` holds what the servers load: the untied copy vLLM starts from (untie.py). For the
    servers miles starts: `device` (None: cuda if this process sees one), `mem_fraction` the share
    of the GPU each may take (None: the servers' defaults); `launch(backend, model_dir, options)`
    starts them elsewhere (engine actors on Ray) and returns their URLs, else a ServerFleet here does."""
    urls = list(cfg.urls)
    untie = cfg.backend == "vllm" and is_tied(model_dir)
    if untie and not urls:
        model_dir = str(untied_copy(model_dir, work_dir / f"untied-step_{weight_version}"))
        logger.info("vLLM: the tied lm_head is loaded untied (vLLM 0.32 reloads a tied one wrong): %s", model_dir)
    elif untie:
        logger.warning("%s serves a model with tied embeddings; vLLM 0.32's reload_weights leaves a tied lm_head on "
                       "the old weights: start it on an untied copy (miles does when it starts vLLM itself) and "
                       "check with --check-weight-update-equal", ", ".join(urls))
    top_k = routed_top_k(model_dir)
    options = dict(log_dir=cfg.log_dir, start_timeout=cfg.start_timeout, precision=precision, seed=seed,
                   max_model_len=max_model_len, python=cfg.vllm_python, weight_version=weight_version, device=device,
                   mem_fraction=mem_fraction, moe=top_k is not None)
    if not urls and launch is not None:
        urls = launch(cfg.backend, model_dir, options)
    elif not urls:
        urls = closers.enter_context(ServerFleet(cfg.backend, model_dir, cfg.num_engines, **options)).start()
    server_type = _SERVERS[cfg.backend]
    servers = [server_type(ServerClient(url, flag=server_type.flag, timeout=cfg.request_timeout, retries=cfg.retries),
                           eos_token_ids=eos_token_ids, vocab_size=vocab_size, routed_top_k=top_k) for url in urls]
    for server in servers:  # fail now, naming the URL, rather than at the first rollout
        server.client.request("GET", server.health_path)
    logger.info("Rollout backend %s: %d server(s) %s, %d requests in flight each", cfg.backend, len(servers),
                ", ".join(urls), cfg.concurrency)
    if top_k is not None:
        logger.info("MoE model: the servers are asked for each token's routed experts (top-%d)%s", top_k,
                    "; vLLM returns them only on a GPU (its --enable-return-routed-experts needs the V2 model runner, "
                    "which needs Triton)" if cfg.backend == "vllm" else "")
    return RemoteEngine(servers, concurrency=cfg.concurrency, weight_version=weight_version, untie=untie)
