"""The decode loop's bookkeeping kernel (miles/rollout/local/advance.py, run here in Triton's interpreter) against the
torch ops of batching._Call._advance it replaces on a GPU: the same state after a step, for a decode step's slice of
slots and for a prefill's index list."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from miles.rollout.local.advance import advance
from miles.rollout.local.batching import _Call
from test_engine import compile_for_an_h100

STATE = ("req", "made", "pos", "last", "done", "stopped", "tokens", "log_probs")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: the interpreter (conftest.py)


def _call(seed: int, eos: list[int]) -> _Call:
    """A call's state mid-rollout: 6 requests (row 6 absorbs), 8 slots (two free), budgets 2-5 of 5 columns, some
    rows done (at their budget or stopped), one drawing an EOS id (where there are any), one reaching its budget."""
    g = torch.Generator().manual_seed(seed)
    n, slots, steps = 6, 8, 5
    call = _Call.__new__(_Call)
    call.n, call.steps = n, steps
    call.req = torch.tensor([3, 0, n, 5, 1, n, 2, 4])
    call.limit = torch.tensor([5, 2, 4, 5, 3, 5, steps])
    call.made = torch.randint(0, 3, (slots,), generator=g)
    call.made[call.req == n] = 0
    call.pos = call.made + torch.randint(4, 9, (slots,), generator=g)
    call.last = torch.randint(0, 50, (slots,), generator=g)
    call.done = (torch.rand(slots, generator=g) < 0.3) | (call.req == n)
    call.done[[1, 4]] = False  # live: slot 1 draws an EOS id below, slot 4 (request 1) reaches its budget of 2
    call.made[4] = 1
    call.stopped = call.done & (torch.rand(slots, generator=g) < 0.5)
    call.tokens = torch.full((n + 1, steps + 1), 7)
    call.log_probs = torch.zeros(n + 1, steps + 1)
    call.uniforms = torch.rand(n + 1, steps + 1, generator=g, dtype=torch.float64)
    call.sampling = None
    tok = torch.randint(0, 50, (slots,), generator=g)
    tok[1] = eos[0] if eos else tok[1]  # slot 1 (request 0) draws an EOS id where there are any
    logp = -torch.rand(slots, generator=g)
    for name in (*STATE, "limit", "uniforms"):
        setattr(call, name, getattr(call, name).to(DEVICE))
    tok, logp = tok.to(DEVICE), logp.to(DEVICE)
    call.b = SimpleNamespace(pad_token_id=7, eos=torch.tensor(eos, dtype=torch.long, device=DEVICE), advance=None,
                             sample=lambda logits, sampling, u: (tok[: len(u)].clone(), logp[: len(u)].clone()))
    return call


@pytest.mark.parametrize("eos", [[11, 3], [11, 7], []])  # [11, 7]: the pad token is an EOS id, as in many models
@pytest.mark.parametrize("slots", [slice(0, 8), slice(0, 5), [6, 2, 4]])
def test_the_kernel_leaves_the_state_the_torch_ops_leave(eos, slots):
    slots = slots if isinstance(slots, slice) else torch.tensor(slots, device=DEVICE)
    moved = stopped = finished = 0  # over the seeds, what the step did: the comparison must cover each
    for seed in range(6):
        before, torch_ops, kernel = _call(seed, eos), _call(seed, eos), _call(seed, eos)
        kernel.b = copy.copy(kernel.b)
        kernel.b.advance = advance
        rows = 3 if isinstance(slots, torch.Tensor) else slots.stop
        logits = torch.zeros(rows, 50, device=DEVICE)
        torch_ops._advance(slots, logits)
        kernel._advance(slots, logits)
        for name in STATE:
            assert torch.equal(getattr(kernel, name), getattr(torch_ops, name)), (name, seed, slots, eos)
        moved += int((torch_ops.made != before.made).sum())
        stopped += int((torch_ops.stopped & ~before.stopped).sum())
        finished += int((torch_ops.done & ~before.done & ~torch_ops.stopped).sum())
    assert moved and finished
    assert stopped or not eos or not isinstance(slots, slice)  # slot 1's EOS: in both slices, not in the index list


WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # `import triton` raises ImportError here, as where it is not installed
import miles.cli.main, miles.loop  # noqa: E401, F401  (the commands, `miles train`'s loop)
from miles.config import SamplingParams
from miles.rollout.local import LocalEngine
from miles.utils.models import load_causal_lm

model = load_causal_lm(sys.argv[1], device="cpu", attention_backend="sdpa")
engine = LocalEngine(model, eos_token_ids=[], pad_token_id=0)
out = engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=3, temperature=1.0, top_p=1.0), [0, 1])
print([len(o.token_ids) for o in out])
"""


def test_the_cpu_engine_runs_without_triton(tiny_qwen):
    """`pip install -e '.[demo]'` (the README's first command) brings no Triton: the engine's modules must import, and a
    CPU rollout run, without it (Triton is imported only where a GPU runs its kernels)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", WITHOUT_TRITON, str(tiny_qwen)], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[3, 3]"


@pytest.mark.parametrize("indexed", [False, True])
def test_the_bookkeeping_kernel_compiles_for_an_h100(indexed):
    """advance.py's kernel for a decode step's slice and a prefill's index list, at the batcher's dtypes (the
    interpreter above runs what the GPU's compiler may refuse)."""
    pointers = {"slot_ids": "*i64", "tok": "*i64", "logp": "*fp32", "done": "*i1", "req": "*i64", "made": "*i64",
                "pos": "*i64", "last": "*i64", "stopped": "*i1", "limit": "*i64", "eos": "*i64", "tokens": "*i64",
                "log_probs": "*fp32"}
    scalars = {n: "i32" for n in ("n", "n_eos", "steps", "pad")} | {"s_tokens": "i64", "s_log_probs": "i64"}
    order = [*pointers, "n", "n_eos", "s_tokens", "s_log_probs", "steps", "pad"]
    signature = {n: (pointers | scalars)[n] for n in order}
    compile_for_an_h100([("miles.rollout.local.advance", "_advance", signature, dict(INDEXED=indexed, BLOCK=128))])
