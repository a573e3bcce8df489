"""--true-on-policy-mode: the engine's log-probs are the trainer's, bit for bit, and every token was
sampled from exactly those probabilities."""

import argparse
import contextlib
import functools
import json

import pytest
import torch

from miles.rollout.local import LocalEngine
from miles.rollout.local.true_on_policy import TrainerComputationVerifier
from miles.rollout.sampling import sample_tokens
from miles.train.batch import TrainBatch, score_rollout, score_sequences
from test_engine import make_engine, sp
from test_train import metrics, run


def verifying_engine(path, micro_batch_size):
    """A local engine that checks its rollouts against the trainer's scoring (as the loop builds it)."""
    plain, tok = make_engine(path)
    score = functools.partial(score_sequences, micro_batch_size=micro_batch_size, temperature=1.0,
                              pad_token_id=tok.pad_token_id, autocast=contextlib.nullcontext)
    engine = LocalEngine(plain.model, eos_token_ids=plain.eos_token_ids, pad_token_id=tok.pad_token_id,
                         verifier=TrainerComputationVerifier(score))
    return engine, tok


def test_engine_and_trainer_log_probs_are_bitwise_equal(tiny_args):
    # --no-use-rollout-logprobs: the trainer scores every rollout, so each step compares the two
    rows = metrics(run(tiny_args, "--true-on-policy-mode", "--no-use-rollout-logprobs", "--num-rollout", "3"))
    for r in rows:
        assert r["train/train_rollout_logprob_abs_diff"] == 0.0
        assert r["forward_logp_max_diff"] == 0.0
        assert "rollout/true_on_policy_redrawn" in r
    # Without the mode the two computations differ in the last bits (fp32 rounding).
    plain = metrics(run(tiny_args, "--num-rollout", "1", "--output-dir", str(tiny_args[-1]) + "_plain"))
    assert 0 < plain[0]["forward_logp_max_diff"] < 1e-4


def test_the_mode_trains_on_the_verified_log_probs_without_scoring_them_again(tiny_args, monkeypatch):
    """The engine's log-probs are the trainer's computation, so the trainer's scoring pass runs only for the step-1
    alignment check; later steps take the engine's as the old log-probs, and their training forward matches them."""
    from miles.train.trainer import Trainer

    scored = []
    original = Trainer._score
    monkeypatch.setattr(Trainer, "_score", lambda self, *a, **k: scored.append(1) or original(self, *a, **k))
    out = run(tiny_args, "--true-on-policy-mode", "--num-rollout", "3")
    rows = metrics(out)
    assert len(scored) == 1  # step 1's alignment check only
    assert [r["train/rollout_logprobs_used"] for r in rows] == [0.0, 1.0, 1.0]
    # Step 1: the trainer's scoring against the engine; later: the training forward against the engine
    assert all(r["forward_logp_max_diff"] == 0.0 == r["train/recompute_logp_max_diff"] for r in rows)
    config = json.loads((out / "config.json").read_text())
    assert config["use_rollout_logprobs"] is True  # the resolved default is what config.json records


def test_rollout_logprobs_are_the_old_log_probs(tiny_args):
    """Without the mode the engine's log-probs differ from the trainer's in their last bits: with
    --use-rollout-logprobs the training forward is compared with the engine's (a gap), without it with the
    trainer's own scoring (none)."""
    reused = metrics(run(tiny_args, "--use-rollout-logprobs", "--num-rollout", "2"))
    assert reused[1]["train/rollout_logprobs_used"] == 1.0 and reused[1]["train/recompute_logp_max_diff"] > 0
    # The per-step trainer/engine gap is then the training forward's
    assert reused[1]["forward_logp_max_diff"] == reused[1]["train/recompute_logp_max_diff"]
    assert 0 < reused[1]["train/train_rollout_logprob_abs_diff"] < reused[1]["forward_logp_max_diff"]
    scored = metrics(run(tiny_args, "--num-rollout", "2", "--output-dir", str(tiny_args[-1]) + "_scored"))
    assert scored[1]["train/rollout_logprobs_used"] == 0.0 and scored[1]["train/recompute_logp_max_diff"] == 0.0
    assert scored[1]["forward_logp_max_diff"] > 0  # the scoring forward against the engine


def test_every_token_is_the_draw_from_the_reported_distribution(tiny_model):
    engine, tok = verifying_engine(tiny_model, micro_batch_size=4)
    prompts = [tok(t)["input_ids"] for t in ("hello", "what is two plus two?", "x", "abc")] * 2
    sampling = sp(16, 1.0, 1.0)
    seeds = list(range(8))
    outs = engine.generate(prompts, sampling, seeds)

    # Recompute the trainer's numbers independently and redraw each token with its own uniform.
    from miles.bridge.types import Sample

    samples = [Sample(group_index=0, index=i, prompt="", tokens=p + o.token_ids, response_length=len(o.token_ids),
                      loss_mask=[1] * len(o.token_ids)) for i, (p, o) in enumerate(zip(prompts, outs))]
    trainer_model = make_engine(tiny_model)[0].model  # a separate copy of the same weights
    batch = TrainBatch.from_samples(samples, tok.pad_token_id, "cpu")
    log_probs, logits = score_rollout(trainer_model, batch, 4, 1.0, torch.no_grad, with_logits=True)
    for i, (seed, out) in enumerate(zip(seeds, outs)):
        n = len(out.token_ids)
        assert out.log_probs == log_probs[i, :n].tolist()  # bitwise
        u = torch.rand(16, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        drawn, _ = sample_tokens(logits[i, :n], sampling, u[:n])
        assert drawn.tolist() == out.token_ids


def test_the_check_holds_one_micro_batch_of_logits_at_a_time(tiny_model):
    """The check draws from each micro-batch's logits as the scoring makes them and keeps none: a rollout's
    B x R x V logits (64 x 256 x 151,936 fp32 is 10 GB) are never held at once."""
    import weakref

    engine, tok = verifying_engine(tiny_model, micro_batch_size=2)
    score, sizes, alive = engine.verifier.score, [], []

    def spy(model, sequences, response_lengths, on_logits):
        def sink(start, stop, logits):
            assert all(ref() is None for ref in alive), "an earlier micro-batch's logits are still held"
            sizes.append(logits.shape[0])
            alive.append(weakref.ref(logits))
            on_logits(start, stop, logits)

        return score(model, sequences, response_lengths, on_logits=sink)

    engine.verifier.score = spy
    prompts = [tok(t)["input_ids"] for t in ("hello", "what is two plus two?", "x", "abc", "def", "ghi")]
    outs = engine.generate(prompts, sp(8, 1.0, 1.0), list(range(6)))
    assert sizes == [2, 2, 2] and all(o.token_ids for o in outs)
    assert all(ref() is None for ref in alive)


def test_a_disagreeing_token_is_redrawn_and_decoding_resumes(tiny_model, monkeypatch):
    """Plant a disagreement: the KV-cache decode samples one token wrongly; the check must catch
    it, keep the trainer-computation draw and decode on from there."""
    engine, tok = verifying_engine(tiny_model, micro_batch_size=2)
    honest = engine.generate([tok("hello")["input_ids"]], sp(12, 1.0, 1.0), [5])[0]

    original = LocalEngine.decode
    calls = []

    def faulty(self, prompts, sampling, uniforms, progress=None, limits=None):
        outs = original(self, prompts, sampling, uniforms, progress, limits)
        if not calls:  # the first decode: corrupt token 3 of the response
            outs[0].token_ids[3] = (outs[0].token_ids[3] + 1) % 90 + 4
        calls.append(1)
        return outs

    monkeypatch.setattr(LocalEngine, "decode", faulty)
    fixed = engine.generate([tok("hello")["input_ids"]], sp(12, 1.0, 1.0), [5])[0]
    assert fixed.redrawn == 1 and honest.redrawn == 0 and len(calls) == 2
    assert fixed.token_ids == honest.token_ids and fixed.log_probs == honest.log_probs


@pytest.mark.parametrize("flags, words", [
    (["--rollout-top-p", "0.9"], "--rollout-top-p 1"),
    (["--enable-torch-compile"], "--enable-torch-compile runs the engine's layers through Inductor"),
    (["--actor-num-gpus-per-node", "1"], "the trainer runs in Ray workers"),
    (["--true-on-policy-check", "stop"], "--true-on-policy-check stop needs a GPU's batch-invariant kernels"),
])
def test_true_on_policy_usage_errors(tiny_args, flags, words, capsys):
    from miles.cli.main import main

    assert main(tiny_args + ["--true-on-policy-mode", *flags]) == 2
    assert words in capsys.readouterr().err


def test_rollout_logprobs_with_tis_is_refused(tiny_args, capsys):
    from miles.cli.main import main

    assert main(tiny_args + ["--use-rollout-logprobs", "--use-tis"]) == 2
    assert "with --use-rollout-logprobs the trainer takes the engine's, so the weight is always 1" in \
        capsys.readouterr().err


def test_the_stop_check_is_a_setting_of_the_mode(tiny_args, capsys):
    from miles.cli.main import main

    assert main(tiny_args + ["--true-on-policy-check", "stop"]) == 2
    assert "--true-on-policy-check stop is how --true-on-policy-mode checks its rollouts" in capsys.readouterr().err


@pytest.mark.parametrize("device, mode, want", [("cuda", True, "stop"), ("cpu", True, "rescore"),
                                                ("cuda", False, "rescore")])
def test_the_check_is_chosen_by_the_device(device, mode, want, monkeypatch):
    """--true-on-policy-check auto (the default): stop on a GPU, whose kernels make the engine compute the trainer's
    numbers (the training forward is the check), rescore on a CPU; resolved before config.json is written."""
    from miles.cli.train import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = argparse.Namespace(device=device, precision=None, true_on_policy_mode=mode, true_on_policy_check="auto")
    resolve_device(args)
    assert args.true_on_policy_check == want


def test_a_step_whose_log_probs_are_not_the_trainers_stops_the_run():
    from miles.errors import CheckFailed
    from miles.loop import check_true_on_policy

    check_true_on_policy({"forward_logp_max_diff": 0.0}, 3)
    check_true_on_policy({}, 3)  # no engine log-probs (custom generation): nothing to compare
    with pytest.raises(CheckFailed,
                       match=r"at step 4 the engine's log-probs differ from the trainer's by up to 9.54e-07"):
        check_true_on_policy({"forward_logp_max_diff": 9.54e-07}, 4)

