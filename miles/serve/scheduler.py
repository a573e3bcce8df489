"""`miles serve`'s continuous-batching scheduler: one thread owns the model; the HTTP handlers hand
it work and wait on futures.

Each iteration of the thread's loop is one decode step of the running batch:
  1. run the commands that arrived (new sequences, aborts, pause/continue, weight updates, checksums);
  2. forward the running rows' last sampled tokens (one token per row, RunningBatch.step);
  3. admit waiting sequences that fit (--max-running-requests, --max-total-tokens), prefill them
     and merge them into the batch: a request that arrives while a batch decodes joins it here,
     at the next step, not after the batch drains;
  4. sample one token per row with that row's own parameters and random stream, finish the rows
     that hit a stop token, a stop string or their budget, and drop them from the batch.

Determinism: row i's k-th token is drawn with the k-th uniform of the stream seeded by its
`sampling_seed` (miles.rollout.sampling.stream_uniforms, as LocalEngine draws sample i), so which
batch a sequence shares, and when it joined, changes its logits only by floating-point noise.

Pause (SGLang's modes): `abort` aborts every sequence in flight; `retract` sends the running ones
back to the queue and frees their KV (on continue they are prefilled again with what they made
so far and continue their random streams where they left off); `in_place` freezes the batch.
While paused nothing is admitted: new requests wait. A weight update that arrives while
sequences run and the server is not paused waits for the running batch to drain (every sequence
is made by one weight version; new requests wait), as SGLang's model-update lock makes it wait;
while paused it applies at once, and sequences frozen or retracted continue on the new weights.

MoE routes (`return_routed_experts`): while a sequence that asked for them is in flight, every
forward records each MoE layer's chosen experts (bridge/routing.py hooks) and each sequence keeps
those of its own tokens; its response carries them for every token fed, prompt then output but the
last (SGLang's `meta_info.routed_experts`: base64 of int32 (tokens, layers, k)).

Memory (SGLang's release/resume_memory_occupation, tags `weights`, `kv_cache`, `cuda_graph`):
a release needs no running rows (their KV would be lost; SGLang asserts an idle scheduler) and
frees what its tags name: `kv_cache` the running batch's cache, `weights` the model to the CPU
(LocalEngine.release_memory), then the allocator's cached blocks go back to the driver. While
any tag is released nothing is admitted: new requests wait, as while paused, until every tag is
resumed. A weight update meanwhile is copied into the CPU weights at once and is what the
device holds after the resume. Releasing or resuming a tag twice changes nothing.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from miles.bridge import routing
from miles.config import SamplingParams
from miles.rollout.local import LocalEngine
from miles.rollout.sampling import sample_tokens, stream_uniforms
from miles.serve.batch import RunningBatch, SlotBatch
from miles.serve.types import Finish, SequenceRequest, SequenceResult
from miles.utils import device_memory

logger = logging.getLogger("miles")

PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's GPU_MEMORY_ALL_TYPES; no CUDA graphs here
ABORTED = "Aborted"


@dataclass(frozen=True, kw_only=True)
class SchedulerLimits:
    max_running_requests: int
    """Rows decoded together at most."""
    max_total_tokens: int
    """KV budget in tokens: rows x the longest row's final length (prompt + max new tokens) never exceeds it."""
    max_queued_requests: int
    """Sequences waiting at most; more are refused (503)."""


@dataclass(eq=False)
class _Sequence:
    """One sequence's scheduler-side state."""

    req: SequenceRequest
    future: Future
    arrived: float
    uniforms: torch.Tensor  # (T,) float64: its random stream's first max_new_tokens numbers
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    retractions: int = 0
    started: bool = False  # prefilled at least once
    # MoE, when asked for: (tokens, layers, k) expert ids of the tokens fed so far, one tensor per forward
    routes: list[torch.Tensor] = field(default_factory=list)

    @property
    def rid(self) -> str:
        return self.req.rid


@dataclass
class WeightUpdate:
    """Tensors checked against the model's parameters (weights.py), to copy in."""

    tensors: dict[str, torch.Tensor]
    weight_version: str
    model_path: str
    abort_all: bool = False


@dataclass(frozen=True)
class MemoryChange:
    """What a release or resume did: the tags asked for, every tag released after it, and the
    device's memory around it (device_memory.snapshot; None on a CPU)."""

    tags: tuple[str, ...]
    released: tuple[str, ...]
    before: dict[str, int] | None
    after: dict[str, int] | None


@dataclass
class Counters:
    """What /get_server_info reports about the scheduler."""

    requests: int = 0
    finished: int = 0
    aborted: int = 0
    steps: int = 0  # decode iterations
    generated_tokens: int = 0
    prefill_tokens: int = 0
    prefill_batches: int = 0  # prefill forwards (one per group of newcomers admitted together)
    joined_running_batch: int = 0  # sequences admitted while other rows were mid-decode
    retracted: int = 0
    max_batch_size: int = 0
    weight_updates: int = 0


class Scheduler:
    """Owns `engine`'s model from its own thread. Every public method is thread-safe and returns
    at once; results come back through futures."""

    def __init__(self, engine: LocalEngine, *, pad_token_id: int, eos_token_ids: list[int], limits: SchedulerLimits,
                 weight_version: str, model_path: str, decode: Callable[..., str]):
        self.engine = engine
        # The fast path's slots where the engine has one (a model its runner can run), else the HF cache.
        self.batch = SlotBatch(engine.runner) if engine.runner is not None else RunningBatch(engine.model,
                                                                                           pad_token_id=pad_token_id)
        self.eos = frozenset(eos_token_ids)
        self.moe = bool(routing.routers(engine.model))  # return_routed_experts can be honoured
        self.limits = limits
        self.weight_version = weight_version
        self.model_path = model_path
        self.decode = decode  # token ids -> text, for stop strings
        self.counters = Counters()
        self.last_progress = time.monotonic()  # when an iteration last made tokens
        self.paused: str | None = None  # the pause mode, None when running
        self.released: frozenset[str] = frozenset()  # MEMORY_TAGS given back; empty when serving
        self._rows: list[_Sequence] = []  # the running batch's rows, in its row order
        self._next_tokens = torch.zeros(0, dtype=torch.long)  # (B,) sampled, not yet fed
        self._waiting: deque[_Sequence] = deque()
        self._rids: set[str] = set()  # every rid in flight (waiting or running)
        self._update: tuple[WeightUpdate, Future] | None = None  # waits for the running batch to drain
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._died: BaseException | None = None  # what ended the thread, if it failed
        self._thread = threading.Thread(target=self._loop, name="miles-serve-scheduler", daemon=True)

    # -- public, thread-safe --------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, message: str = "Server shutting down") -> None:
        """Aborts everything in flight and ends the thread."""
        self._call(lambda: self._abort_all(message))
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, requests: list[SequenceRequest]) -> list[Future]:
        """Queues sequences; each future resolves to a SequenceResult (or raises ValueError: a rid
        already in flight, or a full queue)."""
        futures = [Future() for _ in requests]
        self._post(self._enqueue, (requests, futures), futures)
        return futures

    def abort(self, rid: str, abort_all: bool) -> Future:
        """Aborts the sequences whose rid starts with `rid` (SGLang matches by prefix), or all."""
        return self._call(lambda: self._abort_all(ABORTED) if abort_all else self._abort_prefix(rid))

    def pause(self, mode: str) -> Future:
        return self._call(lambda: self._pause(mode))

    def resume(self) -> Future:
        return self._call(self._resume)

    def release_memory(self, tags: tuple[str, ...]) -> Future:
        """Resolves to a MemoryChange; raises ValueError while sequences are running."""
        return self._call(lambda: self._release_memory(tags))

    def resume_memory(self, tags: tuple[str, ...]) -> Future:
        """Resolves to a MemoryChange."""
        return self._call(lambda: self._resume_memory(tags))

    def update_weights(self, update: WeightUpdate) -> Future:
        """Resolves to the number of sequences paused (frozen or retracted) when the weights changed."""
        future = Future()
        self._post(self._request_update, (update, future), [future])
        return future

    def weights_checksum(self) -> Future:
        return self._call(lambda: (self.weight_version, self.engine.weights_checksum()))

    def flush_cache(self) -> Future:
        """True when nothing holds KV (SGLang refuses to flush while requests run or wait)."""
        return self._call(lambda: not self._rows and (self.paused is not None or not self._waiting))

    def snapshot(self) -> dict:
        """Counters and queue sizes (a racy read, for monitoring)."""
        return {**vars(self.counters), "num_running_reqs": len(self._rows), "num_waiting_reqs": len(self._waiting),
                "paused": self.paused, "memory_released": sorted(self.released),
                "kv_cache_bytes": self.batch.kv_bytes(), "batch_width": self.batch.width,
                "weight_version": self.weight_version, "max_running_requests": self.limits.max_running_requests,
                "max_total_num_tokens": self.limits.max_total_tokens,
                "max_queued_requests": self.limits.max_queued_requests}

    def _call(self, fn: Callable) -> Future:
        """fn() on the thread; the future gets its result."""
        future = Future()
        self._post(fn, (), [future], reply=future)
        return future

    def _post(self, fn: Callable, args: tuple, waiting: list[Future], reply: Future | None = None) -> None:
        """Hands fn(*args) to the thread (its result to `reply`, when given); if the thread has died,
        the `waiting` futures fail at once instead."""
        if self._died is not None:
            for f in waiting:
                f.set_exception(RuntimeError(f"the scheduler failed: {self._died!r}"))
        else:
            self._inbox.put((fn, args, reply))

    # -- the thread -------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_pending_update()  # once the running batch has drained
                self._run_commands(block=not self._has_work())
                if self._has_work():
                    self._iteration()
        except BaseException as e:  # the model failed: every waiter learns it, /health turns 503
            logger.exception("miles serve: the scheduler thread died")
            self._died = e
            self._fail_all(e)
            raise

    def _has_work(self) -> bool:
        """Rows to decode, or sequences to admit (none while paused or released, none while an
        update waits)."""
        if self.paused is not None or self.released:
            return False
        return bool(self._rows) or (bool(self._waiting) and self._update is None)

    def _run_commands(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if item is None:
                return
            fn, args, future = item
            try:
                result = fn(*args)
            except Exception as e:
                if future is None:
                    raise
                future.set_exception(e)
            else:
                if future is not None:
                    future.set_result(result)

    def _iteration(self) -> None:
        logits = []
        if self._rows:
            step, routes = self._forward(self._rows, self.batch.step, self._next_tokens)  # (B, V); (B, layers, k)
            logits.append(step)
            if routes is not None:
                for i, seq in enumerate(self._rows):
                    if seq.req.return_routed_experts:
                        seq.routes.append(routes[i:i + 1])
        logits += self._admit()
        if not logits:
            return
        tokens, logps = self._sample(torch.cat(logits))
        self.counters.max_batch_size = max(self.counters.max_batch_size, len(self._rows))
        self._finish_rows(tokens.tolist(), logps.tolist())
        self.counters.steps += 1
        self.last_progress = time.monotonic()

    # -- admission and prefill ------------------------------------------------------------------

    def _enqueue(self, requests: list[SequenceRequest], futures: list[Future]) -> None:
        """Queues a request's sequences, or refuses them all (a rid already in flight, a full queue)."""
        try:
            clash = [r.rid for r in requests if r.rid in self._rids]
            if clash:
                raise ValueError(f"Duplicate request ID(s) detected: {', '.join(clash[:4])} already in flight.")
            if len(self._waiting) + len(requests) > self.limits.max_queued_requests:
                raise OverflowError(f"The request queue is full ({self.limits.max_queued_requests} sequences "
                                    "waiting; --max-queued-requests).")
            now = time.monotonic()
            seqs = [_Sequence(r, f, now, stream_uniforms([r.sampling.seed], r.sampling.max_new_tokens)[0])
                    for r, f in zip(requests, futures)]
        except Exception as e:  # every future of the request says why
            for f in futures:
                f.set_exception(e)
            return
        for seq in seqs:
            self._rids.add(seq.rid)
            self._waiting.append(seq)
        self.counters.requests += len(seqs)

    def _fits(self, rows: int, longest: int) -> bool:
        return rows <= self.limits.max_running_requests and rows * longest <= self.limits.max_total_tokens

    def _admit(self) -> list[torch.Tensor]:
        """Prefills the waiting sequences that fit, FIFO, into the batch; returns their logits."""
        if self._update is not None or not self._waiting:
            return []
        running = len(self._rows)
        longest = max((s.req.final_len for s in self._rows), default=0)
        group, singles, finished = [], [], []
        while self._waiting:
            seq = self._waiting[0]
            if seq.req.sampling.max_new_tokens == 0:  # prefill only: no row in the batch
                finished.append(self._waiting.popleft())
                continue
            longest_if = max(longest, seq.req.final_len)
            rows = running + len(group) + len(singles) + 1
            if not self._fits(rows, longest_if):
                if rows == 1:  # alone it does not fit: protocol.py should have refused it
                    self._resolve(self._waiting.popleft(), Finish("abort", message="does not fit the KV budget"))
                    continue
                break
            longest = longest_if
            self._waiting.popleft()
            (singles if seq.req.wants_input_logprobs and not seq.started else group).append(seq)
        for seq in finished:
            self._prompt_only(seq)
        if running and (group or singles):
            self.counters.joined_running_batch += len(group) + len(singles)
        logits = []
        self.counters.prefill_batches += bool(group) + len(singles)
        if group:
            fed = [s.req.input_ids + s.output_ids for s in group]
            group_logits, routes = self._forward(group, self.batch.prefill, fed)
            logits.append(group_logits[:, -1])
            if routes is not None:  # the prompts left-padded to the longest (RunningBatch.prefill)
                routes = routes.view(len(fed), -1, *routes.shape[1:])
                for i, (seq, ids) in enumerate(zip(group, fed)):
                    seq.routes = [routes[i, routes.shape[1] - len(ids):]]  # a re-prefill feeds everything again
        for seq in singles:
            prompt_logits, routes = self._forward([seq], self.batch.prefill, [seq.req.input_ids],
                                                  keep_logits=self._logits_to_keep(seq))
            prompt_logits = prompt_logits[0]
            seq.routes = [routes] if routes is not None else []
            seq.input_logprobs = self._input_logprobs(seq, prompt_logits)
            logits.append(prompt_logits[-1:])
        for seq in group + singles:
            self.counters.prefill_tokens += len(seq.req.input_ids) + len(seq.output_ids)
            seq.started = True
        self._rows += group + singles
        return logits

    def _forward(self, fed: list[_Sequence], fn: Callable, *args, **kwargs):
        """`fn(*args)`, a forward of the tokens of sequences `fed`, and (tokens, layers, k) the experts each
        MoE layer chose for them in the forward's order, when one of them asked for routes (else None).
        Routes are read by forward hooks: the HF cache path only (an MoE model never gets the fast
        path's CUDA graphs, where hooks do not run)."""
        if not (self.moe and any(s.req.return_routed_experts for s in fed)):
            return fn(*args, **kwargs), None
        with routing.record_routes(self.engine.model) as calls:
            out = fn(*args, **kwargs)
        return out, torch.stack(calls[0], dim=1)

    @staticmethod
    def _logits_to_keep(seq: _Sequence) -> int:
        """The prompt positions from logprob_start_len on: what `input_token_logprobs` needs."""
        return len(seq.req.input_ids) - seq.req.logprob_start_len

    @staticmethod
    def _input_logprobs(seq: _Sequence, logits: torch.Tensor) -> list[float | None]:
        """Log-probs of the prompt tokens from logprob_start_len on, the first None (as SGLang), at
        the sequence's temperature (unscaled when greedy), like its output log-probs.

        `logits` (K, V) are those of prompt positions start..P-1; position j predicts token j + 1.
        """
        prompt, start = seq.req.input_ids, seq.req.logprob_start_len
        scored = torch.tensor(prompt[start + 1:], device=logits.device)  # (K - 1,)
        scaled = logits[:-1].float() / (seq.req.sampling.temperature or 1.0)  # (K - 1, V)
        logps = torch.log_softmax(scaled, dim=-1).gather(-1, scored[:, None]).squeeze(-1)
        return [None] + logps.tolist()

    def _prompt_only(self, seq: _Sequence) -> None:
        """max_new_tokens 0: a prefill for the prompt's log-probs if asked, and no token."""
        if seq.req.wants_input_logprobs or (seq.req.return_routed_experts and self.moe):
            keep = self._logits_to_keep(seq) if seq.req.wants_input_logprobs else 1
            logits, routes = self._forward([seq], self.batch.score, seq.req.input_ids, keep_logits=keep)
            if seq.req.wants_input_logprobs:
                seq.input_logprobs = self._input_logprobs(seq, logits)
            seq.routes = [routes[:-1]] if routes is not None else []  # no token follows the last one fed
        self._resolve(seq, Finish("length"))

    # -- sampling and finishing -----------------------------------------------------------------

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token (B,) and its log-prob (B,) per row, each row with its own parameters; rows
        sharing (temperature, top_p, top_k) are sampled together."""
        u = torch.stack([s.uniforms[len(s.output_ids)] for s in self._rows])  # (B,) each row's next number
        groups = defaultdict(list)
        for i, s in enumerate(self._rows):
            groups[(s.req.sampling.temperature, s.req.sampling.top_p, s.req.sampling.top_k)].append(i)
        if len(groups) == 1:  # the common case: one sampling setup for the whole batch
            (temperature, top_p, top_k), = groups
            tok, logp = sample_tokens(logits, SamplingParams(max_new_tokens=1, temperature=temperature, top_p=top_p),
                                      u, top_k=top_k)
            return tok.cpu(), logp.float().cpu()
        tokens = torch.empty(len(self._rows), dtype=torch.long)
        logps = torch.empty(len(self._rows), dtype=torch.float32)
        for (temperature, top_p, top_k), rows in groups.items():
            index = torch.tensor(rows)
            params = SamplingParams(max_new_tokens=1, temperature=temperature, top_p=top_p)
            tok, logp = sample_tokens(logits[index.to(logits.device)], params, u[index], top_k=top_k)
            tokens[index], logps[index] = tok.cpu(), logp.float().cpu()
        return tokens, logps

    def _finish_rows(self, tokens: list[int], logps: list[float]) -> None:
        keep = []
        for i, (seq, tok, logp) in enumerate(zip(self._rows, tokens, logps)):
            seq.output_ids.append(tok)
            seq.output_logprobs.append(logp)
            self.counters.generated_tokens += 1
            finish = self._finish_of(seq, tok)
            if finish is None:
                keep.append(i)
            else:
                self._resolve(seq, finish)
        if len(keep) < len(self._rows):
            self.batch.keep(keep)
            self._rows = [self._rows[i] for i in keep]
        self._next_tokens = torch.tensor([tokens[i] for i in keep], dtype=torch.long)

    def _finish_of(self, seq: _Sequence, tok: int) -> Finish | None:
        """SGLang's order: the length cap first, then stop tokens, then stop strings."""
        s = seq.req.sampling
        if len(seq.output_ids) >= s.max_new_tokens:
            return Finish("length")
        if not s.ignore_eos and (tok in self.eos or tok in s.stop_token_ids):
            return Finish("stop", matched=tok)
        if s.stop:
            text = self.decode(seq.output_ids, skip_special_tokens=s.skip_special_tokens,
                               spaces_between_special_tokens=s.spaces_between_special_tokens)
            for stop in s.stop:
                if stop in text:
                    return Finish("stop", matched=stop)
        return None

    def _resolve(self, seq: _Sequence, finish: Finish) -> None:
        self._rids.discard(seq.rid)
        if finish.kind == "abort":
            self.counters.aborted += 1
        else:
            self.counters.finished += 1
        routes = None
        if seq.req.return_routed_experts and seq.routes:  # prompt + output - 1 tokens: the last is never fed
            routes = torch.cat(seq.routes).to(device="cpu", dtype=torch.int32).numpy().tobytes()
        result = SequenceResult(output_ids=seq.output_ids, output_logprobs=seq.output_logprobs, finish=finish,
                                weight_version=self.weight_version, e2e_latency=time.monotonic() - seq.arrived,
                                input_logprobs=seq.input_logprobs, retractions=seq.retractions, routed_experts=routes)
        if not seq.future.done():
            seq.future.set_result(result)

    # -- aborts, pause, weights -----------------------------------------------------------------

    def _abort_where(self, hit: Callable[[_Sequence], bool], message: str) -> int:
        """Aborts matching sequences, running or waiting; returns how many."""
        running = [i for i, s in enumerate(self._rows) if hit(s)]
        for i in running:
            self._resolve(self._rows[i], Finish("abort", message=message))
        if running:
            gone = frozenset(running)
            keep = [i for i in range(len(self._rows)) if i not in gone]
            self.batch.keep(keep)
            self._next_tokens = self._next_tokens[keep] if keep else self._next_tokens[:0]
            self._rows = [self._rows[i] for i in keep]
        waiting = [s for s in self._waiting if hit(s)]
        self._waiting = deque(s for s in self._waiting if not hit(s))
        for s in waiting:
            queued_message = "Abort in waiting queue" if not s.started else message
            self._resolve(s, Finish("abort", message=queued_message, in_waiting_queue=not s.started))
        return len(running) + len(waiting)

    def _abort_all(self, message: str) -> int:
        return self._abort_where(lambda s: True, message)

    def _abort_prefix(self, rid: str) -> int:
        if not rid:
            logger.warning("miles serve: /abort_request with an empty rid and abort_all false: nothing aborted")
            return 0
        return self._abort_where(lambda s: s.rid.startswith(rid), ABORTED)

    def _pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        self.paused = mode
        if mode == "abort":
            self._abort_all(ABORTED)
        elif mode == "retract":
            self._retract_all()
        logger.info("miles serve: generation paused (mode %s)", mode)

    def _retract_all(self) -> None:
        """Running rows back to the head of the queue, in order, their KV freed."""
        for seq in reversed(self._rows):
            seq.retractions += 1
            self._waiting.appendleft(seq)
        self.counters.retracted += len(self._rows)
        self._rows = []
        self._next_tokens = self._next_tokens[:0]
        self.batch.clear()

    def _resume(self) -> None:
        self.paused = None
        logger.info("miles serve: generation continued")

    def _release_memory(self, tags: tuple[str, ...]) -> MemoryChange:
        if self._rows:
            raise ValueError(f"release_memory_occupation needs an idle engine, but {len(self._rows)} sequence(s) "
                             "are running: pause with mode abort or retract, or let them finish, first")
        device = self.engine.device
        before = device_memory.snapshot(device)
        if "kv_cache" in tags:
            self.batch.clear()
        if "weights" in tags:
            self.engine.release_memory()
        device_memory.give_back(device)
        self.released |= frozenset(tags)
        change = MemoryChange(tags, tuple(sorted(self.released)), before, device_memory.snapshot(device))
        logger.info("miles serve: memory released (%s), %s; requests wait until /resume_memory_occupation",
                    ", ".join(tags), device_memory.describe(change.before, change.after))
        return change

    def _resume_memory(self, tags: tuple[str, ...]) -> MemoryChange:
        device = self.engine.device
        before = device_memory.snapshot(device)
        if "weights" in tags:
            self.engine.resume_memory()  # with every weight update taken while released
        self.released -= frozenset(tags)
        change = MemoryChange(tags, tuple(sorted(self.released)), before, device_memory.snapshot(device))
        state = f"still released: {', '.join(change.released)}" if change.released else "serving again"
        logger.info("miles serve: memory resumed (%s), %s; %s", ", ".join(tags),
                    device_memory.describe(change.before, change.after), state)
        return change

    def _request_update(self, update: WeightUpdate, future: Future) -> None:
        if self._update is not None:
            future.set_exception(ValueError("another weight update is in progress"))
            return
        if update.abort_all:
            self._abort_all(ABORTED)
        self._update = (update, future)
        if self.paused is not None or not self._rows:
            self._apply_pending_update()

    def _apply_pending_update(self) -> bool:
        """Copies the pending weights in (the running batch is empty or paused); True when done."""
        if self._update is None or (self._rows and self.paused is None):
            return False
        update, future = self._update
        self._update = None
        try:
            self.engine.update_weights(update.tensors.items(), weight_version=_as_int(update.weight_version,
                                                                                    self.engine.weight_version))
        except Exception as e:  # weights.py checked names and shapes; this is unexpected
            future.set_exception(e)
            return True
        self.weight_version, self.model_path = update.weight_version, update.model_path
        self.counters.weight_updates += 1
        paused = len(self._rows) + sum(1 for s in self._waiting if s.started)
        logger.info("miles serve: weights updated from %s (weight_version %s, %d tensors)", update.model_path,
                    update.weight_version, len(update.tensors))
        future.set_result(paused)
        return True

    def _fail_all(self, error: BaseException) -> None:
        for seq in itertools.chain(self._rows, self._waiting):
            if not seq.future.done():
                seq.future.set_exception(RuntimeError(f"the scheduler failed: {error!r}"))
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[2] is not None:
                item[2].set_exception(RuntimeError(f"the scheduler failed: {error!r}"))


def _as_int(version: str, fallback: int) -> int:
    """LocalEngine counts weight versions in optimizer steps; SGLang's are strings (miles sends str(step))."""
    try:
        return int(version)
    except ValueError:
        return fallback

