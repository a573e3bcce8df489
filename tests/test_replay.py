"""Rollout or training? Rollout-only, train-only, capture and replay, inspect-rollout."""

import gc
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from miles.cli.main import build_parser, main
from test_train import metrics, run


def dump_args(tmp_path, name="dumps"):
    return ["--save-debug-rollout-data", str(tmp_path / name / "data_{rollout_id}.pt")]


def test_rollout_only_builds_no_trainer(tiny_args, tmp_path):
    from transformers import GenerationMixin as CausalLM  # top-level LMs, not their inner base models

    from miles.cli.train import prepare
    from miles.config import build_configs
    from miles.loop import build_components

    args = build_parser().parse_args(tiny_args + ["--debug-rollout-only"])
    data, reward_fn = prepare(args)
    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, CausalLM)}
    c = build_components(build_configs(args), data, reward_fn)
    gc.collect()
    models = [o for o in gc.get_objects() if isinstance(o, CausalLM) and id(o) not in before]
    assert c.trainer is None and c.engine is not None
    assert models == [c.engine.model]  # the engine's model is the only model in memory


def test_rollout_only_run_logs_and_saves_no_checkpoint(tiny_args, tmp_path):
    out = run(tiny_args, "--debug-rollout-only", *dump_args(tmp_path))
    log = (out / "train.log").read_text()
    assert "--debug-rollout-only: no trainer or reference model built; weight sync and checkpoint saving are skipped" in log
    assert "Models in memory: engine " in log and "policy" not in log.split("Models in memory:")[1].splitlines()[0]
    assert "weight_sync" not in log
    assert not (out / "checkpoints").exists()
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and "train/loss" not in rows[0]
    assert "rollout/reward_mean" in rows[0] and "rollout/rollout_log_probs" in rows[0]
    assert sorted(p.name for p in (tmp_path / "dumps").iterdir()) == ["data_0.pt", "data_1.pt"]


def test_dump_format(tiny_args, tmp_path, tiny_model):
    run(tiny_args, "--num-rollout", "2", *dump_args(tmp_path))
    # weight_version: the optimizer steps behind the weights that generated the sample.
    versions = [{s["weight_version"] for s in torch.load(tmp_path / "dumps" / f"data_{i}.pt",
                                                         weights_only=True)["samples"]} for i in (0, 1)]
    assert versions == [{0}, {1}]
    dump = torch.load(tmp_path / "dumps" / "data_0.pt", weights_only=True)
    assert dump["format"] == "miles.rollout/1" and dump["rollout_id"] == 0
    assert len(dump["samples"]) == 16
    s = dump["samples"][5]
    for key in ("group_index", "index", "prompt", "tokens", "response", "response_length", "label", "reward",
                "loss_mask", "rollout_log_probs", "status", "weight_version", "metadata"):
        assert key in s, key
    assert s["index"] == 5 and s["group_index"] == 1
    assert len(s["loss_mask"]) == len(s["rollout_log_probs"]) == s["response_length"] > 0
    assert s["status"] in ("completed", "truncated")
    meta = dump["metadata"]
    assert meta["hf_checkpoint"] == str(tiny_model) and meta["seed"] == 42 and meta["temperature"] == 1.0
    assert meta["miles_version"] and meta["n_samples_per_prompt"] == 4 and meta["max_new_tokens"] == 12
    assert not list((tmp_path / "dumps").glob(".*"))  # no temp files left behind


def test_replay_reproduces_the_live_run_bitwise(tiny_args, tmp_path):
    live_dir = run(tiny_args, "--num-rollout", "3", *dump_args(tmp_path), "--output-dir", str(tmp_path / "live"))
    replay_dir = run(tiny_args, "--num-rollout", "3", "--load-debug-rollout-data",
                     str(tmp_path / "dumps" / "data_{rollout_id}.pt"), "--output-dir", str(tmp_path / "replay"))
    live, replay = metrics(live_dir), metrics(replay_dir)
    for key in ("train/loss", "train/grad_norm", "train/pg_clipfrac", "train/entropy", "rollout/reward_mean",
                "rollout/log_probs", "forward_logp_max_diff"):
        assert [r[key] for r in live] == [r[key] for r in replay], key
    a = load_file(live_dir / "checkpoints" / "step_3" / "model.safetensors")
    b = load_file(replay_dir / "checkpoints" / "step_3" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    log = (replay_dir / "train.log").read_text()
    assert "--debug-train-only is on" in log and "--debug-train-only: no rollout engine built" in log
    assert "weight_sync" not in log


def test_rollout_only_capture_matches_the_live_run(tiny_args, tmp_path):
    run(tiny_args, "--num-rollout", "1", *dump_args(tmp_path, "live"), "--output-dir", str(tmp_path / "a"))
    run(tiny_args, "--num-rollout", "1", "--debug-rollout-only", *dump_args(tmp_path, "only"),
        "--output-dir", str(tmp_path / "b"))
    live = torch.load(tmp_path / "live" / "data_0.pt", weights_only=True)["samples"]
    only = torch.load(tmp_path / "only" / "data_0.pt", weights_only=True)["samples"]
    assert [s["tokens"] for s in live] == [s["tokens"] for s in only]
    assert [s["rollout_log_probs"] for s in live] == [s["rollout_log_probs"] for s in only]


@pytest.fixture
def dumps(tiny_args, tmp_path_factory):
    d = tmp_path_factory.mktemp("captured")
    run(tiny_args, "--num-rollout", "2", "--debug-rollout-only", "--save-debug-rollout-data",
        str(d / "data_{rollout_id}.pt"), "--output-dir", str(d / "run"))
    return d


def replay(tiny_args, template, *extra):
    argv = tiny_args + ["--load-debug-rollout-data", str(template), *extra]
    return subprocess.run([sys.executable, "-m", "miles", *argv], capture_output=True, text=True)


def assert_error(result, *fragments):
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "Traceback" not in result.stderr
    for f in fragments:
        assert f in last, last


def test_replay_missing_file_for_an_id(tiny_args, dumps):
    assert_error(replay(tiny_args, dumps / "data_{rollout_id}.pt", "--num-rollout", "3"),
                 "no dump for rollout 2", "data_2.pt", "--debug-rollout-only --save-debug-rollout-data")


def test_replay_rejects_non_dumps(tiny_args, tmp_path):
    torch.save([1, 2, 3], tmp_path / "list_0.pt")
    assert_error(replay(tiny_args, tmp_path / "list_{rollout_id}.pt", "--num-rollout", "1"), "list_0.pt",
                 "not a rollout dump")
    (tmp_path / "text_0.pt").write_text("hello")
    assert_error(replay(tiny_args, tmp_path / "text_{rollout_id}.pt", "--num-rollout", "1"), "text_0.pt",
                 "not a readable rollout dump")


def test_replay_rejects_truncated_dump(tiny_args, dumps, tmp_path):
    data = (dumps / "data_0.pt").read_bytes()
    (tmp_path / "cut_0.pt").write_bytes(data[: len(data) // 2])
    assert_error(replay(tiny_args, tmp_path / "cut_{rollout_id}.pt", "--num-rollout", "1"), "cut_0.pt",
                 "not a readable rollout dump")


def test_replay_rejects_tokens_outside_the_vocabulary(tiny_args, dumps, tmp_path):
    dump = torch.load(dumps / "data_0.pt", weights_only=True)
    dump["samples"][3]["tokens"][-1] = 50_000  # as if made by a model with a bigger vocabulary
    torch.save(dump, tmp_path / "other_0.pt")
    assert_error(replay(tiny_args, tmp_path / "other_{rollout_id}.pt", "--num-rollout", "1"), "other_0.pt",
                 "token id 50000", "vocabulary", "--hf-checkpoint")


def test_replay_rejects_a_sample_count_that_does_not_fit(tiny_args, dumps):
    assert_error(replay(tiny_args, dumps / "data_{rollout_id}.pt", "--num-rollout", "1", "--rollout-batch-size", "2"),
                 "holds 16 samples", "is 8")


def test_train_only_without_dumps_is_a_usage_error(tiny_args):
    r = subprocess.run([sys.executable, "-m", "miles", *tiny_args, "--debug-train-only"], capture_output=True, text=True)
    assert_error(r, "--debug-train-only", "--load-debug-rollout-data")


def test_rollout_only_with_train_only_is_a_usage_error(tiny_args, dumps):
    assert_error(replay(tiny_args, dumps / "data_{rollout_id}.pt", "--debug-rollout-only"),
                 "--debug-rollout-only and --debug-train-only")


def test_template_without_rollout_id_is_a_usage_error(tiny_args, tmp_path):
    r = subprocess.run([sys.executable, "-m", "miles", *tiny_args, "--save-debug-rollout-data", str(tmp_path / "x.pt")],
                       capture_output=True, text=True)
    assert_error(r, "--save-debug-rollout-data", "{rollout_id}")


def test_slime_style_dump_replays(tiny_args, dumps, tmp_path):
    """A slime `Sample.to_dict()` dump: extra fields, None masks/log-probs/groups, a reward dict."""
    ours = torch.load(dumps / "data_0.pt", weights_only=True)["samples"]
    slime = []
    for s in ours:
        slime.append({"group_index": None, "index": s["index"], "prompt": s["prompt"], "tokens": s["tokens"],
                      "multimodal_inputs": None, "response": s["response"], "response_length": s["response_length"],
                      "label": s["label"], "reward": {"score": s["reward"]}, "loss_mask": None,
                      "weight_versions": [], "rollout_log_probs": None, "rollout_routed_experts": None,
                      "remove_sample": False, "status": "completed", "metadata": {}, "train_metadata": None})
    torch.save({"rollout_id": 0, "samples": slime}, tmp_path / "slime_0.pt")
    r = replay(tiny_args, tmp_path / "slime_{rollout_id}.pt", "--num-rollout", "1", "--output-dir", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr[-2000:]
    row = metrics(tmp_path / "out")[0]
    assert row["train/grad_norm"] > 0
    assert "forward_logp_max_diff" not in row  # the dump has no engine log-probs to compare with
    assert_error(replay(tiny_args, tmp_path / "slime_{rollout_id}.pt", "--num-rollout", "1", "--use-tis"),
                 "--use-tis", "rollout_log_probs")


def test_print_every(tiny_args):
    out = run(tiny_args, "--num-rollout", "3", "--debug-rollout-print-every", "2", "--alignment-check", "off")
    log = (out / "train.log").read_text()
    assert "rollout 0: 16 samples" in log and "rollout 2: 16 samples" in log and "rollout 1: 16" not in log
    assert log.count("      prompt:   What is") == 32 and "| mean logp -" in log and "      response: " in log


def test_inspect_rollout(dumps, capsys):
    assert main(["inspect-rollout", str(dumps / "data_0.pt")]) == 0
    text = capsys.readouterr().out
    assert "samples 16 in 4 groups" in text and "groups with mixed rewards" in text and "engine logp/token" in text

    assert main(["inspect-rollout", str(dumps / "data_0.pt"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    dump = torch.load(dumps / "data_0.pt", weights_only=True)
    rewards = [s["reward"] for s in dump["samples"]]
    assert report["summary"]["samples"] == 16
    assert report["summary"]["reward_mean"] == pytest.approx(sum(rewards) / 16)
    assert [r["response_len"] for r in report["samples"]] == [s["response_length"] for s in dump["samples"]]

    assert main(["inspect-rollout", str(dumps / "data_0.pt"), "--sample", "2", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    s = dump["samples"][2]
    assert [t["logp"] for t in one["response_tokens"]] == s["rollout_log_probs"]
    assert "".join(t["text"] for t in one["response_tokens"]).startswith(s["response"][:3])  # decoded with the dump's tokenizer

    assert main(["inspect-rollout", str(dumps / "data_0.pt"), "--sample", "2"]) == 0
    assert "pos   token      logp" in capsys.readouterr().out


def test_inspect_rollout_bad_input(dumps, tmp_path, capsys):
    assert main(["inspect-rollout", str(dumps / "data_0.pt"), "--sample", "99"]) == 2
    assert "--sample 99" in capsys.readouterr().err
    (tmp_path / "junk.pt").write_text("junk")
    assert main(["inspect-rollout", str(tmp_path / "junk.pt")]) == 2
    assert "not a readable rollout dump" in capsys.readouterr().err
