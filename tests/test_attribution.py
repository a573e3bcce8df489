"""Mismatch attribution (miles.debug.attribution): each planted cause of a train/engine log-prob gap is
the factor named, with the numbers; in a real run its lines land in train.log and `miles doctor` names it."""

from __future__ import annotations

import contextlib
import copy
import json
import random
from types import SimpleNamespace

import pytest
import torch

from miles.debug.attribution import Probe, attribute, cached_decode, score
from miles.train.trainer import mixed_precision
from miles.utils.models import load_causal_lm

FP32 = contextlib.nullcontext


@pytest.fixture(scope="module")
def model(tiny_model):
    return load_causal_lm(tiny_model, device="cpu", attention_backend="sdpa").eval()


def probe_tokens(n: int = 3, prompt: int = 6, response: int = 10) -> Probe:
    rng = random.Random(0)
    seqs = [[rng.randrange(4, 90) for _ in range(prompt + response)] for _ in range(n)]
    return Probe(seqs, [response] * n, [[0.0] * response for _ in range(n)])


def recorded(model, probe: Probe, temperature: float = 1.0, autocast=FP32) -> Probe:
    """The probe with the engine's log-probs as MODEL would have recorded them."""
    return Probe(probe.sequences, probe.response_lengths,
                 score(model, probe, temperature=temperature, autocast=autocast, pad_token_id=1))


def sides(trainer_model, engine_model, trainer_autocast=FP32):
    trainer = SimpleNamespace(model=trainer_model, pad_token_id=1, autocast=trainer_autocast)
    engine = SimpleNamespace(model=engine_model, autocast=FP32)
    return trainer, engine


def verdict(result) -> str:
    return result.lines()[-1]


def test_the_engines_other_weights_are_named(model):
    engine_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in engine_model.parameters():
            p.add_(0.05 * torch.randn_like(p) * p.std())
    probe = recorded(engine_model, probe_tokens())
    result = attribute(probe, *sides(model, engine_model), temperature=1.0, precision="fp32")
    assert result.baseline > 0.01
    assert result.culprit.name == "weights" and result.culprit.gap < 1e-5
    assert "culprit id: weight_sync_stale" in verdict(result)
    decode = next(f for f in result.factors if f.name == "decode path")
    assert not decode.moves(result.baseline)  # the engine agrees with its own full forward


def test_raw_engine_log_probs_at_a_temperature_are_named(model):
    probe = recorded(model, probe_tokens(), temperature=1.0)  # the engine returned raw log-probs
    result = attribute(probe, *sides(model, model), temperature=0.6, precision="fp32")
    assert result.baseline > 0.01
    assert result.culprit.name == "temperature", result.lines()
    assert "culprit id: logprob_semantics" in verdict(result)
    weights = next(f for f in result.factors if f.name == "weights")
    assert not weights.moves(result.baseline)


def test_a_lower_precision_trainer_is_named(model):
    probe = recorded(model, probe_tokens())  # the engine in fp32
    bf16 = lambda: mixed_precision("bf16", "cpu")
    result = attribute(probe, *sides(model, model, bf16), temperature=1.0, precision="bf16")
    assert result.baseline > 1e-4
    assert result.culprit is not None and result.culprit.name == "precision", result.lines()
    assert "trainer in bf16 -> trainer in fp32" in "\n".join(result.lines())


def test_a_decode_loop_that_disagrees_with_its_own_forward_is_named(model):
    probe = recorded(model, probe_tokens())
    noisy = [[lp + 0.3 * (-1) ** k for k, lp in enumerate(row)] for row in probe.engine]  # a decode-loop bug
    result = attribute(Probe(probe.sequences, probe.response_lengths, noisy), *sides(model, model), temperature=1.0,
                       precision="fp32")
    assert result.culprit.name == "decode path", result.lines()
    kv = next(f for f in result.factors if f.name == "KV cache")
    assert not kv.moves(result.baseline)  # the cache itself reproduces the trainer's numbers
    assert "culprit id: engine_trainer_kernel_mismatch" in verdict(result)


def test_a_gap_no_factor_explains_gets_no_culprit(model):
    probe = recorded(model, probe_tokens())
    other = [[lp - 0.5 for lp in row] for row in probe.engine]
    engine_model = copy.deepcopy(model)
    result = attribute(Probe(probe.sequences, probe.response_lengths, other), *sides(model, engine_model),
                       temperature=1.0, precision="fp32")
    # the decode path moves it here (the engine's full forward agrees with the trainer): only with no
    # engine in the run is there no factor left
    no_engine = attribute(Probe(probe.sequences, probe.response_lengths, other), sides(model, None)[0], None,
                          temperature=1.0, precision="fp32")
    assert result.culprit.name == "decode path"
    assert no_engine.culprit is None and "no single factor moves the gap" in verdict(no_engine)
    assert "not measured: no engine in this run" in "\n".join(no_engine.lines())


def test_the_kv_cache_path_matches_the_full_forward_on_a_healthy_model(model):
    probe = probe_tokens()
    full = score(model, probe, temperature=0.8, autocast=FP32, pad_token_id=1)
    kv = cached_decode(model, probe, temperature=0.8, autocast=FP32)
    assert max(abs(a - b) for ra, rb in zip(full, kv) for a, b in zip(ra, rb)) < 1e-4


def test_a_run_whose_engine_loaded_other_weights_is_attributed_and_the_doctor_names_it(tiny_args, tmp_path,
                                                                                       monkeypatch, capsys):
    """A planted fault in a real run: the engine's copy of the weights is perturbed as it is built (a
    loading / mapping bug), so step 1's trainer-vs-engine check fails; the attribution names the weights,
    and `miles doctor RUN` puts it first."""
    from miles.cli.main import main
    from miles.rollout.local import engine as local_engine

    built = local_engine.LocalEngine.__init__

    def perturbed(self, model, **kw):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p) * p.std())
        built(self, model, **kw)

    monkeypatch.setattr(local_engine.LocalEngine, "__init__", perturbed)
    assert main(tiny_args + ["--num-rollout", "1"]) == 0
    log = (tmp_path / "run" / "train.log").read_text()
    assert "Mismatch attribution | weights | the trainer's weights -> the engine's weights" in log
    assert "Mismatch attribution | verdict | weights" in log
    capsys.readouterr()
    assert main(["doctor", str(tmp_path / "run"), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    first = report["findings"][0]
    assert first["id"] == "mismatch_attribution" and first["culprit_id"] == "weight_sync_stale"


def test_with_a_server_the_decode_path_is_its_prompt_log_probs(model):
    """A server holds its weights: the weights and KV-cache factors are not measurable, the decode path is
    the server's prompt log-probs (a full forward) against its decode's (here: a decode-loop bug)."""
    probe = recorded(model, probe_tokens(n=2))
    noisy = [[lp - 0.4 for lp in row] for row in probe.engine]

    class Server:  # RemoteEngine's seam: per-server prompt log-probs at temperature 1, for tokens[1:]
        def prompt_log_probs(self, tokens):
            full = score(model, Probe([tokens], [len(tokens) - 1], [[0.0] * (len(tokens) - 1)]), temperature=1.0,
                         autocast=FP32, pad_token_id=1)
            return {"http://server:30000": full[0]}

    result = attribute(Probe(probe.sequences, probe.response_lengths, noisy), sides(model, None)[0], Server(),
                       temperature=1.0, precision="fp32")
    lines = "\n".join(result.lines())
    assert "weights | the trainer's weights -> the engine's weights | not measured: the engine's weights are in a " \
           "server" in lines
    assert result.culprit.name == "decode path" and result.culprit.gap < 1e-4
    hot = attribute(Probe(probe.sequences, probe.response_lengths, noisy), sides(model, None)[0], Server(),
                    temperature=0.7, precision="fp32")
    assert "not measured: a server scores prompts at temperature 1 only" in "\n".join(hot.lines())


def test_an_attribution_that_fails_never_stops_the_run(model):
    from miles.bridge.types import Sample
    from miles.debug.attribution import measure_mismatch

    class Broken:  # a server that cannot score
        def prompt_log_probs(self, tokens):
            raise RuntimeError("POST /generate (scoring) gave no input_token_logprobs")

    probe = recorded(model, probe_tokens(n=1))
    sample = Sample(group_index=0, index=0, prompt="", tokens=probe.sequences[0], response_length=10,
                    loss_mask=[1] * 10, rollout_log_probs=[lp - 1.0 for lp in probe.engine[0]])
    said = measure_mismatch([sample], sides(model, None)[0], Broken(), temperature=1.0, precision="fp32", bound=1e-3)
    assert said.startswith("it failed: RuntimeError: POST /generate (scoring)")
