"""The CUDA paths (skipped without a GPU): the decode loop's device-side stop state and stop
checks every 16 steps, static cache included, and a bf16 run end to end."""

import pytest
import torch

from miles.rollout.local import LocalEngine
from miles.utils.models import eos_token_ids, load_causal_lm, load_tokenizer
from test_engine import eager_decode, sp
from test_train import metrics, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cuda_decode_matches_the_eager_reference(tiny_model, cache):
    tok = load_tokenizer(tiny_model)
    model = load_causal_lm(tiny_model, device="cuda", attention_backend="sdpa")
    engine = LocalEngine(model, eos_token_ids=eos_token_ids(model, tok), pad_token_id=tok.pad_token_id, cache=cache)
    assert engine.decoder.stop_check_every == 16
    prompts = [tok(t)["input_ids"] for t in ("hello", "a much longer prompt", "x", "what is seven plus two?")] * 4
    sampling = sp(40, 1.0, 1.0)
    u = torch.rand(len(prompts), 40, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = engine.decode(prompts, sampling, u)
    want = eager_decode(model, prompts, sampling, u, set(engine.eos_token_ids), tok.pad_token_id)
    same = sum(out.token_ids == tokens for out, (tokens, _) in zip(got, want))
    assert same == len(prompts)
    assert {o.finish_reason for o in got} == {"stop", "length"}


def test_bf16_run_on_cuda(tiny_args):
    rows = metrics(run(tiny_args, "--device", "cuda", "--check-weight-update-equal"))
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["forward_logp_max_diff"] < 0.5 for r in rows)  # bf16 engine vs bf16-autocast trainer
