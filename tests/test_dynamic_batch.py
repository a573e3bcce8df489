"""--use-dynamic-batch-size --max-tokens-per-gpu: micro-batches cut by a token budget, not a sample count."""

import json

import pytest
from test_train import metrics, run, varied_args  # noqa: F401  (a fixture)

from miles.cli.main import main
from miles.errors import UsageError
from miles.train import micro_batches


def test_by_tokens_fills_each_micro_batch_up_to_the_budget():
    lengths = [5, 3, 4, 6, 2, 2]
    # Packed: real tokens. 5+3=8 <= 9, +4 > 9; 4 alone (+6 > 9); 6+2 = 8, +2 > 9.
    assert micro_batches.by_tokens(lengths, 0, 6, 9, packed=True) == [(0, 2), (2, 3), (3, 5), (5, 6)]
    # Padded: rows x the longest. 2 x 5 = 10 > 9; 2 x 4 = 8, 3 x 4 = 12 > 9; 6 alone (2 x 6 > 9); 2 x 2 = 4.
    assert micro_batches.by_tokens(lengths, 0, 6, 9, packed=False) == [(0, 1), (1, 3), (3, 4), (4, 6)]
    assert micro_batches.by_tokens(lengths, 2, 6, 100, packed=True) == [(2, 6)]  # a rank's share only
    with pytest.raises(UsageError, match="--max-tokens-per-gpu 5 is below sample 3's 6 tokens"):
        micro_batches.by_tokens(lengths, 0, 6, 5, packed=True)


def test_split_to_gives_every_rank_as_many_micro_batches():
    assert micro_batches.split_to([(0, 4)], 3) == [(0, 1), (1, 2), (2, 4)]
    assert micro_batches.split_to([(0, 1), (1, 5)], 3) == [(0, 1), (1, 3), (3, 5)]
    assert micro_batches.split_to([(0, 2), (2, 4)], 2) == [(0, 2), (2, 4)]
    with pytest.raises(ValueError):
        micro_batches.split_to([(0, 1)], 2)


def _micro_batches(run_dir) -> set[int]:
    """The micro-batches the rollout was trained in, from train.log's progress lines ("training: k/N")."""
    log = (run_dir / "train.log").read_text()
    return {int(line.split("training: ")[1].split("/")[1].split()[0]) for line in log.splitlines()
            if "INFO training: " in line and " micro-batches" in line}


@pytest.mark.parametrize("qkv", ["bshd", "thd"])
def test_a_token_budget_trains_as_fixed_micro_batches_do(varied_args, tmp_path, monkeypatch, qkv):  # noqa: F811
    """Same rollout (16 samples of varied length, one step): micro-batches of 2 samples vs a budget that
    takes more of them at once give the same loss, gradient norm and entropy; the budget decides how
    many forward/backward passes there are."""
    import sys

    from miles.utils import progress

    monkeypatch.setattr(progress, "PLAIN_INTERVAL_S", 0.0)  # a progress line for every micro-batch
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    flags = ["--qkv-format", qkv, "--seed", "3"]
    fixed = run(varied_args, *flags, "--micro-batch-size", "2", "--output-dir", str(tmp_path / "fixed"))
    budget = run(varied_args, *flags, "--use-dynamic-batch-size", "--max-tokens-per-gpu", "250",
                 "--output-dir", str(tmp_path / "budget"))
    whole = run(varied_args, *flags, "--use-dynamic-batch-size", "--max-tokens-per-gpu", "100000",
                "--output-dir", str(tmp_path / "whole"))
    a, b, c = metrics(fixed)[0], metrics(budget)[0], metrics(whole)[0]
    for key in ("train/loss", "train/grad_norm", "train/entropy", "rollout/log_probs"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
        assert c[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert _micro_batches(fixed) == {8}
    assert _micro_batches(whole) == {1}
    (n,) = _micro_batches(budget)
    assert 1 < n < 8
    config = json.loads((budget / "config.json").read_text())
    assert config["use_dynamic_batch_size"] and config["max_tokens_per_gpu"] == 250
    assert config["log_probs_max_tokens_per_gpu"] is None  # scoring takes the training budget


@pytest.mark.parametrize("flags, message", [
    (["--max-tokens-per-gpu", "512"], "--max-tokens-per-gpu is read only with --use-dynamic-batch-size"),
    (["--use-dynamic-batch-size"], "--use-dynamic-batch-size needs --max-tokens-per-gpu N"),
    (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "0"], "--max-tokens-per-gpu must be > 0"),
    (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "64", "--true-on-policy-mode"],
     "--true-on-policy-mode scores the engine's tokens in micro-batches"),
])
def test_bad_budget_flags_are_refused(tiny_args, capsys, flags, message):
    assert main([*tiny_args, *flags]) == 2
    assert message in capsys.readouterr().err


def test_a_budget_below_the_longest_sample_stops_the_run(tiny_args, tmp_path, capsys):
    out = tmp_path / "short"
    assert main([*tiny_args, "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --max-tokens-per-gpu 4 is below the longest sample's")
    assert err in (out / "train.log").read_text()


def test_scoring_cuts_by_its_own_budget(tiny_args, tmp_path, capsys):
    """--log-probs-max-tokens-per-gpu is the scoring forwards' budget, apart from training's."""
    out = tmp_path / "scoring"
    assert main([*tiny_args, "--use-dynamic-batch-size", "--max-tokens-per-gpu", "100000",
                 "--log-probs-max-tokens-per-gpu", "4", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --log-probs-max-tokens-per-gpu 4 is below the longest sample's")


def test_score_rollout_runs_one_forward_per_bound(tiny_model):
    """The scoring pass forwards the rows of each bound at once, and gives the same log-probs as
    fixed micro-batches."""
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM

    from miles.bridge.types import Sample
    from miles.train.batch import TrainBatch, score_rollout

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    samples = [Sample(group_index=0, index=i, prompt="", tokens=list(range(3, 9 + i)), response_length=3,
                      loss_mask=[1, 1, 1]) for i in range(5)]
    batch = TrainBatch.from_samples(samples, 0, "cpu")
    rows = []
    model.model.register_forward_pre_hook(lambda m, args, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True)
    fixed, _ = score_rollout(model, batch, 1, 1.0, contextlib.nullcontext)
    assert rows == [1] * 5
    rows.clear()
    cut, _ = score_rollout(model, batch, 1, 1.0, contextlib.nullcontext, bounds=[(0, 3), (3, 5)], packed=False)
    assert rows == [3, 2]
    torch.testing.assert_close(cut, fixed, rtol=1e-5, atol=1e-5)
