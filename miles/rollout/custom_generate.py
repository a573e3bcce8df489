"""Custom generation (`--custom-generate-function-path module:function`): multi-turn and tool-using rollouts.

The function is `async def generate(client, sample, sampling) -> Sample`:

- `client` (`EngineClient`): `await client.generate(tokens, max_new_tokens=None)` runs the rollout
  engine (the local one or the servers) on a token sequence and returns a `GenerationOutput`
  (token ids, their log-probs, finish reason); `client.tokenizer` encodes tool outputs. Each call
  of a sample draws from its own random stream (the sample's seed, then the call number).
- `sample`: the prompt `Sample` (tokens = the prompt's, response_length 0, label, metadata).
- `sampling`: the rollout's `SamplingParams`.

It returns the finished sample: `tokens` = prompt + everything after it (policy turns and tool
outputs), `response_length`, `loss_mask` with 1 on the tokens the policy produced and 0 on the rest
(tool outputs), and `rollout_log_probs` with the engine's log-prob of each policy token (any number
where the mask is 0; it is not used). Masked tokens are left out of the loss, the trainer/engine
mismatch metrics and the alignment check, as every consumer weighs tokens by `loss_mask`. The
reward is computed afterwards, as for any sample. What comes back is checked (`check_finished`):
a wrong length or a changed prompt is one `error:` line naming the function.

With the local engine, the calls the samples make at the same time are batched into one
`generate` (per sampling setup): a two-turn rollout of N samples is two engine calls, not 2N.
Through servers each call is its own request, made concurrently. The bundled example:
miles.rollout.examples.calculator:generate.
"""

from __future__ import annotations

import asyncio
import inspect
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

from miles.bridge.types import Sample
from miles.config import SamplingParams
from miles.errors import UsageError
from miles.rollout.engine import Engine, GenerationOutput
from miles.rollout.sampling import derived_seed

FLAG = "--custom-generate-function-path"


class Batcher:
    """Gathers the calls that the samples' coroutines make before any of them can go on, and runs them
    as one `engine.generate` per sampling setup, in the event loop's thread (the local engine)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.pending: list[tuple[list[int], SamplingParams, int, asyncio.Future]] = []
        self.calls: list[int] = []  # the batch size of each engine call made

    async def generate(self, tokens: list[int], sampling: SamplingParams, seed: int) -> GenerationOutput:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self.pending:  # after the coroutines ready now have made their calls
            loop.call_soon(self._flush)
        self.pending.append((tokens, sampling, seed, future))
        return await future

    def _flush(self) -> None:
        pending, self.pending = self.pending, []
        by_sampling = defaultdict(list)
        for item in pending:
            by_sampling[item[1]].append(item)
        for sampling, items in by_sampling.items():
            self.calls.append(len(items))
            try:
                outputs = self.engine.generate([list(t) for t, _, _, _ in items], sampling, [s for _, _, s, _ in items])
            # A stop signal too: a callback must not raise, so every caller of the batch gets the error.
            except BaseException as e:  # noqa: BLE001
                for *_, future in items:
                    future.set_exception(e)
                continue
            for (*_, future), out in zip(items, outputs):
                future.set_result(out)


class EngineClient:
    """One sample's handle on the rollout engine."""

    def __init__(self, engine: Engine, sampling: SamplingParams, seed: int, tokenizer, batcher: Batcher | None):
        self.engine, self.sampling, self.seed = engine, sampling, seed
        self.tokenizer, self._batcher = tokenizer, batcher
        self.calls = 0

    async def generate(self, tokens: list[int], max_new_tokens: int | None = None) -> GenerationOutput:
        sampling = self.sampling if max_new_tokens is None else replace(self.sampling, max_new_tokens=max_new_tokens)
        seed = self.seed if self.calls == 0 else derived_seed("turn", self.seed, self.calls)
        self.calls += 1
        if self._batcher is not None:
            return await self._batcher.generate(list(tokens), sampling, seed)
        return await asyncio.to_thread(lambda: self.engine.generate([list(tokens)], sampling, [seed])[0])


def load_generate(path: str) -> Callable:
    from miles.utils.imports import load_function

    fn = load_function(path, FLAG)
    if not inspect.iscoroutinefunction(fn):
        raise UsageError(f"{FLAG} {path}: {fn.__name__} must be an async function (async def ...(client, sample, "
                         "sampling))")
    return fn


def run_custom(fn: Callable, path: str, engine: Engine, tokenizer, samples: list[Sample], seeds: list[int],
               sampling: SamplingParams, *, batched: bool, batcher: Batcher | None = None) -> list[Sample]:
    """Each prompt sample through `fn`, concurrently; the finished samples, checked, in order.
    `batched` (the local engine): concurrent calls share one engine call (`batcher`, or a new one)."""
    batcher = batcher or (Batcher(engine) if batched else None)

    async def one(sample: Sample, seed: int) -> Sample:
        prompt = list(sample.tokens)
        try:
            out = await fn(EngineClient(engine, sampling, seed, tokenizer, batcher), sample, sampling)
        except UsageError:
            raise
        except Exception as e:  # the user's function failed: say where, in one line
            import traceback

            frame = traceback.extract_tb(e.__traceback__)[-1]
            raise UsageError(f"{FLAG} {path} raised {type(e).__name__}: {e} (at {frame.filename}:{frame.lineno}) on "
                             f"sample {sample.index}; fix the function") from e
        check_finished(out, prompt, path)
        return out

    async def all_of() -> list[Sample]:
        return await asyncio.gather(*(one(s, seed) for s, seed in zip(samples, seeds)))

    return asyncio.run(all_of())


def check_finished(out, prompt: list[int], path: str) -> None:
    where = f"{FLAG} {path}"
    if not isinstance(out, Sample):
        raise UsageError(f"{where} returned {type(out).__name__}; it must return the finished Sample")
    n = out.response_length
    if out.tokens[:len(prompt)] != prompt or len(out.tokens) != len(prompt) + n:
        raise UsageError(f"{where}: sample {out.index} must keep its prompt's {len(prompt)} tokens and add exactly "
                         f"response_length ({n}) more (it has {len(out.tokens)} tokens)")
    if len(out.loss_mask) != n or any(m not in (0, 1) for m in out.loss_mask):
        raise UsageError(f"{where}: sample {out.index}'s loss_mask must hold response_length ({n}) values of 0 or 1 "
                         f"(got {len(out.loss_mask)})")
    if len(out.rollout_log_probs) != n:
        raise UsageError(f"{where}: sample {out.index}'s rollout_log_probs must hold response_length ({n}) numbers, "
                         f"the engine's log-prob of each policy token (any number where loss_mask is 0); got "
                         f"{len(out.rollout_log_probs)}")
