"""The fast decode loop of miles' local engine: continuous batching over a ModelRunner's slots.

A call decodes R requests (prompts, each with its uniforms and token budget) through S <= R
slots. Requests wait in order; each free slot takes the next one, which is prefilled (packed with
the other newcomers) and draws its first token at once. Every decode step feeds each occupied slot
its last token; a slot whose row finished (EOS or its budget) is freed at the next check and
taken by a waiting request. The live rows are kept in the lowest slots (rows of high slots move
down into freed ones), so a step runs at the smallest batch bucket covering them (with CUDA
graphs; without, at their count).

All per-slot state lives on the device, and a step queues without waiting for it; the host looks
at it only every `check_every` steps (one sync each: 16 on a GPU, 1 on a CPU). A row finished
between checks decodes on masked: it writes nothing the results keep. On a GPU a check reads the
done flags as they stood before the last step it queued (copied to pinned memory then), so the GPU
runs that step while the host frees, admits and queues the next ones; a row done in that step is
freed at the check after.

Token k of request r is sampled with uniforms[r, k], whatever slot, batch or step it ran in: the
tokens depend on the request's prompt and stream, and on the other rows only through
floating-point noise of the batched kernels (as with any batched engine).

Device state, per slot s: req[s] (the request it decodes; R when free), made[s] (tokens drawn),
pos[s] (the position of its last drawn token, fed next), last[s] (that token), done[s], stopped[s]
(ended by EOS). Results: tokens and log-probs (R + 1, T + 1), row R and column T absorbing the
writes of free slots and finished rows.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import torch

from miles.config import SamplingParams
from miles.rollout.engine import GenerationOutput
from miles.rollout.local.runner import ModelRunner
from miles.rollout.local.slot_cache import bucket, upload
from miles.rollout.sampling import compiled_sample_tokens, sample_tokens
from miles.utils.cpu_threads import StepThreads, runnable_elsewhere, step_threads_allowed

logger = logging.getLogger("miles")

FUSED_ADVANCE = True  # on a GPU, _advance's updates in advance.py's kernel (engine_decode.py's -torchadvance: off)
LAGGED_CHECKS = True  # on a GPU, checks read the done flags before the last queued step (engine_decode.py's -drained)


class ContinuousBatcher:
    def __init__(self, runner: ModelRunner, *, eos_token_ids: list[int], pad_token_id: int, check_every: int,
                 max_slots: Callable[[int], int], prefill_tokens: int, compile_sampler: bool = False):
        self.runner = runner
        self.sample = compiled_sample_tokens if compile_sampler else sample_tokens
        self.pad_token_id = pad_token_id
        self.check_every = check_every
        self.max_slots = max_slots  # slot length -> the most slots the KV budget holds
        self.prefill_tokens = prefill_tokens  # packed tokens per prefill forward, at most
        self.device = runner.device
        self.eos = torch.tensor(eos_token_ids, dtype=torch.long, device=self.device)
        self.advance = None  # on a GPU, a step's bookkeeping in one kernel (advance.py; Triton, imported only there)
        if FUSED_ADVANCE and self.device.type == "cuda":
            from miles.rollout.local.advance import advance

            self.advance = advance
        self.step_threads: StepThreads | None = None  # the CPU decode's thread count, kept across calls

    def _tuner(self) -> StepThreads | None:
        """The CPU decode's StepThreads where it may tune (cpu_threads.step_threads_allowed), else None."""
        if self.device.type != "cpu" or not step_threads_allowed():
            return None
        most = torch.get_num_threads()
        if self.step_threads is None or self.step_threads.most != most:
            self.step_threads = StepThreads(most, runnable_elsewhere())
        return self.step_threads

    @torch.no_grad()
    def decode(self, prompts: list[list[int]], sampling: SamplingParams, uniforms: torch.Tensor,
               progress: Callable[[int], None] | None = None, limits: list[int] | None = None,
               weight_version: int | None = None) -> list[GenerationOutput]:
        """uniforms (R, T) drive the sampling; request r makes at most limits[r] tokens (default T)."""
        n, steps = len(prompts), uniforms.shape[1]
        limits = limits or [steps] * n
        length = max(len(p) for p in prompts) + steps
        self.runner.reserve(min(n, self.max_slots(length)), length)
        call = _Call(self, prompts, sampling, uniforms, limits, progress, self._tuner())
        threads = torch.get_num_threads()
        try:
            call.run()
        finally:
            torch.set_num_threads(threads)  # the process's own count again (a step may have run on fewer)
        return call.collect(weight_version)


class _Call:
    """One decode call's state (see the module docstring)."""

    def __init__(self, batcher: ContinuousBatcher, prompts, sampling, uniforms, limits, progress,
                 threads: StepThreads | None):
        self.b, self.runner = batcher, batcher.runner
        self.threads = threads
        self.prompts, self.sampling, self.progress = prompts, sampling, progress
        dev, n, steps = batcher.device, len(prompts), uniforms.shape[1]
        slots = self.runner.cache.slots
        self.n, self.steps = n, steps
        self.uniforms = torch.zeros(n + 1, steps + 1, dtype=torch.float64, device=dev)
        self.uniforms[:n, :steps] = uniforms.to(dev, torch.float64)
        self.limit = torch.tensor([*limits, steps], device=dev)  # (R + 1,)
        self.tokens = torch.full((n + 1, steps + 1), batcher.pad_token_id, dtype=torch.long, device=dev)
        self.log_probs = torch.zeros(n + 1, steps + 1, dtype=torch.float32, device=dev)
        self.made_of = torch.zeros(n + 1, dtype=torch.long, device=dev)  # tokens per request, set when freed
        self.stopped_of = torch.zeros(n + 1, dtype=torch.bool, device=dev)
        self.req = torch.full((slots,), n, dtype=torch.long, device=dev)
        self.made = torch.zeros(slots, dtype=torch.long, device=dev)
        self.pos = torch.zeros(slots, dtype=torch.long, device=dev)
        self.last = torch.zeros(slots, dtype=torch.long, device=dev)
        self.done = torch.ones(slots, dtype=torch.bool, device=dev)
        self.stopped = torch.zeros(slots, dtype=torch.bool, device=dev)
        self.waiting = deque(range(n))
        self.owner: list[int | None] = [None] * slots  # host view: the request in each slot
        self.joined = [0] * slots  # host view: the step count when each occupied slot's row was prefilled (its
        # age, the steps since, bounds its cached length and the tokens it may still draw: `_reach`)
        self.limits = limits
        self.step_count = 0
        # On a GPU: the done flags before a group's last step, and the event that says they have arrived.
        lagged = LAGGED_CHECKS and dev.type == "cuda"
        self.seen = torch.empty(slots, dtype=torch.bool, pin_memory=True) if lagged else None
        self.seen_at: torch.cuda.Event | None = None

    def run(self) -> None:
        queued = 1
        while True:
            self._harvest()
            self._admit()
            occupied = [s for s, r in enumerate(self.owner) if r is not None]
            if not occupied:
                return
            occupied = self._compact(occupied)
            # Steps until the next check, but none past the last token any row may still draw: a row at its budget
            # is done on the device, and the check frees it (none twice in a row: never wait on a row that is not).
            longest, left = self._reach(occupied)
            queued = min(self.b.check_every, left) or (0 if queued else 1)
            for i in range(queued):  # the longest row's cached length grows a column a step
                if i == queued - 1 and self.seen is not None:
                    self._look()
                self._step(occupied, min(longest + i, self.runner.cache.length))

    # -- the host's checks -------------------------------------------------------------------------

    def _look(self) -> None:
        """Queues a copy of the done flags to pinned memory after the steps queued so far (the next check reads it)."""
        self.seen.copy_(self.done, non_blocking=True)
        self.seen_at = torch.cuda.Event()
        self.seen_at.record()

    def _done(self) -> list[bool]:
        """The done flags: as `_look` copied them, once they have arrived; else now (waiting for every queued step)."""
        if self.seen_at is None:
            return self.done.tolist()
        self.seen_at.synchronize()
        self.seen_at = None
        return self.seen.tolist()

    def _harvest(self) -> None:
        """Frees the slots whose rows are done (one device sync)."""
        occupied = [s for s, r in enumerate(self.owner) if r is not None]
        if not occupied:  # (a copy is queued only before steps of occupied rows, which stay so until read here)
            return
        done = self._done()
        freed = [s for s in occupied if done[s]]
        if not freed:
            return
        index = upload([freed], self.b.device)[0]
        reqs = self.req[index]
        self.made_of[reqs] = self.made[index]
        self.stopped_of[reqs] = self.stopped[index]
        self.req.index_fill_(0, index, self.n)
        for s in freed:
            self.owner[s] = None

    def _admit(self) -> None:
        """Prefills waiting requests into free slots, lowest slots first, and draws their first token."""
        free, budget = [s for s, r in enumerate(self.owner) if r is None], self.b.prefill_tokens
        while free and self.waiting:
            slots, reqs, tokens = [], [], 0
            while free and self.waiting and (not reqs or tokens + len(self.prompts[self.waiting[0]]) <= budget):
                r = self.waiting.popleft()
                slots.append(free.pop(0))
                reqs.append(r)
                tokens += len(self.prompts[r])
            index, req, pos = upload([slots, reqs, [len(self.prompts[r]) - 1 for r in reqs]], self.b.device)
            self.req[index] = req
            self.pos[index] = pos
            for state in (self.made, self.done, self.stopped):  # index_fill_: `state[index] = 0` would copy the 0
                state.index_fill_(0, index, 0)  # from host memory, which waits for the GPU's queued work
            if self.threads is not None:  # the CPU prefill on the count the decode steps found faster
                torch.set_num_threads(self.threads.current)
            logits = self.runner.prefill(slots, [self.prompts[r] for r in reqs])
            self._advance(index, logits)
            for s, r in zip(slots, reqs):
                self.owner[s] = r
                self.joined[s] = self.step_count

    def _compact(self, occupied: list[int]) -> list[int]:
        """Moves the rows of the highest slots into free lower ones when that shrinks the bucket;
        returns the occupied slots after."""
        size = bucket(len(occupied), self.runner.buckets)
        movers = [s for s in occupied if s >= size]
        if not movers:
            return occupied
        holes = [s for s in range(size) if self.owner[s] is None][: len(movers)]
        self.runner.cache.move(movers, holes)
        src, dst = upload([movers, holes], self.b.device)
        for t in (self.req, self.made, self.pos, self.last, self.done, self.stopped):
            t[dst] = t[src]
        self.req.index_fill_(0, src, self.n)
        self.done.index_fill_(0, src, True)
        for s, d in zip(movers, holes):
            self.owner[d], self.joined[d], self.owner[s] = self.owner[s], self.joined[s], None
        return [s for s, r in enumerate(self.owner) if r is not None]

    def _reach(self, occupied: list[int]) -> tuple[int, int]:
        """Over the occupied slots, the most cached columns after the next step (an upper bound: a row's prompt, the
        prefill's token and one a step since it joined) and the most tokens a row may still draw (its budget less
        those; fewer if an EOS came). One pass over the slots a check, none a step: a check's host work is time the
        GPU's last queued step must cover (on a CPU, or with none queued, time the device waits)."""
        prompts, limits, owner, joined = self.prompts, self.limits, self.owner, self.joined
        reach = max(len(prompts[owner[s]]) + 1 - joined[s] for s in occupied)
        end = max(limits[owner[s]] - 1 + joined[s] for s in occupied)
        return min(reach + self.step_count, self.runner.cache.length), max(0, end - self.step_count)

    # -- the device's work -----------------------------------------------------------------------

    def _step(self, occupied: list[int], longest: int) -> None:
        """One decode step of the occupied slots (ascending; unchanged between the host's checks), whose cached lengths
        are at most `longest` after it."""
        batch = bucket(occupied[-1] + 1, self.runner.buckets)
        if self.threads is not None:  # the CPU decode: this step's thread count, and its time for the next ones
            torch.set_num_threads(self.threads.count())
            start = time.perf_counter()
        logits = self.runner.decode(batch, self.last[:batch], self.pos[:batch], longest)
        self._advance(slice(0, batch), logits)
        if self.threads is not None:
            self.threads.record(len(occupied), time.perf_counter() - start)
        self.step_count += 1
        if self.progress is not None:  # tokens of the longest row: the prefill's first one and a step's each
            self.progress(min(self.step_count + 1, self.steps))

    def _advance(self, slots: torch.Tensor | slice, logits: torch.Tensor) -> None:
        """Samples the next token of each slot in `slots` (an index tensor, or a decode step's slice of the lowest
        slots, whose state is then read and updated as views: no gather or scatter kernels) from its logits (k, V)
        and updates its state; finished and free slots write only to the absorbing row and column."""
        req, made = self.req[slots], self.made[slots]
        tok, logp = self.b.sample(logits, self.sampling, self.uniforms[req, made])
        if self.b.advance is not None:  # a GPU: the updates below in one kernel (advance.py) instead of ~20
            self.b.advance(slots, tok, logp, done=self.done, req=self.req, made=self.made, pos=self.pos,
                           last=self.last, stopped=self.stopped, limit=self.limit, eos=self.b.eos, tokens=self.tokens,
                           log_probs=self.log_probs, pad=self.b.pad_token_id)
            return
        live = ~self.done[slots]
        tok = torch.where(live, tok, self.b.pad_token_id)
        col = torch.where(live, made, self.steps)
        self.tokens[req, col] = tok
        self.log_probs[req, col] = logp
        hit = torch.isin(tok, self.b.eos) & live
        made = made + live  # a new tensor: `made` was a view of self.made for a slice
        self.made[slots] = made
        self.pos[slots] += live
        self.last[slots] = tok
        self.stopped[slots] |= hit
        self.done[slots] |= hit | (made >= self.limit[req])

    def collect(self, weight_version) -> list[GenerationOutput]:
        """The requests' outputs. Each row's made tokens only become Python lists, through numpy (512 rows of 256:
        5.4-8.1 ms on the 2-core CPU against 9.8-14.5 ms for torch's tolist of the whole tables, time a GPU sits
        idle)."""
        made, stopped = self.made_of[: self.n].tolist(), self.stopped_of[: self.n].tolist()
        tokens, log_probs = self.tokens[: self.n].cpu().numpy(), self.log_probs[: self.n].cpu().numpy()
        return [GenerationOutput(tokens[r, :m].tolist(), log_probs[r, :m].tolist(), "stop" if stop else "length",
                                 weight_version=weight_version) for r, (m, stop) in enumerate(zip(made, stopped))]
