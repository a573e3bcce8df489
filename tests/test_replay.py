"""Rollout or training? Rollout-only, train-only, capture and replay, inspect-rollout; every field of a
dump checked on replay; data rows' own types (timestamps, decimals, numpy) written as plain values."""

import base64
import contextlib
import datetime
import decimal
import enum
import gc
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from miles.bridge.rollout_dump import read_dump, samples_from_dump, save_rollout, validate_samples
from miles.bridge.types import Sample
from miles.cli.main import build_parser, main
from miles.errors import UsageError
from miles.rollout.replay import ReplaySource
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
    c = build_components(build_configs(args), data, reward_fn, vars(args), contextlib.ExitStack())
    gc.collect()
    models = [o for o in gc.get_objects() if isinstance(o, CausalLM) and id(o) not in before]
    assert c.trainer is None and c.engine is not None
    assert models == [c.engine.model]  # the engine's model is the only model in memory


def test_rollout_only_run_logs_and_saves_no_checkpoint(tiny_args, tmp_path):
    out = run(tiny_args, "--debug-rollout-only", *dump_args(tmp_path))
    log = (out / "train.log").read_text()
    assert ("--debug-rollout-only: no trainer or reference model built; "
            "weight sync and checkpoint saving are skipped" in log)
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
                 "not a readable rollout dump (not a file torch.save wrote: no zip header)")
    torch.save({"samples": [], "made_by": object}, tmp_path / "objects_0.pt")  # a pickled class: never loaded
    assert_error(replay(tiny_args, tmp_path / "objects_{rollout_id}.pt", "--num-rollout", "1"), "objects_0.pt",
                 "(Unsupported global: GLOBAL object was not an allowed global by default: objects a dump never holds)")


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
    r = subprocess.run([sys.executable, "-m", "miles", *tiny_args, "--debug-train-only"],
                       capture_output=True, text=True)
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
    r = replay(tiny_args, tmp_path / "slime_{rollout_id}.pt", "--num-rollout", "1",
               "--output-dir", str(tmp_path / "out"))
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
    # decoded with the dump's tokenizer
    assert "".join(t["text"] for t in one["response_tokens"]).startswith(s["response"][:3])

    assert main(["inspect-rollout", str(dumps / "data_0.pt"), "--sample", "2"]) == 0
    assert "pos   token      logp" in capsys.readouterr().out


def test_inspect_rollout_bad_input(dumps, tmp_path, capsys):
    assert main(["inspect-rollout", str(dumps / "data_0.pt"), "--sample", "99"]) == 2
    assert "--sample 99" in capsys.readouterr().err
    (tmp_path / "junk.pt").write_text("junk")
    assert main(["inspect-rollout", str(tmp_path / "junk.pt")]) == 2
    assert "not a readable rollout dump" in capsys.readouterr().err


# ---------------------------------------------------------------- every field of a dump is checked

VOCAB = 100  # the tiny tokenizer's vocabulary
NAN, INF = float("nan"), float("inf")


def good_samples(n_groups: int = 2, n: int = 2) -> list[Sample]:
    """n_groups groups of n samples that replay as they are: 3 prompt + 2 response tokens each."""
    return [Sample(group_index=i // n, index=i, prompt="What is 1 + 1?", tokens=[10, 11, 12, 13, 14], response="ab",
                   response_length=2, label="2", reward=float(i % 2), loss_mask=[1, 1],
                   rollout_log_probs=[-0.5, -1.5], weight_version=0) for i in range(n_groups * n)]


def write_dump(path, edit=None, samples=None, n: int = 2):
    """A dump of `samples` (default: good_samples()) at `path`, after `edit(payload)` if given."""
    save_rollout(str(path), 0, samples or good_samples(n=n), {"n_samples_per_prompt": n})
    if edit is not None:
        payload = torch.load(path, weights_only=True)
        edit(payload)
        torch.save(payload, path)
    return path


def at(i, **fields):
    return lambda d: d["samples"][i].update(fields)


def without(i, key):
    return lambda d: d["samples"][i].pop(key)


def header(**fields):
    return lambda d: d.update(fields)


def groups(*indices):
    return lambda d: [s.update(group_index=g) for s, g in zip(d["samples"], indices)]


def every(**fields):
    return lambda d: [s.update(fields) for s in d["samples"]]


def log_probs_on_first_only(d):
    for s in d["samples"][1:]:
        s["rollout_log_probs"] = None


def replace_sample(i, value):
    return lambda d: d["samples"].__setitem__(i, value)


# (id, edit, what the error names, kind): "type" is an error for replay and inspect-rollout alike,
# "value" an error for replay and a warning for inspect-rollout, "vocab" needs the model's vocabulary.
FIELD_CASES = [
    ("format", header(format="slime/2"), "'format' is 'slime/2' (str), not 'miles.rollout/1'", "type"),
    ("format-none", header(format=None), "'format' is None (NoneType), not 'miles.rollout/1'", "type"),
    ("dump-metadata", header(metadata=[1]), "'metadata' is [1] (list), not a dict", "type"),
    ("rollout_id", header(rollout_id="0"), "'rollout_id' is '0' (str), not an int", "type"),
    ("rollout_id-tensor", header(rollout_id=torch.zeros(2, 2)), "'rollout_id' is tensor([[0., 0.], [0., 0.]]) "
                                                                "(Tensor), not an int", "type"),  # on one line
    ("sample", replace_sample(1, [1]), "sample 1 is [1] (list), not a dict", "type"),
    ("tokens-missing", without(1, "tokens"), "sample 1: 'tokens' is missing", "type"),
    ("tokens-type", at(1, tokens="abcde"), "sample 1: 'tokens' is 'abcde' (str), not a list of ints", "type"),
    ("tokens-float", at(1, tokens=[10, 11, 12.0, 13, 14]), "sample 1: 'tokens' holds 12.0 (float); expected a "
                                                           "list of ints", "type"),
    ("tokens-bool", at(1, tokens=[10, True, 12, 13, 14]), "sample 1: 'tokens' holds True (bool)", "type"),
    ("tokens-negative", at(1, tokens=[10, -1, 12, 13, 14]), "sample 1: 'tokens' holds token id -1; token ids are "
                                                            ">= 0", "type"),
    ("tokens-vocab", at(1, tokens=[10, 11, 12, 13, VOCAB]), "sample 1: token id 100 is outside the model's "
                                                            "vocabulary (100 tokens)", "vocab"),
    ("response_length-zero", at(1, response_length=0), "sample 1: 'response_length' is 0 but the sample has 5 "
                                                       "tokens; it must be in 1..5", "type"),
    ("response_length-long", at(1, response_length=6), "sample 1: 'response_length' is 6 but the sample has 5 "
                                                       "tokens", "type"),
    ("response_length-type", at(1, response_length=2.0), "sample 1: 'response_length' is 2.0 (float), not an int",
     "type"),
    ("loss_mask-length", at(1, loss_mask=[1]), "sample 1: 'loss_mask' has 1 value but response_length is 2", "value"),
    ("loss_mask-empty", at(1, loss_mask=[]), "sample 1: 'loss_mask' has 0 values but response_length is 2", "value"),
    ("loss_mask-value", at(1, loss_mask=[1, 2]), "sample 1: 'loss_mask' holds 2; its values are 0 or 1", "value"),
    ("loss_mask-type", at(1, loss_mask=["1", "1"]), "sample 1: 'loss_mask' holds '1' (str); expected a list of 0/1 "
                                                    "values", "type"),
    ("log_probs-length", at(1, rollout_log_probs=[-0.5]), "sample 1: 'rollout_log_probs' has 1 value but "
                                                          "response_length is 2", "value"),
    ("log_probs-nan", at(1, rollout_log_probs=[-0.5, NAN]), "sample 1: 'rollout_log_probs' holds nan; log-probs "
                                                            "are finite (in float32) and <= 0", "value"),
    ("log_probs-inf", at(1, rollout_log_probs=[-INF, -0.5]), "sample 1: 'rollout_log_probs' holds -inf", "value"),
    ("log_probs-positive", at(1, rollout_log_probs=[-0.5, 0.5]), "sample 1: 'rollout_log_probs' holds 0.5", "value"),
    ("log_probs-type", at(1, rollout_log_probs=["x", -1.0]), "sample 1: 'rollout_log_probs' holds 'x' (str); "
                                                             "expected a list of floats", "type"),
    ("log_probs-huge", at(1, rollout_log_probs=[-(10**400), -1.0]), "sample 1: 'rollout_log_probs' holds "
                                                                    "-1000", "type"),
    ("log_probs-missing-on-one", at(1, rollout_log_probs=[]), "sample 1: 'rollout_log_probs' is empty but 3 of 4 "
                                                              "samples have engine log-probs; every sample needs "
                                                              "them or none does", "value"),
    ("log_probs-on-one-only", log_probs_on_first_only, "sample 0: 'rollout_log_probs' has values but 3 of 4 samples "
                                                       "have none", "value"),
    ("reward-missing", at(1, reward=None), "sample 1: 'reward' is missing", "type"),
    ("reward-type", at(1, reward="1"), "sample 1: 'reward' is '1' (str), not a number", "type"),
    ("reward-bool", at(1, reward=True), "sample 1: 'reward' is True (bool), not a number", "type"),
    ("reward-huge", at(1, reward=10**400), "too large for a float", "type"),
    ("reward-float32", at(1, reward=1e39), "sample 1: 'reward' is 1e+39; rewards are finite numbers (in float32)",
     "value"),
    ("log_probs-float32", at(1, rollout_log_probs=[-1e39, -0.5]), "sample 1: 'rollout_log_probs' holds -1e+39",
     "value"),
    ("reward-nan", at(1, reward=NAN), "sample 1: 'reward' is nan; rewards are finite numbers", "value"),
    ("reward-inf", at(1, reward=INF), "sample 1: 'reward' is inf; rewards are finite numbers", "value"),
    ("reward-dict", at(1, reward={"a": 1.0, "b": 2.0}), "sample 1: 'reward' is a dict with keys ['a', 'b']; miles "
                                                        "needs one number", "type"),
    ("status-value", at(1, status="pending"), "sample 1: 'status' is 'pending'; expected one of completed, truncated, "
                                              "aborted", "value"),
    ("status-type", at(1, status=3), "sample 1: 'status' is 3 (int), not a string", "type"),
    ("group_index-type", at(1, group_index="0"), "sample 1: 'group_index' is '0' (str), not an int", "type"),
    ("group_index-split", at(1, group_index=1), "sample 1: 'group_index' is 1 but sample 0, in the same group of "
                                                "rows 0..1 (2 samples per prompt), has 0", "value"),
    ("group_index-reused", groups(0, 0, 0, 0), "sample 2: 'group_index' 0 is also the group of rows 0..1", "value"),
    ("index-type", at(1, index=1.5), "sample 1: 'index' is 1.5 (float), not an int", "type"),
    ("prompt-type", at(1, prompt=5), "sample 1: 'prompt' is 5 (int); expected text or a list of chat messages",
     "type"),
    ("prompt-messages", at(1, prompt=["hi"]), "sample 1: 'prompt' is ['hi'] (list); expected text or a list of chat "
                                              "messages", "type"),
    ("response-type", at(1, response=[1]), "sample 1: 'response' is [1] (list), not a string", "type"),
    ("sample-metadata", at(1, metadata="x"), "sample 1: 'metadata' is 'x' (str), not a dict", "type"),
]

# Edits a dump may have and still replay.
ACCEPTED = [
    ("slime-no-format", lambda d: d.pop("format")),
    ("slime-reward-dict", at(1, reward={"score": 1.0, "note": "ok"})),
    ("slime-nones", every(group_index=None, loss_mask=None, rollout_log_probs=None, status=None, prompt=None,
                          response=None, metadata=None)),
    ("chat-messages", at(1, prompt=[{"role": "user", "content": "hi"}])),
    ("log-prob-rounding", at(1, rollout_log_probs=[-0.5, 1e-6])),
    ("bool-loss-mask", at(1, loss_mask=[True, False])),
    ("structured-label", at(1, label={"answer": [1, 2], "note": None})),
    ("global-group-ids", groups(7, 7, 3, 3)),
    ("tensor-fields", at(1, tokens=torch.tensor([10, 11, 12, 13, 14]), rollout_log_probs=torch.tensor([-0.5, -1.0]))),
    ("tuple-tokens", at(1, tokens=(10, 11, 12, 13, 14))),
]


def replay_source(tmp_path, **overrides) -> ReplaySource:
    kwargs = dict(vocab_size=VOCAB, rollout_batch_size=2, n_samples_per_prompt=2, needs_log_probs=False) | overrides
    return ReplaySource(str(tmp_path / "d_{rollout_id}.pt"), **kwargs)


@pytest.mark.parametrize("name, edit, fragment, kind", FIELD_CASES, ids=[c[0] for c in FIELD_CASES])
def test_replay_checks_every_field(tmp_path, name, edit, fragment, kind):
    path = write_dump(tmp_path / "d_0.pt", edit)
    with pytest.raises(UsageError) as e:
        replay_source(tmp_path).generate(0)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and fragment in msg and "\n" not in msg, msg


@pytest.mark.parametrize("name, edit", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_replay_accepts(tmp_path, name, edit):
    write_dump(tmp_path / "d_0.pt", edit)
    batch = replay_source(tmp_path).generate(0)
    assert len(batch.samples) == 4 and all(len(s.loss_mask) == s.response_length for s in batch.samples)


def test_replay_names_the_first_problem_and_counts_the_rest(tmp_path):
    path = write_dump(tmp_path / "d_0.pt", every(rollout_log_probs=[-0.5]))
    with pytest.raises(UsageError) as e:
        replay_source(tmp_path).generate(0)
    assert str(e.value) == (f"{path}: sample 0: 'rollout_log_probs' has 1 value but response_length is 2 (and 3 more "
                            f"problems; `miles inspect-rollout {path}` lists them)")


def test_replay_groups_follow_n_samples_per_prompt(tmp_path):
    """Four samples of one prompt are two groups of two with --n-samples-per-prompt 2: refused."""
    write_dump(tmp_path / "d_0.pt", samples=good_samples(n_groups=1, n=4), n=4)
    assert replay_source(tmp_path, rollout_batch_size=1, n_samples_per_prompt=4).generate(0)
    with pytest.raises(UsageError, match="sample 2: 'group_index' 0 is also the group of rows 0..1"):
        replay_source(tmp_path).generate(0)


def test_replay_refuses_a_sample_without_engine_log_probs(tiny_args, dumps, tmp_path):
    """One sample without log-probs once made the trainer drop the whole batch's, silently."""
    dump = torch.load(dumps / "data_0.pt", weights_only=True)
    dump["samples"][5]["rollout_log_probs"] = []
    torch.save(dump, tmp_path / "cut_0.pt")
    assert_error(replay(tiny_args, tmp_path / "cut_{rollout_id}.pt", "--num-rollout", "1"),
                 "cut_0.pt: sample 5: 'rollout_log_probs' is empty but 15 of 16 samples have engine log-probs")


def test_replay_refuses_broken_groups(tiny_args, dumps, tmp_path):
    dump = torch.load(dumps / "data_0.pt", weights_only=True)
    dump["samples"][4], dump["samples"][8] = dump["samples"][8], dump["samples"][4]  # a shuffled dump
    torch.save(dump, tmp_path / "mixed_0.pt")
    assert_error(replay(tiny_args, tmp_path / "mixed_{rollout_id}.pt", "--num-rollout", "1"),
                 "mixed_0.pt: sample 5: 'group_index' is 1 but sample 4", "has 2")


# ---------------------------------------------------------------- data rows' own types in a dump


class Color(enum.Enum):
    RED = "red"


class Name(str):
    """A str subclass: pickled as this class, which weights_only=True refuses to load."""


def test_dump_converts_metadata_to_plain_types(tmp_path):
    """What parquet, pandas or numpy put in a row loads again with weights_only=True, as plain values."""
    when = datetime.datetime(2024, 5, 6, 7, 8, 9, 123456)
    odd = {"ts": when, "tz": datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc),
           "day": datetime.date(2024, 5, 6), "clock": datetime.time(7, 8), "took": datetime.timedelta(minutes=1.5),
           "price": decimal.Decimal("19.990"), "f64": np.float64(0.25), "i32": np.int32(-3), "flag": np.bool_(True),
           "arr": np.arange(4).reshape(2, 2), "when64": np.array(["2024-05-06T07:08"], dtype="datetime64[ns]"),
           "blob": b"\x00\xffmiles", "tags": {"b", "a"}, "mixed": {1, "x"}, "pair": (1, (2, 3)), "color": Color.RED,
           "np_str": np.str_("s"), "name": Name("n"), "path": Path("/data/x"), (1, 2): "tuple key", 3: "int key"}
    samples = good_samples()
    samples[1].metadata, samples[1].label = dict(odd), decimal.Decimal("2.50")
    samples[2].prompt = [{"role": "user", "content": "hi", "sent": when}]
    path = save_rollout(str(tmp_path / "d_{rollout_id}.pt"), 0, samples, {"captured": when, "n_samples_per_prompt": 2})

    dump = torch.load(path, weights_only=True)
    assert dump["metadata"] == {"captured": "2024-05-06T07:08:09.123456", "n_samples_per_prompt": 2}
    assert dump["samples"][1]["label"] == "2.50"  # Decimal: its exact digits
    assert dump["samples"][2]["prompt"] == [{"role": "user", "content": "hi", "sent": "2024-05-06T07:08:09.123456"}]
    assert dump["samples"][1]["metadata"] == {
        "ts": "2024-05-06T07:08:09.123456", "tz": "2024-01-01T00:00:00+00:00", "day": "2024-05-06", "clock": "07:08:00",
        "took": 90.0, "price": "19.990", "f64": 0.25, "i32": -3, "flag": True, "arr": [[0, 1], [2, 3]],
        "when64": ["2024-05-06T07:08:00.000000000"], "blob": base64.b64encode(b"\x00\xffmiles").decode(),
        "tags": ["a", "b"], "mixed": ["x", 1], "pair": [1, [2, 3]],
        "color": "red", "np_str": "s", "name": "n", "path": "/data/x", "[1, 2]": "tuple key", 3: "int key"}
    meta = dump["samples"][1]["metadata"]
    assert all(type(v) in (str, int, float, bool, list) for v in meta.values())
    assert type(meta["np_str"]) is str and type(meta["name"]) is str and type(meta["f64"]) is float
    assert samples[1].metadata == odd  # the Samples themselves are left as they were
    assert validate_samples(samples_from_dump(read_dump(path), path, 2), path, 2) == []


def test_parquet_with_timestamps_and_decimals_is_captured(tiny_args, tmp_path):
    """A parquet file's timestamp, decimal and binary columns go through a run into its dump."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [(a, b) for a in range(1, 3) for b in range(1, 3)]
    table = pa.table({
        "prompt": [f"What is {a} + {b}?" for a, b in rows], "label": [str(a + b) for a, b in rows],
        "created": pa.array([datetime.datetime(2024, 1, d, 12) for d in range(1, 5)], pa.timestamp("us")),
        "created_ns": pa.array([1_700_000_000_000_000_001 + d for d in range(4)], pa.timestamp("ns", tz="UTC")),
        "price": pa.array([decimal.Decimal(f"{d}.10") for d in range(4)], pa.decimal128(6, 2)),
        "raw": pa.array([b"\x00\x01"] * 4, pa.binary()),
    })
    pq.write_table(table, tmp_path / "prompts.parquet")
    run(tiny_args, "--prompt-data", str(tmp_path / "prompts.parquet"), "--num-rollout", "1", *dump_args(tmp_path))
    dump = torch.load(tmp_path / "dumps" / "data_0.pt", weights_only=True)
    meta = dump["samples"][0]["metadata"]
    assert meta == {"created": "2024-01-01T12:00:00", "created_ns": "2023-11-14 22:13:20.000000001Z", "price": "0.10",
                    "raw": "AAE="}
    assert main(["inspect-rollout", str(tmp_path / "dumps" / "data_0.pt")]) == 0
