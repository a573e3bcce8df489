"""The step-1 alignment check: each band by hand, and planted faults named by the right culprit."""

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles.debug.alignment import (FAIL, PASS, WARN, RewardStats, check_coherence, check_grad_norm,
                                   check_policy_vs_ref, check_response_nll, check_reward_signal, check_train_vs_engine)
from test_train import run


# -- each check's bands, by hand ------------------------------------------------------------------

def test_coherence_bands():
    assert check_coherence(0.9, 49152, 0.0, 0.0, "trainer").verdict == PASS
    bad = check_coherence(0.8 * math.log(49152), 49152, 0.0, 0.0, "trainer")
    assert bad.verdict == FAIL and "did not load" in bad.culprit and "Loaded checkpoint from" in bad.fix
    loop = check_coherence(1.0, 49152, 0.8, 0.0, "trainer")
    assert loop.verdict == WARN and "loop" in loop.culprit and "buffers dropped" in loop.culprit
    assert check_coherence(1.0, 49152, 0.0, 0.5, "trainer").verdict == WARN


@pytest.mark.parametrize("diff, verdict, words", [
    (0.0, PASS, "bitwise"), (5e-5, PASS, "jitter"), (0.05, WARN, "non-deterministic"), (3.0, FAIL, "configuration"),
])
def test_policy_vs_ref_bands(diff, verdict, words):
    c = check_policy_vs_ref(diff, 0.0, "ref_log_probs")
    assert c.verdict == verdict and words in (c.value + c.culprit)


def test_train_vs_engine_bands():
    assert check_train_vs_engine(3e-6, 2e-5, "fp32").verdict == PASS
    assert check_train_vs_engine(7e-3, 3e-2, "bf16").verdict == PASS  # measured on the H200: bf16 rounding
    warn = check_train_vs_engine(7e-3, 3e-2, "fp32")
    assert warn.verdict == WARN and "--use-tis" in warn.fix
    fail = check_train_vs_engine(0.9, 8.0, "bf16")
    assert fail.verdict == FAIL and "weight-sync" in fail.culprit and "--check-weight-update-equal" in fail.fix
    # A small mean can hide a few tokens the engine scores nothing like the trainer: the max alone fails it.
    assert check_train_vs_engine(0.01, 8.0, "bf16").verdict == FAIL


def test_response_nll_bands():
    assert check_response_nll(0.7, True, True).verdict == PASS
    assert check_response_nll(0.7, False, False).verdict == PASS  # a base model without a template, used raw
    raw = check_response_nll(0.7, True, False)  # an instruct model's template left unused
    assert raw.verdict == WARN and "--apply-chat-template" in raw.fix and "sent raw" in raw.culprit
    high = check_response_nll(2.0, True, True)
    assert high.verdict == WARN and "verify-chat-template" in high.fix and "far above normal" in high.culprit


def test_unused_chat_template_is_a_warn(tiny_args):
    argv = [a for a in tiny_args if a != "--apply-chat-template"]
    line = verdict_of(run(argv, "--num-rollout", "1"), "response NLL")
    assert "| WARN |" in line and "prompts are sent raw" in line


def test_grad_norm_bands():
    assert check_grad_norm(1.5).verdict == PASS
    assert check_grad_norm(float("nan")).verdict == FAIL and "NaN" in check_grad_norm(float("nan")).culprit
    assert check_grad_norm(float("inf")).verdict == FAIL
    assert check_grad_norm(5e3).verdict == WARN
    assert check_grad_norm(0.0).verdict == WARN


def test_reward_signal_bands():
    ok = check_reward_signal(RewardStats(32, 8, 5, [0.0, 1.0], 0, 3, "label"))
    assert ok.verdict == PASS and "5/8 groups mixed" in ok.value
    nolabels = check_reward_signal(RewardStats(32, 8, 0, [0.0], 32, 0, "anwser"))
    assert nolabels.verdict == FAIL and "--label-key 'anwser'" in nolabels.culprit
    unparsable = check_reward_signal(RewardStats(32, 8, 0, [0.0], 0, 32, "label"))
    assert unparsable.verdict == FAIL and "no parsable answer" in unparsable.culprit
    constant = check_reward_signal(RewardStats(32, 8, 0, [0.0], 0, 4, "label"))
    assert constant.verdict == WARN and "every reward is 0.0" in constant.culprit
    some_missing = check_reward_signal(RewardStats(32, 8, 3, [0.0, 1.0], 12, 0, "label"))
    assert some_missing.verdict == WARN and "labels missing 12/32" in some_missing.value
    unmixed = check_reward_signal(RewardStats(32, 8, 0, [0.0, 1.0], 0, 0, "label"))  # each group all 0 or all 1
    assert unmixed.verdict == WARN and "no group with mixed rewards" in unmixed.culprit


# -- end to end on the tiny model ---------------------------------------------------------------

def alignment_lines(out):
    return [line for line in (out / "train.log").read_text().splitlines() if "Alignment check |" in line]


def verdict_of(out, name):
    (line,) = [line for line in alignment_lines(out) if f"| {name}" in line]
    return line


def test_clean_run_reports_every_check(tiny_args):
    out = run(tiny_args, "--use-kl-loss", "--kl-loss-coef", "0.01")
    lines = alignment_lines(out)
    assert len(lines) == 6
    assert "| PASS | max |log_probs - ref_log_probs| 0, KL 0 (bitwise equal)" in verdict_of(out, "log_probs vs ref")
    assert "| PASS |" in verdict_of(out, "trainer vs engine") and "| PASS |" in verdict_of(out, "grad_norm")


@pytest.fixture(scope="module")
def unloaded_model(tmp_path_factory):
    """A checkpoint whose weights are the random init: what a run sees when loading silently failed."""
    from conftest import build_model_dir

    path = build_model_dir(tmp_path_factory.mktemp("unloaded"), "llama", seed=1)
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] / 20  # undo the fixture's sharpening: ~uniform
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def swap_model(args, path):
    args = list(args)
    args[args.index("--hf-checkpoint") + 1] = str(path)
    return args


def test_weights_that_did_not_load_fail_coherence(tiny_args, unloaded_model, tmp_path):
    argv = swap_model(tiny_args, unloaded_model) + ["--alignment-check", "error", "--num-rollout", "1"]
    r = subprocess.run([sys.executable, "-m", "miles", *argv], capture_output=True, text=True)
    assert r.returncode == 3, r.stderr[-1500:]
    assert r.stderr.strip().splitlines()[-1].startswith("error: alignment check failed: rollout coherence")
    line = verdict_of(tmp_path / "run", "rollout coherence")
    assert "| FAIL |" in line and "parameters did not load" in line
    assert (tmp_path / "run" / "metrics.jsonl").read_text().strip()  # the step's metrics were still written


def perturbed_copy(src, dst, scale, dtype=None):
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        w = w + scale * torch.randn(w.shape, generator=gen) * w.std() if scale else w
        weights[name] = w.to(dtype) if dtype is not None else w
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_lower_precision_reference_is_a_warn(tiny_args, tiny_model, tmp_path):
    ref = perturbed_copy(tiny_model, tmp_path / "ref_bf16", 0, torch.bfloat16)  # weights rounded to bf16
    out = run(tiny_args, "--use-kl-loss", "--kl-loss-coef", "0.01", "--ref-load", str(ref), "--num-rollout", "1")
    line = verdict_of(out, "log_probs vs ref")
    assert "| WARN |" in line and "lower-precision path" in line and "--deterministic-mode" in line


def test_a_different_reference_is_a_configuration_fail(tiny_args, tiny_model, tmp_path):
    ref = perturbed_copy(tiny_model, tmp_path / "ref_other", 1.0)
    out = run(tiny_args, "--use-kl-loss", "--kl-loss-coef", "0.01", "--ref-load", str(ref), "--num-rollout", "1")
    line = verdict_of(out, "log_probs vs ref")
    assert "| FAIL |" in line and "configuration" in line and "--ref-load" in line


def test_labels_missing_in_some_rows_is_named(tiny_args, tmp_path):
    data = tmp_path / "half.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1?", **({"label": str(i + 1)} if i % 2 else {})}) + "\n"
                            for i in range(8)))
    argv = list(tiny_args)
    argv[argv.index("--prompt-data") + 1] = str(data)
    i = argv.index("--custom-rm-path")
    del argv[i : i + 2]  # the math reward, on labels
    out = run(argv, "--num-rollout", "1")
    line = verdict_of(out, "reward signal")
    assert "labels missing 8/16" in line and ("| WARN |" in line or "| FAIL |" in line)
    assert "no parsable answer in" in line
    assert "4 of 8 rows" in (out / "train.log").read_text()  # the data loader's warning too


def test_one_tensor_corrupted_after_sync_is_named(tiny_args, tmp_path, monkeypatch):
    from miles.rollout.local import LocalEngine

    original = LocalEngine.update_weights

    def corrupting(self, named_tensors, *, weight_version):
        original(self, named_tensors, weight_version=weight_version)
        with torch.no_grad():
            self.model.model.layers[1].mlp.down_proj.weight[0, 0] += 1.0

    monkeypatch.setattr(LocalEngine, "update_weights", corrupting)
    out = run(tiny_args, "--check-weight-update-equal", "--num-rollout", "1")
    log = (out / "train.log").read_text()
    assert "checksum_ok=false" in log
    assert "1 engine tensor(s) differ from the trainer's after sync: model.layers.1.mlp.down_proj.weight" in log
    monkeypatch.setattr(LocalEngine, "update_weights", original)
    assert "checksum_ok=true" in (run(tiny_args, "--check-weight-update-equal", "--num-rollout", "1",
                                      "--output-dir", str(tmp_path / "clean")) / "train.log").read_text()


def test_dropped_buffer_after_sync_is_a_fail(tiny_args, monkeypatch, capsys, tmp_path):
    from miles.rollout.local import LocalEngine

    original = LocalEngine.update_weights

    def releasing(self, named_tensors, *, weight_version):  # an engine that frees buffers with the old weights
        original(self, named_tensors, weight_version=weight_version)
        self.model.model.rotary_emb.inv_freq.zero_()

    monkeypatch.setattr(LocalEngine, "update_weights", releasing)
    from miles.cli.main import main

    assert main(tiny_args + ["--alignment-check", "error"]) == 3
    assert "weight sync check failed at step 1" in capsys.readouterr().err
    log = (tmp_path / "run" / "train.log").read_text()
    assert "weight_sync buffer check FAIL at step 1: model.rotary_emb.inv_freq zeroed" in log


def test_debug_weight_sync_levels(tiny_args, tmp_path):
    log = (run(tiny_args, "--debug-weight-sync", "2", "--num-rollout", "1") / "train.log").read_text()
    assert "checksum=" in log
    assert log.count("weight_sync tensor ") == 21 and "weight_sync tensor lm_head.weight shape=[100, 64]" in log


# -- non-finite values and resumed runs ------------------------------------------------------------

@pytest.mark.parametrize("check, args", [
    (check_coherence, (float("nan"), 49152, 0.0, 0.0, "trainer")),
    (check_policy_vs_ref, (float("nan"), float("nan"), "ref_log_probs")),
    (check_policy_vs_ref, (0.0, float("inf"), "ref_log_probs")),
    (check_train_vs_engine, (float("nan"), float("nan"), "fp32")),
    (check_response_nll, (float("nan"), True, True)),
])
def test_every_check_fails_a_non_finite_value(check, args):
    c = check(*args)
    assert c.verdict == FAIL and "non-finite" in c.culprit


def test_nan_rewards_fail_the_reward_signal():
    c = check_reward_signal(RewardStats(16, 4, 2, [0.0, 1.0], 0, None, "label", nonfinite=3))
    assert c.verdict == FAIL and "3/16 rewards NaN/Inf" in c.value


def test_a_model_with_one_nan_weight_passes_no_check(tiny_args, tiny_model, tmp_path):
    nan_model = perturbed_copy(tiny_model, tmp_path / "nan_model", 0)
    weights = load_file(nan_model / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(weights, nan_model / "model.safetensors", metadata={"format": "pt"})
    from miles.cli.main import main

    argv = swap_model(tiny_args, nan_model) + ["--use-kl-loss", "--kl-loss-coef", "0.1", "--num-rollout", "1"]
    assert main(argv) == 3  # and the final checkpoint, which would hold the NaN, is refused
    out = tmp_path / "run"
    lines = {name: verdict_of(out, name) for name in ("rollout coherence", "log_probs vs ref", "trainer vs engine",
                                                       "response NLL", "grad_norm")}
    for name, line in lines.items():
        assert "| FAIL |" in line, line
    assert not (out / "checkpoints" / "step_1").exists()


def test_a_resumed_run_checks_what_still_holds(tiny_args, tmp_path):
    """A resumed run with a KL loss: the policy has left the reference, so `log_probs vs ref` is a
    SKIP (not a false WARN/FAIL, which --alignment-check error would turn into exit 3)."""
    kl = ["--use-kl-loss", "--kl-loss-coef", "0.5"]
    first = run(tiny_args, *kl, "--num-rollout", "2", "--lr", "1e-2", "--output-dir", str(tmp_path / "first"))
    resumed = run(tiny_args, *kl, "--num-rollout", "3", "--lr", "1e-2", "--alignment-check", "error",
                  "--load", str(first / "checkpoints"), "--output-dir", str(tmp_path / "resumed"))
    line = verdict_of(resumed, "log_probs vs ref")
    assert "| SKIP | resumed after step 2" in line
    assert "Alignment check after step 3" in (resumed / "train.log").read_text()
    assert "| PASS |" in verdict_of(resumed, "trainer vs engine")
