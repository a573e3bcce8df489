"""Evaluation during training (--eval-interval, --eval-prompt-data NAME PATH ...): held-out prompts through
the rollout engine at step 0 and every N steps, `eval/NAME` metrics; evaluation never changes training."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_train import metrics, run

from miles.cli.main import main
from miles.utils.jsonl import reconcile


@pytest.fixture
def eval_file(tmp_path):
    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {a} * 2?", "label": str(2 * a)}) + "\n"
                            for a in range(1, 7)))
    return path


def test_evaluation_runs_at_step_0_and_every_n_steps_and_never_trains(tiny_args, tmp_path, eval_file, prompt_file):
    """Two sets, three responses each: eval/NAME, pass@3 and response length at steps 0, 2 and 4; the
    training metrics and the final weights equal those of the same run without evaluation, bitwise."""
    flags = ["--num-rollout", "4", "--save-interval", "4"]
    plain = run(tiny_args, *flags, "--output-dir", str(tmp_path / "plain"))
    evaluated = run(tiny_args, *flags, "--eval-interval", "2", "--eval-prompt-data", "held", str(eval_file), "train",
                    str(prompt_file), "--n-samples-per-eval-prompt", "3", "--output-dir", str(tmp_path / "eval"))
    rows = metrics(evaluated)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert set(rows[0]) == {"step", "eval/held", "eval/held/pass@3", "eval/held/response_len", "eval/train",
                            "eval/train/pass@3", "eval/train/response_len"}
    assert [any(k.startswith("eval/") for k in r) for r in rows] == [True, False, True, False, True]
    assert all(0 <= r["eval/held"] <= r["eval/held/pass@3"] <= 1 for r in rows if "eval/held" in r)
    for a, b in zip(metrics(plain), rows[1:]):
        assert {k: v for k, v in a.items() if k.startswith("train/")} == \
            {k: v for k, v in b.items() if k.startswith("train/")}
    w1, w2 = (load_file(d / "checkpoints" / "step_4" / "model.safetensors") for d in (plain, evaluated))
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert "eval after step 2" in (evaluated / "train.log").read_text()


def test_greedy_evaluation_repeats_and_one_response_has_no_pass_at_k(tiny_args, tmp_path, eval_file):
    """Greedy by default: the same weights give the same eval numbers; with one response per prompt
    there is no pass@k."""
    a, b = (run(tiny_args, "--num-rollout", "1", "--eval-interval", "1", "--eval-prompt-data", "held",
                str(eval_file), "--output-dir", str(tmp_path / name)) for name in ("a", "b"))
    assert metrics(a)[0] == metrics(b)[0] and "eval/held/pass@1" not in metrics(a)[0]
    assert metrics(a)[1]["eval/held"] == metrics(b)[1]["eval/held"]


@pytest.mark.parametrize("extra, message", [
    (["--eval-interval", "2"], "--eval-interval needs --eval-prompt-data NAME PATH"),
    (["--eval-interval", "2", "--eval-prompt-data", "held"], "--eval-prompt-data takes NAME PATH pairs"),
    (["--eval-prompt-data", "held", "EVAL"], "--eval-prompt-data needs --eval-interval N"),
    (["--eval-interval", "1", "--eval-prompt-data", "a/b", "EVAL"], "the name 'a/b' must be letters"),
    (["--eval-interval", "1", "--eval-prompt-data", "x", "EVAL", "x", "EVAL"], "each set needs its own name"),
    (["--eval-interval", "-1", "--eval-prompt-data", "x", "EVAL"], "--eval-interval"),
    (["--eval-interval", "1", "--eval-prompt-data", "x", "/nonexistent/held.jsonl"], "/nonexistent/held.jsonl"),
])
def test_bad_evaluation_flags_are_one_error_line(tiny_args, eval_file, capsys, extra, message):
    extra = [str(eval_file) if x == "EVAL" else x for x in extra]
    assert main(tiny_args + extra) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and message in err and "Traceback" not in err, err


def test_a_resumed_run_keeps_its_step_0_evaluation_once(tmp_path):
    """metrics.jsonl's step-0 row (the evaluation before the first step) survives a resume after
    step K, and goes when the run starts over (it is made again)."""
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval/x": 0.1}, {"step": 1}, {"step": 2}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reconcile(path, 1)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 1]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reconcile(path, 0)
    assert path.read_text() == ""


def test_a_step_written_twice_is_kept_once_and_the_copy_set_aside(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1}, {"step": 2, "v": "first"}, {"step": 2, "v": "again"}, {"step": 3}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "moved 1 other line" in reconcile(path, 3)
    assert [json.loads(x) for x in path.read_text().splitlines()] == [rows[0], rows[1], rows[3]]
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl.dropped").read_text().splitlines()] == [rows[2]]


def test_the_report_draws_the_evaluation_curve(tiny_args, tmp_path, eval_file, capsys):
    out = run(tiny_args, "--num-rollout", "2", "--eval-interval", "1", "--eval-prompt-data", "held", str(eval_file),
              "--output-dir", str(tmp_path / "r"))
    assert main(["report", str(out)]) == 0
    assert (out / "report" / "eval.png").stat().st_size > 1000
    assert "Evaluation on held-out prompts" in (out / "report.html").read_text()


def test_pass_at_k_counts_prompts_with_any_rewarded_response():
    """A stand-in engine whose responses are fixed: prompt A gets one rewarded response of three, prompt
    B none, so pass@3 is 1/2 and the mean reward 1/6, the mean length 2; the seeds are the evaluation's own
    streams."""
    from miles.config import EvalConfig, SamplingParams
    from miles.data.prompts import PromptRecord
    from miles.rollout.engine import GenerationOutput
    from miles.rollout.evaluation import EvalSet, Evaluator, eval_seed
    from miles.rollout.sampling import sample_seed
    from miles.testing.tiny import build_tokenizer

    seen = []

    class Engine:
        def generate(self, prompts, sampling, seeds, progress=None):
            seen.extend(seeds)
            # response i: i % 3 tokens 9, then 8 (rewarded) for i == 1 or 7: lengths 1, 2, 3, 1, 2, 3
            return [GenerationOutput([9] * (i % 3) + [7 + (i == 1)], [-0.5] * (i % 3 + 1), "stop")
                    for i in range(len(prompts))]

    tok = build_tokenizer()
    records = [PromptRecord(prompt="A", label="x"), PromptRecord(prompt="B", label="y")]
    cfg = EvalConfig(interval=1, datasets=(("s", "unused"),), n_samples_per_prompt=3,
                     sampling=SamplingParams(max_new_tokens=4, temperature=1.0, top_p=1.0))
    evaluator = Evaluator(cfg, [EvalSet("s", records)], Engine(), tok, lambda s: float(s.tokens[-1] == 8),
                          apply_chat_template=False, seed=5)
    got = evaluator.evaluate(3)
    assert got["eval/s"] == pytest.approx(1 / 6) and got["eval/s/pass@3"] == 0.5
    assert got["eval/s/response_len"] == 2.0
    assert seen == [eval_seed(5, 3, j) for j in range(6)] and not set(seen) & {sample_seed(5, 3, j) for j in range(6)}


def test_the_bundled_task_evaluates_its_held_out_problems_unless_turned_off(tmp_path, monkeypatch):
    """No --prompt-data: the held-out arithmetic set is evaluated before the first step and after the
    last; --eval-interval 0 turns that off. (The demo model itself runs in tests/test_demo.py.)"""
    import argparse

    from miles.cli.train import resolve_data_args
    from miles.data.prompts import BUNDLED_EVAL

    def resolved(**flags):
        args = argparse.Namespace(prompt_data=None, input_key=None, label_key=None, apply_chat_template=None,
                                  rm_type=None, eval_prompt_data=None, eval_interval=None, num_rollout=6,
                                  load_debug_rollout_data=None, debug_train_only=False, async_rollout=False)
        vars(args).update(flags)
        resolve_data_args(args)
        return args.eval_prompt_data, args.eval_interval

    assert resolved() == (["arith_held_out", str(BUNDLED_EVAL)], 6)
    assert resolved(eval_interval=2) == (["arith_held_out", str(BUNDLED_EVAL)], 2)
    assert resolved(eval_interval=0) == (None, None)
    assert resolved(debug_train_only=True) == (None, None)
    assert resolved(prompt_data="x.jsonl") == (None, None)


def test_evaluation_and_custom_generation_go_through_servers(tiny_args, tmp_path, eval_file):
    """--rollout-backend sglang (miles serve, started by miles): the evaluation and a two-turn custom
    generation both run on the server."""
    out = run(tiny_args, "--num-rollout", "1", "--rollout-backend", "sglang", "--sglang-log-dir",
              str(tmp_path / "servers"), "--eval-interval", "1", "--eval-prompt-data", "held", str(eval_file),
              "--custom-generate-function-path", "miles.testing.generate:two_turns",
              "--save-debug-rollout-data", str(tmp_path / "d" / "{rollout_id}.pt"))
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1] and "eval/held" in rows[0] and "eval/held" in rows[1]
    samples = torch.load(tmp_path / "d" / "0.pt", weights_only=True)["samples"]
    assert all(0 in s["loss_mask"] for s in samples)


def test_evaluation_sees_the_weights_the_step_made(tiny_args, tmp_path, eval_file):
    """A large learning rate moves the greedy answers at once: the evaluation after step 1 differs from
    step 0's, so it ran on the weights synced after the step, not the engine's old ones."""
    out = run(tiny_args, "--num-rollout", "1", "--lr", "3e-2", "--eval-interval", "1", "--eval-prompt-data", "held",
              str(eval_file), "--output-dir", str(tmp_path / "r"))
    before, after = metrics(out)
    assert before["eval/held"] != after["eval/held"]
