"""`miles serve`'s HTTP side: SGLang's native endpoints on FastAPI, in front of the scheduler thread.

Handlers parse and check the body (protocol.py), hand the work to the scheduler and await its
futures; nothing here touches the model. Bodies are read as raw JSON, not through FastAPI's
models, so that every malformed request gets SGLang's 400 `{"error": {"message": ...}}` and no
422. With an API key, every request but OPTIONS and `/health*` (SGLang's exemptions) must carry
`Authorization: Bearer KEY`, else 401 `{"error": "Unauthorized"}`.

Endpoints: POST|PUT /generate; GET /health, /health_generate; GET /model_info (/get_model_info);
GET /get_weight_version (/weight_version); GET /server_info (/get_server_info); GET|POST
/flush_cache; POST /update_weights_from_disk, /pause_generation, /continue_generation,
/abort_request; GET|POST /release_memory_occupation, /resume_memory_occupation (`{"tags": [...]}`,
absent or empty: all); GET /weights_checksum (miles' own: per-tensor dtype and sha256).

The memory endpoints answer `{"success": true, "message", "tags", "released_tags", "gpu_memory"}`
(SGLang's answer nothing, `null`; its clients read no body): `gpu_memory` is the device's
bytes before and after ({allocated, reserved, free, total}), null on a CPU. A release while
sequences run is a 400; requests that arrive while released wait for the resume.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.datastructures import Headers

from miles import __version__
from miles.serve.protocol import BadRequest, ModelLimits, error_body, generate_response, parse_generate
from miles.serve.scheduler import MEMORY_TAGS, PAUSE_MODES, MemoryChange, Scheduler, WeightUpdate
from miles.serve.types import RowSampling, SequenceRequest
from miles.serve.weights import ParameterSpecs, WeightLoadError, load_checked

logger = logging.getLogger("miles")

AUTH_EXEMPT_PREFIXES = ("/health", "/ready", "/metrics")  # SGLang's (srt/utils/auth.py)
HEALTH_TIMEOUT_S = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT's default
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
           "requests, the operation will not be performed.)\n")


@dataclass
class ServeState:
    """What the handlers share: the scheduler, the tokenizer's two directions, and what the model is."""

    scheduler: Scheduler
    tokenize: Callable[[str], list[int]]
    decode: Callable[..., str]
    limits: ModelLimits
    specs: ParameterSpecs
    model_info: dict  # model_type, architectures, tokenizer_path (static)
    server_args: dict  # the flags, for /server_info (api_key left out)
    api_key: str | None
    seed: int

    def __post_init__(self):
        self.rng = random.Random(self.seed)  # the seeds of requests sent without a sampling_seed


async def _json(request: Request, *, empty_ok: bool = False):
    raw = await request.body()
    if not raw.strip():
        if empty_ok:
            return {}
        raise BadRequest("the request body is empty; a JSON object is needed")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # ValueError covers bad UTF-8 and 4,300-digit integers
        raise BadRequest(f"the request body is not valid JSON: {str(e)[:200]}") from None


def _object(body, endpoint: str) -> dict:
    if not isinstance(body, dict):
        raise BadRequest(f"{endpoint} takes a JSON object, got {type(body).__name__}")
    return body


def _memory_tags(body: dict) -> tuple[str, ...]:
    """SGLang's `tags`: null or empty means every tag."""
    tags = body.get("tags")
    if tags is None or tags == []:
        return MEMORY_TAGS
    if not isinstance(tags, list) or not all(isinstance(t, str) and t in MEMORY_TAGS for t in tags):
        raise BadRequest(f"tags must be a list of {', '.join(MEMORY_TAGS)} (or null: all), got {str(tags)[:80]}")
    return tuple(dict.fromkeys(tags))


def _memory_answer(change: MemoryChange, message: str) -> dict:
    gpu = None if change.before is None else {"before": change.before, "after": change.after}
    return {"success": True, "message": message, "tags": list(change.tags), "released_tags": list(change.released),
            "gpu_memory": gpu}


class ApiKeyCheck:
    """ASGI middleware: `Authorization: Bearer KEY` (scheme case-insensitive, token compared in
    constant time) on every request but OPTIONS and SGLang's exempt paths; else 401."""

    def __init__(self, app, api_key: str):
        self.app, self.api_key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and not scope["path"].startswith(
                AUTH_EXEMPT_PREFIXES) and not self._authorized(Headers(scope=scope)):
            await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key)


async def _wait(request: Request, scheduler: Scheduler, futures: list, rids: list[str]) -> list:
    """The sequences' results; a client that hangs up gets its sequences aborted (as SGLang)."""
    gathered = asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
    while True:
        done, _ = await asyncio.wait({gathered}, timeout=1.0)
        if done:
            return gathered.result()
        if await request.is_disconnected():
            for rid in rids:
                scheduler.abort(rid, abort_all=False)
            return await gathered


def build_app(state: ServeState) -> FastAPI:
    app = FastAPI(title="miles serve", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    scheduler = state.scheduler

    if state.api_key is not None:
        app.add_middleware(ApiKeyCheck, api_key=state.api_key)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, e: BadRequest):
        return JSONResponse(error_body(str(e)), status_code=e.status)

    # -- generation ----------------------------------------------------------------------------

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        parsed = parse_generate(await _json(request), state.limits, state.tokenize, state.rng)
        futures = scheduler.submit(parsed.sequences)
        try:
            results = await _wait(request, scheduler, futures, [s.rid for s in parsed.sequences])
        except ValueError as e:  # a rid already in flight
            raise BadRequest(str(e)) from None
        except OverflowError as e:  # the queue is full
            raise BadRequest(str(e), status=503) from None
        except RuntimeError as e:  # the scheduler thread died
            return JSONResponse(error_body(str(e)), status_code=500)
        out = [generate_response(req, res, state.decode) for req, res in zip(parsed.sequences, results)]
        return JSONResponse(out if parsed.batched else out[0])

    @app.get("/health")
    async def health():
        return Response(status_code=200 if scheduler.alive else 503)

    @app.get("/health_generate")
    async def health_generate():
        """200 once the engine makes a token: recent traffic counts, else a 1-token greedy probe."""
        if not scheduler.alive or scheduler.paused is not None or scheduler.released:
            return Response(status_code=503)
        if time.monotonic() - scheduler.last_progress < 1.0:
            return Response(status_code=200)
        probe = SequenceRequest(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=[0],
                                sampling=RowSampling(max_new_tokens=1, temperature=0.0, top_p=1.0, top_k=None, seed=0))
        future = scheduler.submit([probe])[0]
        try:
            await asyncio.wait_for(asyncio.wrap_future(future), HEALTH_TIMEOUT_S)
        except (asyncio.TimeoutError, Exception):
            scheduler.abort(probe.rid, abort_all=False)
            return Response(status_code=503)
        return Response(status_code=200)

    # -- what is served ------------------------------------------------------------------------

    def model_info():
        return {"model_path": scheduler.model_path, "tokenizer_path": state.model_info["tokenizer_path"],
                "is_generation": True, "preferred_sampling_params": None, "weight_version": scheduler.weight_version,
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": state.model_info["model_type"], "architectures": state.model_info["architectures"]}

    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, model_info, methods=["GET"])

    def weight_version():
        return {"weight_version": scheduler.weight_version}

    for path in ("/get_weight_version", "/weight_version"):
        app.add_api_route(path, weight_version, methods=["GET"])

    def server_info():
        stats = scheduler.snapshot()
        return {**state.server_args, **stats, "context_length": state.limits.context_len,
                "vocab_size": state.limits.vocab_size, "internal_states": [stats], "version": __version__}

    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, server_info, methods=["GET"])

    @app.get("/weights_checksum")
    async def weights_checksum():
        version, sums = await asyncio.wrap_future(scheduler.weights_checksum())
        return {"weight_version": version,
                "tensors": {name: {"dtype": s.dtype, "sha256": s.sha256} for name, s in sums.items()}}

    # -- control -------------------------------------------------------------------------------

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        flushed = await asyncio.wrap_future(scheduler.flush_cache())
        return PlainTextResponse(FLUSHED if flushed else "Flush cache failed.\n", status_code=200 if flushed else 400)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = _object(await _json(request, empty_ok=True), "/pause_generation")
        mode = body.get("mode") or "abort"
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode must be one of {', '.join(PAUSE_MODES)}, got {str(mode)[:40]!r}")
        await asyncio.wrap_future(scheduler.pause(mode))
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        _object(await _json(request, empty_ok=True), "/continue_generation")
        await asyncio.wrap_future(scheduler.resume())
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = _object(await _json(request, empty_ok=True), "/abort_request")
        rid, abort_all = body.get("rid") or "", body.get("abort_all") or False
        if not isinstance(rid, str) or not isinstance(abort_all, bool):
            raise BadRequest("abort_request takes {\"rid\": str, \"abort_all\": bool}")
        await asyncio.wrap_future(scheduler.abort(rid, abort_all))
        return Response(status_code=200)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request):
        tags = _memory_tags(_object(await _json(request, empty_ok=True), "/release_memory_occupation"))
        try:
            change = await asyncio.wrap_future(scheduler.release_memory(tags))
        except ValueError as e:  # sequences are running
            raise BadRequest(str(e)) from None
        return _memory_answer(change, f"Memory released: {', '.join(tags)}.")

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request):
        tags = _memory_tags(_object(await _json(request, empty_ok=True), "/resume_memory_occupation"))
        change = await asyncio.wrap_future(scheduler.resume_memory(tags))
        return _memory_answer(change, f"Memory resumed: {', '.join(tags)}.")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        def failed(message: str):
            logger.warning("miles serve: weight update refused: %s", message)
            return JSONResponse({"success": False, "message": message, "num_paused_requests": 0}, status_code=400)

        try:
            body = _object(await _json(request), "/update_weights_from_disk")
        except BadRequest as e:
            return failed(str(e))
        model_path, version = body.get("model_path"), body.get("weight_version")
        abort_all = body.get("abort_all_requests") or False
        if not isinstance(model_path, str) or not model_path:
            return failed("model_path must be a non-empty string")
        if version is not None and (isinstance(version, bool) or not isinstance(version, (str, int))):
            return failed(f"weight_version must be a string, got {str(version)[:40]!r}")
        if not isinstance(abort_all, bool):
            return failed("abort_all_requests must be a boolean")
        try:
            tensors = await asyncio.to_thread(load_checked, model_path, state.specs)  # decoding goes on meanwhile
        except WeightLoadError as e:
            return failed(f"Failed to update weights: {e}. The old weights are kept.")
        new_version = scheduler.weight_version if version is None else str(version)
        update = WeightUpdate(tensors, new_version, model_path, abort_all=abort_all)
        try:
            paused = await asyncio.wrap_future(scheduler.update_weights(update))
        except ValueError as e:
            return failed(str(e))
        message = "Succeeded to update model weights." + (f" Weight version updated to {version}." if version else "")
        return {"success": True, "message": message, "num_paused_requests": paused}

    return app
