"""Bitwise-reproducible runs, per-step hashes, and diff-runs naming where two runs part."""

import json

import pytest

from miles.cli.main import main
from test_train import run

DET = ["--deterministic-mode", "--debug-determinism"]


def hashes(out):
    return [json.loads(line) for line in (out / "hashes.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, tiny_model, prompt_file, reward_module):
    from conftest import tiny_train_args

    out = tmp_path_factory.mktemp("ref") / "run"
    return run(tiny_train_args(tiny_model, prompt_file, reward_module, out), *DET)


def test_same_flags_same_hashes_every_step(reference_run, tiny_args, capsys):
    rows = hashes(reference_run)
    assert [r["step"] for r in rows] == [1, 2]
    assert set(rows[0]) == {"step", "prompts", "rollout_tokens", "rollout_log_probs", "rewards", "trainer_log_probs",
                            "loss", "gradients", "parameters"}
    again = run(tiny_args, *DET)
    assert hashes(again) == rows
    capsys.readouterr()
    assert main(["diff-runs", str(reference_run), str(again)]) == 0
    assert capsys.readouterr().out.strip() == "identical for 2 steps"
    log = (again / "train.log").read_text()
    assert ("--deterministic-mode: seeds python/numpy/torch=42" in log
            and "torch.use_deterministic_algorithms(True)" in log)
    assert "determinism step=1 prompts=" in log


def test_the_time_in_the_digests_is_a_metric_of_each_step(tiny_args, monkeypatch):
    """perf/hash_s: the seconds a step spends in --debug-determinism's digests (the trainer's parameter and
    gradient digests, the rollout's), so their cost is read from every step rather than from two runs' difference."""
    import time

    import miles.train.trainer as trainer_module

    digest = trainer_module.named_tensors_digest16
    monkeypatch.setattr(trainer_module, "named_tensors_digest16",
                        lambda named: time.sleep(0.1) or digest(named))  # 3 a step: gradients, parameters, log-probs
    from test_train import metrics

    rows = metrics(run(tiny_args, "--debug-determinism"))
    assert all(0.3 <= r["perf/hash_s"] < r["perf/step_time_s"] for r in rows)
    plain = metrics(run(tiny_args, "--output-dir", str(tiny_args[-1]) + "_plain"))
    assert not any("perf/hash_s" in r for r in plain)


def test_the_mode_sets_each_part_and_leaves_uninitialised_memory_unfilled(reference_run):
    import torch
    import torch.utils.deterministic

    from miles.debug.determinism import PARTS

    log = (reference_run / "train.log").read_text()
    for part in PARTS:
        if not part.cuda_sdpa_only:  # a CPU run
            assert part.enable() in log, part.name  # each part logs what it set
    assert "SDPA math kernel" not in log
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    # torch's NaN fill of torch.empty costs a write per allocation and makes no run repeat that would
    # not repeat without it (the runs above hash identically with it off)
    assert torch.utils.deterministic.fill_uninitialized_memory is False


def test_the_mode_with_a_compiled_trainer_repeats_bitwise(reference_run, tiny_args, tmp_path):
    """--deterministic-mode with --trainer-torch-compile: each run compiles afresh (Dynamo reset, no Inductor
    cache), with Inductor in its deterministic setting, and the two hash the same at every step."""
    import torch
    import torch._inductor.config as inductor_config

    runs = []
    with inductor_config.patch(force_disable_caches=True):
        for name in ("a", "b"):
            torch._dynamo.reset()
            runs.append(run(tiny_args, *DET, "--trainer-torch-compile", "--output-dir", str(tmp_path / name)))
    assert [r["step"] for r in hashes(runs[0])] == [1, 2]
    assert hashes(runs[0]) == hashes(runs[1])
    assert "Inductor deterministic" in (runs[1] / "train.log").read_text()
    assert inductor_config.deterministic


def test_the_mode_sets_inductor_deterministic_before_inductor_is_imported():
    """In a fresh process (Inductor not imported yet) the mode's setting reaches Inductor's config too."""
    import subprocess
    import sys

    code = ("import sys; from miles.debug.determinism import _inductor; _inductor(); "
            "assert 'torch._inductor.config' not in sys.modules; "
            "import torch._inductor.config as c; print(c.deterministic)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "True"


@pytest.mark.parametrize("flags, step, component", [
    (["--lr", "2e-3"], 1, "parameters"),            # same data, tokens, loss and gradients; a different update
    (["--seed", "7"], 1, "rollout_tokens"),         # same prompts, other sampling streams
    (["--clip-grad", "0.01"], 1, "parameters"),     # clipping acts after the gradient hashes are taken
    (["--rollout-shuffle"], 1, "prompts"),
])
def test_diff_runs_names_the_first_divergence(reference_run, tiny_args, flags, step, component, capsys):
    other = run(tiny_args, *DET, *flags)
    capsys.readouterr()
    assert main(["diff-runs", str(reference_run), str(other), "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert (result["step"], result["component"]) == (step, component)
    assert main(["diff-runs", str(reference_run), str(other)]) == 1
    assert f"first divergence: step {step}, {component}" in capsys.readouterr().out


@pytest.mark.parametrize("kl_type, step, component", [
    # k3's gradient at log pi == log ref is exactly zero, so step 1 trains bitwise as without the KL
    # loss; at step 2 the policy has moved and the KL term enters the loss.
    ("k3", 2, "loss"),
    # k1 = log pi - log ref is zero at step 1 too (same loss), but its gradient is grad log pi, not zero.
    ("k1", 1, "gradients"),
])
def test_a_kl_loss_enters_where_its_gradient_does(reference_run, tiny_args, kl_type, step, component, capsys):
    other = run(tiny_args, *DET, "--use-kl-loss", "--kl-loss-coef", "0.5", "--kl-loss-type", kl_type)
    capsys.readouterr()
    assert main(["diff-runs", str(reference_run), str(other), "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert (result["step"], result["component"]) == (step, component)


def test_replay_hashes_match_live_from_the_rollout_on(reference_run, tiny_args, tmp_path):
    live = run(tiny_args, *DET, "--save-debug-rollout-data", str(tmp_path / "d" / "data_{rollout_id}.pt"),
               "--output-dir", str(tmp_path / "live"))
    replay = run(tiny_args, *DET, "--load-debug-rollout-data", str(tmp_path / "d" / "data_{rollout_id}.pt"),
                 "--output-dir", str(tmp_path / "replay"))
    assert hashes(live) == hashes(replay)


def test_diff_runs_bad_input(tmp_path, capsys):
    assert main(["diff-runs", str(tmp_path), str(tmp_path)]) == 2
    assert "--debug-determinism" in capsys.readouterr().err


def test_the_engine_decodes_without_the_modes_slow_kernels_on_the_main_thread_only(tiny_model,
                                                                                   deterministic_algorithms):
    """The mode's sort-based indexed writes and math SDPA are for the trainer's backward; the engine's
    forward is lifted out of them while it decodes (miles.utils.forward_kernels), on the main thread
    only, and the mode is back as it was after."""
    import threading

    import torch

    from test_engine import make_engine, sp, uniforms

    engine, _ = make_engine(tiny_model)
    seen = []
    inner = engine.decoder.decode

    def decode(*a, **kw):
        seen.append((torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.flash_sdp_enabled()))
        return inner(*a, **kw)

    engine.decoder.decode = decode
    torch.backends.cuda.enable_flash_sdp(False)  # as the mode's math-kernel part leaves it
    try:
        engine.decode([[1, 2, 3]], sp(4, 1.0, 1.0), uniforms(4)[None])
        worker = threading.Thread(target=engine.decode, args=([[1, 2, 3]], sp(4, 1.0, 1.0), uniforms(4)[None]))
        worker.start()
        worker.join()
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert not torch.backends.cuda.flash_sdp_enabled()
    finally:
        torch.backends.cuda.enable_flash_sdp(True)
    assert seen == [(False, True), (True, False)]  # lifted on the main thread; as set in another


@pytest.mark.parametrize("strict", [True, False])
def test_the_trainer_runs_its_forward_and_backward_strict_with_flash_allowed(tiny_model, prompt_file, monkeypatch,
                                                                            deterministic_algorithms, strict):
    """Under the mode the trainer's forward/backward run with torch's deterministic algorithms strict and
    SDPA's flash kernel allowed (FlashAttention's backward is deterministic only when strict), and the
    mode is back as the mode set it after; with --async (an engine sampling in the process meanwhile,
    strict_deterministic_backward=False) nothing changes. The scoring forward runs as the training forward."""
    import torch

    from miles.train import trainer as trainer_module
    from miles.train.trainer import Trainer
    from miles.utils import forward_kernels
    from miles.utils.models import load_causal_lm
    from test_seams import live, train_cfg

    model = load_causal_lm(tiny_model, device="cpu", attention_backend="sdpa")
    trainer = Trainer(train_cfg(), model, None, temperature=1.0, group_size=3, pad_token_id=1, precision="fp32",
                      strict_deterministic_backward=strict)
    seen, scoring = [], []
    inner, inner_score = trainer._forward_backward, trainer_module.score_rollout

    def kernels():
        return (torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cuda.flash_sdp_enabled(),
                torch.backends.cuda.mem_efficient_sdp_enabled(), forward_kernels.strict())

    def forward_backward(*a, **kw):
        seen.append(kernels())
        return inner(*a, **kw)

    def scored(*a, **kw):
        scoring.append(kernels())
        return inner_score(*a, **kw)

    trainer._forward_backward = forward_backward
    monkeypatch.setattr(trainer_module, "score_rollout", scored)
    for enable in (torch.backends.cuda.enable_flash_sdp, torch.backends.cuda.enable_mem_efficient_sdp):
        enable(False)  # as the mode's math-kernel part leaves them
    try:
        trainer.train(live(tiny_model, prompt_file).generate(0).samples)
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert not torch.backends.cuda.flash_sdp_enabled() and not forward_kernels.strict()
    finally:
        for enable in (torch.backends.cuda.enable_flash_sdp, torch.backends.cuda.enable_mem_efficient_sdp):
            enable(True)
    expected = {(False, True, False, True)} if strict else {(True, False, False, False)}
    assert seen and set(seen) == expected
    assert scoring and set(scoring) == expected  # the scoring forward: the training forward's kernels


def test_compiled_code_reads_the_strict_state_without_a_graph_break(deterministic_algorithms):
    """Packed attention picks its kernel from forward_kernels.strict() (varlen_attn only where strict):
    compiled code reads it as a plain global, in one graph, and sees the state it was called in
    (torch.is_deterministic_algorithms_warn_only_enabled() would break the graph: the compiled trainer
    under the mode was 1.48x slower with that break)."""
    import torch

    from miles.utils import forward_kernels

    torch._dynamo.reset()
    read = torch.compile(lambda x: x + 1 if forward_kernels.strict() else x - 1, fullgraph=True)
    with forward_kernels.strict_backward():
        assert read(torch.zeros(2)).tolist() == [1.0, 1.0]
    assert read(torch.zeros(2)).tolist() == [-1.0, -1.0]  # recompiled on the changed global


def test_an_moe_trainer_keeps_the_modes_warn_only_kernels(deterministic_algorithms):
    """MoE layers count tokens per expert with torch.histc (no deterministic CUDA kernel), so an MoE
    trainer never enters strict mode: its forward/backward keep the mode's warn-only kernels."""
    from miles.testing.tiny import build_moe_model
    from miles.train.trainer import Trainer
    from miles.utils.forward_kernels import strict_backward
    from test_seams import train_cfg

    moe = Trainer(train_cfg(), build_moe_model(), None, temperature=1.0, group_size=3, pad_token_id=1,
                  precision="fp32")
    assert moe.moe is not None and moe.strict_backward is not strict_backward
