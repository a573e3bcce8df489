"""`miles doctor`: every culprit of the debugging guide diagnosed from realistic logs, no false alarm on a
clean run, `--json`, `--bundle` (content and redaction), and bad input.

Fixtures under tests/fixtures/doctor/ are the text each component really prints: miles run dirs, SGLang's
scheduler traceback, NCCL's watchdog, a Ray session's worker logs, slime/Megatron, verl and TRL stdout.
The miles run dirs of the symptom cases are log excerpts with no `Done:` line: by the run-state contract
they are killed runs, so their first finding is `run_killed` and the symptom comes right after it.
"""

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from miles.cli.main import main
from miles.debug.doctor.crashes import SIGNATURES

FIX = Path(__file__).parent / "fixtures" / "doctor"


def doctor(capsys, *args):
    rc = main(["doctor", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


def findings(capsys, *paths):
    rc, out, _ = doctor(capsys, *paths, "--json")
    return rc, json.loads(out)


FATES = {"run_crashed", "run_error", "run_signal", "run_nonfinite", "run_killed"}  # how a run ended


def symptoms(report):
    """The findings after the run-state ones."""
    return [f for f in report["findings"] if f["id"] not in FATES]


# (fixture, id of the first finding, words of its symptom, words of its fix)
CASES = [
    ("no_checkpoint", "no_checkpoint_loaded", "parameters did not load", "--hf-checkpoint / --load / --ref-load"),
    ("megatron_random_init.log", "no_checkpoint_loaded", "random weights", "--load / --ref-load"),
    ("kl_nondet", "kl_step1", "KL != 0 at step 1", "--attention-backend flash"),
    ("slime_kl_config.log", "kl_step1", "KL > 1", "--ref-load at the initial policy"),
    ("instruct_logp", "instruct_logp", "on an instruct model", "--apply-chat-template"),
    ("verl_moe_collapse.log", "moe_collapse", "MoE training collapse", "--use-rollout-routing-replay"),
    ("nan_grad", "nan_grad", "NaN/Inf gradients", "`miles verify-chat-template"),
    ("megatron_fp8_nan.log", "nan_grad", "NaN/Inf gradients", "turn FP8 off"),
    ("sglang_illegal_memory", "illegal_memory_access", "`illegal memory access` in the SGLang engine",
     "lower --sglang-mem-fraction-static"),
    ("oom_colocate", "oom_colocate_step2", "OOM at step 2 in colocate mode",
     "--sglang-mem-fraction-static 0.7 (or 0.6)"),
    ("inductor_json.log", "inductor_cache", "`JSONDecodeError` from torch inductor",
     "TORCHINDUCTOR_FORCE_DISABLE_CACHES=1"),
    ("ray_nccl_weight_sync", "nccl_timeout", "NCCL hang / timeout during weight sync", "NCCL_TIMEOUT=900"),
    ("rewards_zero", "reward_constant", "their reward is 0", "--label-key"),
    ("trl_rewards_zero.log", "reward_constant", "rewards all zero over 3 steps", "--label-key"),
    ("verl_nan_reward.log", "reward_nonfinite", "non-finite rewards (NaN/Inf) at step 3, 4",
     "return a finite number for every response"),
    ("ray_worker_crashed", "worker_crashed", "a Ray worker died (pid 48213", "RAY_DEDUP_LOGS=0"),
    ("weight_sync_fail", "weight_sync_mismatch", "engine weights differ from the trainer's", "miles check-weights"),
]


@pytest.mark.parametrize("fixture,fid,symptom,fix", CASES, ids=[c[0] for c in CASES])
def test_each_culprit_is_named_first(capsys, fixture, fid, symptom, fix):
    rc, report = findings(capsys, FIX / fixture)
    assert rc == 1
    top = symptoms(report)[0]
    assert (top["id"], symptom in top["symptom"], fix in top["fix"]) == (fid, True, True), top


def test_an_illegal_memory_access_names_an_engines_oom_only_where_an_engine_is(capsys, tmp_path):
    """The guide's out-of-memory in disguise is an inference engine's (its static KV pool): an `illegal memory access`
    in a trainer's traceback with no engine in sight is reported as a kernel's fault, naming no culprit; the same
    traceback from a colocated run (an engine on the same GPU) names the out-of-memory."""
    trace = ("Traceback (most recent call last):\n  File \"train.py\", line 88, in <module>\n    loss.backward()\n"
             "  File \"transformer_engine/pytorch/module/linear.py\", line 412, in backward\n"
             "RuntimeError: CUDA error: an illegal memory access was encountered\n")
    log = tmp_path / "trainer.log"
    log.write_text("python train.py --fp8 --micro-batch-size 4\n" + trace)
    f = symptoms(findings(capsys, log)[1])[0]
    assert (f["id"], f["culprit_id"]) == ("cuda_illegal_memory_access", None), f
    assert "CUDA_LAUNCH_BLOCKING=1" in f["fix"]
    log.write_text("python train.py --fp8 --micro-batch-size 4 --colocate\n" + trace)
    f = symptoms(findings(capsys, log)[1])[0]
    assert (f["id"], f["culprit_id"]) == ("illegal_memory_access", "oom_disguised"), f


def test_an_api_missing_between_versioned_packages_names_the_version_pair(capsys, tmp_path):
    """`cannot import name` / `unexpected keyword argument` raised between packages, in a report giving their
    versions, names incompatible versions, with the versions read; the same error without versions (as often a
    user's own code) and a package not installed (`No module named`) do not."""
    report = tmp_path / "report.md"
    report.write_text("GRPO run fails at import after upgrading. TRL 0.25.0, vLLM 0.12.0, torch 2.9.0.\n\n```\n"
                      "Traceback (most recent call last):\n  File \"train.py\", line 3, in <module>\n"
                      "ImportError: cannot import name 'GuidedDecodingParams' from 'vllm.sampling_params'\n```\n")
    f = symptoms(findings(capsys, report)[1])[0]
    assert (f["id"], f["culprit_id"]) == ("api_mismatch", "version_incompat"), f
    assert "vllm 0.12.0" in f["symptom"] and "GuidedDecodingParams" in f["evidence"][0]["text"], f
    report.write_text("verl 0.7.0 with vllm 0.12.0: starting training, vllm_rollout.py can not import "
                      "ExecuteModelRequest from vllm.sequence.\n")  # in the reporter's words
    assert symptoms(findings(capsys, report)[1])[0]["id"] == "api_mismatch"
    report.write_text("Building the trainer fails:\n\n```\nTypeError: GRPOTrainer.__init__() got an unexpected "
                      "keyword argument 'reward_function'\n```\n")
    assert "api_mismatch" not in [f["id"] for f in findings(capsys, report)[1]["findings"]]
    report.write_text("slime 0.2.1 with torch 2.7.1 fails at start:\n\n```\nModuleNotFoundError: No module named "
                      "'mbridge'\n```\n")
    assert "api_mismatch" not in [f["id"] for f in findings(capsys, report)[1]["findings"]]


def test_nan_gradients_after_weights_newly_initialized_name_the_load(capsys, tmp_path):
    """NaN gradients after transformers' warning that the checkpoint lacked weights (newly initialized): the
    parameters not loaded are named, not the chat template (the guide's row, still named without the warning)."""
    report = tmp_path / "report.md"
    train = "```\n{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 6e-06, 'epoch': 0.01}\n```\n"
    report.write_text("Loaded my merged model to continue training:\n\n```\nSome weights of Gemma2ForCausalLM were "
                      "not initialized from the model checkpoint at ./merged and are newly initialized: "
                      "['lm_head.weight']\n```\n" + train)
    f = symptoms(findings(capsys, report)[1])[0]
    assert (f["id"], f["culprit_id"]) == ("nan_grad", "params_not_loaded"), f
    assert "newly initialized" in f["evidence"][0]["text"]
    report.write_text("Training a merged model:\n\n" + train)
    f = symptoms(findings(capsys, report)[1])[0]
    assert (f["id"], f["culprit_id"]) == ("nan_grad", "chat_template"), f


@pytest.mark.parametrize("error,fid,culprit", [
    ("ValueError: The global train batch size (7 x 1) must be evenly divisible by the number of generations per "
     "prompt (8).", "batch_not_divisible", "loss_aggregation_config"),
    ("AssertionError: only support equal chunk. Got size of DataProto 2 and chunk 4.", "batch_not_divisible",
     "loss_aggregation_config"),
    ("ValueError: Cannot use chat template functions because tokenizer.chat_template is not set and no template "
     "argument was passed!", "no_chat_template", "chat_template"),
    ("AssertionError: output_partition_size=48 not divisible by block_n=128", None, None),  # a shard's, not a batch
    ("openai.BadRequestError: This model's maximum context length is 4096 tokens. However, you requested 5120 tokens",
     "over_max_length", "max_length_truncation"),
    ("sglang.srt.utils.BadRequest: The input (5120 tokens) is longer than the model's context length (4096 tokens).",
     "over_max_length", "max_length_truncation"),
    ("AssertionError: hf_validate_args failed: rope_theta in hf config 10000000 is not equal to rotary_base 1000000",
     "rope_config_mismatch", "engine_trainer_kernel_mismatch"),
    ("KeyError: 'mtp.layers.0.mlp.experts.gate_up_proj'", "param_name_missing", "param_mapping"),
    ("KeyError: 'reward'", None, None),  # a key, not a parameter's name
    ("RuntimeError: Error(s) in loading state_dict for LlamaForCausalLM: size mismatch for model.embed_tokens.weight: "
     "copying a param with shape torch.Size([128260, 4096]) from checkpoint", "vocab_size_mismatch",
     "tokenizer_mismatch"),
    ("FileNotFoundError: [Errno 2] No such file or directory: '/root/.triton/cache/ab12/_fwd.ttir.tmp.pid_3188_1'",
     "compile_cache_race", "inductor_cache"),
    ("ValueError: Tokenizer class TokenizersBackend does not exist or is not currently imported.",
     "tokenizer_class_unknown", "version_incompat"),
], ids=["global batch", "equal chunk", "no template", "shard not divisible", "context length", "sglang length", "rope",
        "param key", "other key", "embed size", "cache tmp", "tokenizer class"])
def test_an_error_text_that_names_its_culprit(capsys, tmp_path, error, fid, culprit):
    """Error texts that name their culprit alone (crashes.SIGNATURES): batch sizes that do not divide are the batch
    arithmetic (the loss-aggregation culprit), a tokenizer with no template the chat template, a sequence over a
    length limit the limits, differing RoPE settings the engine/trainer mismatch, a parameter's name missing in a
    mapping the mapping, an embedding's size the vocabulary, a compile cache's vanished temporary file the cache, a
    tokenizer class the installed transformers lacks the versions."""
    report = tmp_path / "report.md"
    report.write_text(f"Training fails at start:\n\n```\n{error}\n```\n")
    named = [(f["id"], f["culprit_id"]) for f in findings(capsys, report)[1]["findings"]
             if f["id"] in {sig.id for sig in SIGNATURES}]
    assert named == ([(fid, culprit)] if fid else []), named


def test_nan_gradients_after_nan_rewards_name_the_reward(capsys, tmp_path):
    """NaN gradients downstream of NaN rewards or advantages: the reward is named first, not the chat template (the
    guide's row for NaN gradients), from a run's metrics and from a pasted report's words; a NaN elsewhere on a
    reward's log line (`reward 0.000 | loss nan`, the nan_grad fixture) is no NaN reward."""
    run = tmp_path / "run"
    shutil.copytree(FIX / "nan_grad", run)
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        if r["train/grad_norm"] == "nan":
            r["rollout/reward_mean"] = "nan"
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = tmp_path / "report.md"
    report.write_text("GRPO with three reward functions; one returns None when its API call fails. The run finishes "
                      "but the model does not improve, and the advantages are NaN for the whole batch.\n\n```\n"
                      "loss=0.0\ngrad_norm=NaN\n```\n")
    for path in (run, report):
        _, got = findings(capsys, path)
        top = symptoms(got)[0]
        assert (top["id"], top["culprit_id"]) == ("nan_grad", "reward_bug"), top
        assert "after non-finite rewards or advantages" in top["symptom"], top
    _, got = findings(capsys, FIX / "nan_grad")
    assert symptoms(got)[0]["culprit_id"] == "chat_template"
    assert top["likely_culprit"] and top["level"] in ("high", "medium")
    # Evidence quotes the real line: `file:N` holds exactly the text shown (secrets redacted).
    from miles.debug.doctor.bundle import redact

    for e in top["evidence"]:
        path, _, line = e["where"].rpartition(":")
        if line.isdigit() and Path(path).is_file() and not e["text"].startswith("step "):
            assert redact(Path(path).read_text().splitlines()[int(line) - 1].strip()[:300]) == e["text"]


def test_nccl_finding_quotes_the_watchdog_and_the_debug_knobs(capsys):
    _, report = findings(capsys, FIX / "ray_nccl_weight_sync")
    f = report["findings"][0]
    texts = " ".join(e["text"] for e in f["evidence"])
    assert "Watchdog caught collective operation timeout" in texts and "OpType=BROADCAST" in texts
    assert "update_weights_from_distributed" in texts  # the weight-sync context
    assert "NCCL_DEBUG=INFO" in f["fix"] and "NCCL_DEBUG_SUBSYS=COLL,P2P" in f["fix"]


def test_worker_crash_points_at_the_dead_workers_first_error_not_its_peers(capsys):
    _, report = findings(capsys, FIX / "ray_worker_crashed")
    assert [f["id"] for f in report["findings"]] == ["worker_crashed"]  # no Megatron "no checkpoint" noise
    f = report["findings"][0]
    assert "MegatronTrainRayActor" in f["symptom"] and "ip 10.0.0.12" in f["symptom"]
    assert "CUDA error: device-side assert triggered" in f["likely_culprit"]
    assert "-48213.err:4" in f["likely_culprit"] and "48214" not in f["likely_culprit"]


def test_megatron_nan_blames_fp8_when_fp8_is_on(capsys):
    _, report = findings(capsys, FIX / "megatron_fp8_nan.log")
    f = report["findings"][0]
    assert f["likely_culprit"].startswith("activation overflow in FP8")
    assert any("found NaN in local grad norm" in e["text"] for e in f["evidence"])


def test_miles_verdict_lines_are_surfaced_with_their_culprit(capsys):
    _, report = findings(capsys, FIX / "weight_sync_fail")
    ids = [f["id"] for f in report["findings"]]
    assert ids == ["run_killed", "weight_sync_mismatch", "train_engine_mismatch"]  # an excerpt: no `Done:` line
    align = report["findings"][2]
    assert align["symptom"].startswith("Alignment check FAIL: trainer vs engine")
    assert align["fix"] == "--check-weight-update-equal; `miles check-weights`; compare engine buffers"


def _write_dump(path: Path, responses: list[str], tokens: list[list[int]], reward: float = 0.0, label="72"):
    import torch

    samples = [{"group_index": i // 2, "index": i, "prompt": "Natalia sold clips...", "tokens": [1, 2, 3] + t,
                "response": r, "response_length": len(t), "label": label, "reward": reward, "loss_mask": [1] * len(t),
                "rollout_log_probs": [-0.09] * len(t), "status": "truncated", "metadata": {}}
               for i, (r, t) in enumerate(zip(responses, tokens))]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": "miles.rollout/1", "rollout_id": 0, "samples": samples,
                "metadata": {"n_samples_per_prompt": 2}}, path)


GARBLED = ["the the the the the \ufffd\ufffd the the the the", "\ufffd\ufffd the the the the the the the"] * 2
LOOPING = [[7, 8, 9, 10] * 8] * 4


def test_garbled_rollout_although_parameters_loaded(capsys, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIX / "garbled_loaded", run)
    _write_dump(run / "dumps" / "data_0.pt", GARBLED, LOOPING)
    rc, report = findings(capsys, run)
    top = symptoms(report)[0]
    assert rc == 1 and top["id"] == "garbled_rollout", top
    assert top["symptom"] == "garbled rollout although parameters loaded"
    assert "chat-template mismatch" in top["likely_culprit"] and "dropped buffers" in top["likely_culprit"]
    assert "miles verify-chat-template" in top["fix"] and "--check-weight-update-equal" in top["fix"]
    assert "U+FFFD" in top["evidence"][0]["text"]


def test_garbled_rollout_without_a_load_line_blames_loading(capsys, tmp_path):
    _write_dump(tmp_path / "dumps" / "data_0.pt", GARBLED, LOOPING)
    _, report = findings(capsys, tmp_path)
    top = report["findings"][0]
    assert top["id"] == "garbled_rollout" and "did not load" in top["likely_culprit"]


def test_engine_buffer_check_fail_is_a_finding(capsys, tmp_path):
    log = tmp_path / "train.log"
    log.write_text((FIX / "clean_run" / "train.log").read_text().replace(
        "2026-11-29 11:50:32 INFO step 1/3",
        "2026-11-29 11:50:32 ERROR weight_sync buffer check FAIL at step 1: model.rotary_emb.inv_freq: missing in the "
        "engine | likely culprit: the engine dropped or overwrote buffers while updating weights | fix: re-create the "
        "buffers after each weight update\n2026-11-29 11:50:32 INFO step 1/3", 1))
    _, report = findings(capsys, log)
    top = report["findings"][0]
    assert top["id"] == "engine_buffers_dropped" and top["fix"] == "re-create the buffers after each weight update"


def test_missing_weight_sync_in_a_miles_run_is_a_finding(capsys, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIX / "clean_run", run)
    log = run / "train.log"
    log.write_text("".join(line for line in log.read_text().splitlines(True) if "weight_sync" not in line))
    rc, out, _ = doctor(capsys, run)
    assert rc == 1 and "no `weight_sync` line although trainer and engine both ran" in out
    assert "missing `weight_sync` (expected here)" in out


ASYNC_LOG = """\
+ ray job submit -- python3 train_async.py --hf-checkpoint /root/Qwen3-4B --ref-load /root/Qwen3-4B_torch_dist
(MegatronTrainRayActor pid=5120)  successfully loaded checkpoint from /root/Qwen3-4B_torch_dist [ t 1/1, p 1/1 ]
(MegatronTrainRayActor pid=5120) [2025-06-17 10:03:12] INFO  model.py:427 - step 0: {'train/grad_norm': 0.201}
"""


def test_async_run_without_its_worker_phrase(capsys, tmp_path):
    """A slime or miles async run whose log lacks `Continuous async rollout worker started` gets a finding; with the
    phrase, none; another framework's async run is not expected to print it."""
    log = tmp_path / "async.log"
    log.write_text(ASYNC_LOG)
    rc, report = findings(capsys, log)
    assert [f["id"] for f in report["findings"]] == ["async_worker_missing"]
    sig = {s["phrase"]: s for s in report["signal_phrases"]}
    assert sig["Continuous async rollout worker started"]["expected"] is True
    assert sig["Continuous async rollout worker started"]["count"] == 0
    assert sig["Loaded checkpoint from"]["count"] == 1
    log.write_text(ASYNC_LOG + "(RolloutRayActor pid=5188) Continuous async rollout worker started\n")
    rc, report = findings(capsys, log)
    assert rc == 0 and report["findings"] == []
    # miles' own async flag expects it too; another framework's async mode, which never prints it, does not
    for text, expected in (("miles train --async --rollout-batch-size 8\n", True),
                           ("OpenRLHF async training with vLLM 0.16: the weight sync fails\n", False)):
        log.write_text(text)
        _, report = findings(capsys, log)
        sig = {s["phrase"]: s for s in report["signal_phrases"]}
        assert sig["Continuous async rollout worker started"]["expected"] is expected, text


# -- no false alarm ------------------------------------------------------------------------------------

def test_clean_run_fixture_gives_no_finding(capsys):
    rc, out, _ = doctor(capsys, FIX / "clean_run")
    assert rc == 0
    assert "no known symptom found" in out
    assert ("Signal phrases: found `Loaded checkpoint from` (3x), `weight_sync` (3x), `forward_logp_max_diff` (7x), "
            "`Alignment check` (8x)") in out
    assert "clean_run/train.log (miles-train, 33 lines)" in out


def test_live_tiny_run_gives_no_finding(capsys, tiny_args, tmp_path):
    dumps = str(tmp_path / "run" / "dumps" / "data_{rollout_id}.pt")
    # Temperature 0.5: the random tiny model's samples then pass miles' own response-NLL check.
    assert main(tiny_args + ["--use-kl-loss", "--kl-loss-coef", "0.1", "--save-debug-rollout-data", dumps,
                             "--check-weight-update-equal", "--debug-determinism", "--rollout-temperature", "0.5"]) == 0
    assert "WARN |" not in (tmp_path / "run" / "train.log").read_text()
    capsys.readouterr()
    rc, report = findings(capsys, tmp_path / "run")
    assert rc == 0 and report["findings"] == [], report["findings"]
    assert sum("rollout dump" in r for r in report["read"]) == 2
    assert any(r.endswith("hashes.jsonl (hashes, 2 rows)") for r in report["read"])
    found = {s["phrase"] for s in report["signal_phrases"] if s["count"]}
    assert found == {"Loaded checkpoint from", "weight_sync", "forward_logp_max_diff", "Alignment check"}


def test_rollout_only_then_replay_runs_give_no_finding(capsys, tiny_args, tmp_path):
    """The one-sided debug modes lack `weight_sync` (and more) by design: no false alarm."""
    dumps = str(tmp_path / "capture" / "dumps" / "data_{rollout_id}.pt")
    args = tiny_args + ["--rollout-temperature", "0.5"]
    assert main(args + ["--debug-rollout-only", "--save-debug-rollout-data", dumps,
                        "--output-dir", str(tmp_path / "capture")]) == 0
    assert main(args + ["--load-debug-rollout-data", dumps, "--output-dir", str(tmp_path / "replay")]) == 0
    capsys.readouterr()
    for run in ("capture", "replay"):
        rc, report = findings(capsys, tmp_path / run)
        assert rc == 0 and report["findings"] == [], (run, report["findings"])
        sig = {s["phrase"]: s for s in report["signal_phrases"]}
        assert sig["weight_sync"]["count"] == 0 and sig["weight_sync"]["expected"] is False


def test_nothing_matches_says_so_and_lists_what_was_read(capsys):
    rc, out, _ = doctor(capsys, FIX / "plain_stdout.txt")
    assert rc == 0
    assert out.startswith("miles doctor: no known symptom found in what was read.")
    assert "Signal phrases: found none" in out
    assert "Read 1 file(s):\n  " in out and "plain_stdout.txt (log, 5 lines)" in out


def test_an_unknown_error_is_still_pointed_at(capsys, tmp_path):
    log = tmp_path / "stdout.txt"
    log.write_text("starting\nTraceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
                   "ZeroDivisionError: division by zero\n")
    rc, report = findings(capsys, log)
    assert rc == 1 and report["findings"][0]["id"] == "unrecognised_error"
    assert report["findings"][0]["evidence"][0]["where"].endswith("stdout.txt:4")


# -- output formats and reading --------------------------------------------------------------------

def test_json_output_shape(capsys):
    rc, report = findings(capsys, FIX / "oom_colocate", FIX / "clean_run")
    assert rc == 1
    assert set(report) == {"paths", "findings", "signal_phrases", "runs", "facts", "closest_known", "read", "skipped",
                           "bundle"}
    assert report["runs"] == [{"dir": str(FIX / "clean_run"), "state": "finished", "detail": (
        f"finished: {FIX / 'clean_run' / 'train.log'}:33: Done: 3 steps; metrics in runs/clean/metrics.jsonl")}]
    f = report["findings"][0]
    assert set(f) == {"id", "symptom", "confidence", "level", "evidence", "likely_culprit", "fix", "culprit_id",
                      "seen_before", "also_possible"}
    assert f["culprit_id"] == "oom_disguised"
    assert 0 < f["confidence"] <= 1 and all(set(e) == {"where", "text"} for e in f["evidence"])
    # Secrets in quoted evidence are redacted too (the launch line carries a W&B key).
    assert "8f3a1c0d9e2b" not in json.dumps(report)
    assert {s["phrase"] for s in report["signal_phrases"]} == {
        "Loaded checkpoint from", "weight_sync", "Continuous async rollout worker started", "WorkerCrashed",
        "forward_logp_max_diff", "Alignment check"}


def test_text_output_ranks_and_explains(capsys):
    rc, out, _ = doctor(capsys, FIX / "weight_sync_fail")
    assert rc == 1
    assert out.startswith("miles doctor: 3 finding(s) from 1 file(s), most likely first")
    # How the run ended first (medium, 0.70), above the more confident symptoms.
    assert out.index("1. run was killed (no Done: line, no error): last finished step 1 of 2  [confidence medium") \
        < out.index("2. engine weights differ") < out.index("3. Alignment check FAIL")
    assert "   evidence: " in out and "   likely culprit: " in out and "   fix: " in out


def test_huge_file_is_read_head_and_tail_with_true_line_numbers(capsys, tmp_path, monkeypatch):
    from miles.debug.doctor import readers

    monkeypatch.setattr(readers, "HEAD_BYTES", 2000)
    monkeypatch.setattr(readers, "TAIL_BYTES", 3000)
    log = tmp_path / "stdout.log"
    lines = [f"[2025-06-12 10:00:00] INFO  filler line {i:05d}" for i in range(5000)]
    lines.append("RuntimeError: CUDA error: an illegal memory access was encountered")
    log.write_text("\n".join(lines) + "\n")
    (tmp_path / "core.log").write_bytes(b"\x7fELF\x00\x00binary")  # a binary under a text name
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    _, report = findings(capsys, tmp_path)
    f = report["findings"][0]
    assert f["id"] == "illegal_memory_access" and f["evidence"][0]["where"].endswith("stdout.log:5001")
    assert any("head and tail only" in r for r in report["read"])
    assert {"path": str(tmp_path / "core.log"), "why": "binary"} in report["skipped"]
    assert {"path": str(tmp_path), "why": "1 file(s) of other types (.safetensors)"} in report["skipped"]


def test_help_documents_exit_status(capsys):
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "exit status: 0 no finding; 1 findings were reported" in out and "--bundle OUT" in out


def test_bad_path_is_a_usage_error(capsys, tmp_path):
    rc, out, err = doctor(capsys, tmp_path / "nope")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and "nope: no such file or directory" in err
    (tmp_path / "empty").mkdir()
    rc, _, err = doctor(capsys, tmp_path / "empty")
    assert rc == 2 and err.startswith("error: ") and "nothing" not in err and "no log, metrics" in err
    (tmp_path / "data_0.pt").write_bytes(b"\x00garbage")  # a dump torch cannot load: why, said once
    rc, _, err = doctor(capsys, tmp_path / "data_0.pt")
    assert rc == 2 and err.count("not a readable rollout dump") == 1
    assert f"({tmp_path / 'data_0.pt'}: not a readable rollout dump (not a file torch.save wrote: no zip header)" in err


def test_reading_text_logs_never_imports_torch():
    code = ("import sys; from miles.cli.main import main; rc = main(['doctor', sys.argv[1], '--json']); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, str(FIX / "ray_nccl_weight_sync")], check=False,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 1, done.stderr


# -- the bug-report bundle ---------------------------------------------------------------------------

SECRETS = ["wandb0123456789abcdef0123456789abcdef0123", "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345",
           "sk-proj-Zz9Yy8Xx7Ww6Vv5Uu4Tt", "eyJhbGciOiJIUzI1NiJ9.payload.sig", "hunter2", "s3cr3t-value",
           "ghp_1234567890abcdefghijABCDEFGHIJ"]


def _secret_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(FIX / "nan_grad", run)
    config = json.loads((run / "config.json").read_text())
    config["command_line"] = (f"WANDB_API_KEY={SECRETS[0]} miles train --hf-checkpoint /models/Qwen2.5-7B-Instruct "
                              f"--hf-token {SECRETS[1]} --rollout-max-response-len 512 --label-key answer")
    config.update(wandb_key=SECRETS[0], openai_api_key=SECRETS[2], db={"password": SECRETS[4]},
                  custom_rm_url=f"https://bot:{SECRETS[5]}@rm.internal/score")
    (run / "config.json").write_text(json.dumps(config, indent=2))
    log = (run / "train.log").read_text().splitlines()
    head = [f"2026-11-29 14:01:50 INFO reward server headers: {{'Authorization': 'Bearer {SECRETS[3]}'}}",
            f"2026-11-29 14:01:50 INFO env: OPENAI_API_KEY={SECRETS[2]} HF_TOKEN={SECRETS[1]} password={SECRETS[4]}",
            f"2026-11-29 14:01:50 INFO git remote: https://{SECRETS[6]}@github.com/org/repo.git"]
    filler = [f"2026-11-29 14:01:51 INFO filler {i}" for i in range(230)]
    (run / "train.log").write_text("\n".join(head + log[:1] + filler + log[1:]) + "\n")
    rows = (run / "metrics.jsonl").read_text().splitlines()
    rows += [json.dumps({**json.loads(rows[0]), "step": s}) for s in range(4, 9)]
    (run / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    return run


def test_bundle_holds_a_bug_report_with_secrets_redacted(capsys, tmp_path):
    run = _secret_run(tmp_path)
    out = tmp_path / "reports" / "bug.md"
    rc, stdout, _ = doctor(capsys, run, "--bundle", out)
    assert rc == 1 and f"Bundle written to {out}" in stdout
    text = out.read_text()
    for secret in SECRETS:
        assert secret not in text, secret
    assert "<redacted>" in text
    for section in ("## Launch command", "## Resolved config", "## Versions", "## pip freeze",
                    "## First 200 lines of the trainer log", "## Doctor findings", "## Last metrics rows"):
        assert section in text, section
    assert "miles train --hf-checkpoint /models/Qwen2.5-7B-Instruct --hf-token <redacted> " in text
    assert '"label_key": "label"' in text and "--rollout-max-response-len 512 --label-key answer" in text
    assert "torch==" in text or "torch @" in text  # pip freeze
    assert "torch 2." in text and "nvidia-smi" in text
    assert "filler 195" in text and "filler 196" not in text  # 3 + 1 + 196 = the first 200 lines
    assert "NaN/Inf gradients" in text
    last = text.split("## Last metrics rows")[1]
    assert '"step": 8' in last and '"step": 4' in last and '"step": 3' not in last
    assert [p.name for p in out.parent.iterdir()] == ["bug.md"]  # no temp file left behind


def test_bundle_has_the_mode_of_any_other_file(capsys, tmp_path):
    umask = os.umask(0o022)
    try:
        rc, _, _ = doctor(capsys, FIX / "clean_run", "--bundle", tmp_path / "bug.md")
        (tmp_path / "other.md").write_text("x")
    finally:
        os.umask(umask)
    assert rc == 0
    modes = {name: stat.S_IMODE((tmp_path / name).stat().st_mode) for name in ("bug.md", "other.md")}
    assert modes == {"bug.md": 0o644, "other.md": 0o644}, {k: oct(v) for k, v in modes.items()}


def test_bundle_to_an_unwritable_place_is_a_usage_error(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    rc, _, err = doctor(capsys, FIX / "clean_run", "--bundle", tmp_path / "file" / "bug.md")
    assert rc == 2 and err.startswith("error: --bundle ") and err.count("\n") == 1


def test_redact_keeps_what_is_not_a_secret():
    from miles.debug.doctor.bundle import redact, redact_config

    assert redact("--rollout-max-tokens 512 max_new_tokens=12 --label-key answer") == \
        "--rollout-max-tokens 512 max_new_tokens=12 --label-key answer"
    assert redact("Authorization: Bearer abc.def.ghi") == "Authorization: Bearer <redacted>"
    assert redact("export WANDB_API_KEY=0123456789abcdef") == "export WANDB_API_KEY=<redacted>"
    assert redact("wandb login 0123456789abcdef0123456789abcdef01234567") == "wandb login <redacted>"
    assert redact_config({"label_key": "answer", "api_key": "k", "hf_token": None, "n": {"secret": "x"}}) == \
        {"label_key": "answer", "api_key": "<redacted>", "hf_token": None, "n": {"secret": "<redacted>"}}


# -- how the run ended: crashed, stopped, killed, still running ------------------------------------

def _lock(run: Path, pid: int, host: str | None = None) -> None:
    import datetime
    import socket

    (run / ".miles.lock").write_text(json.dumps({
        "pid": pid, "host": host or socket.gethostname(), "command_line": "miles train --num-rollout 10",
        "started": datetime.datetime.now().isoformat(timespec="seconds")}))


def _copy(tmp_path: Path, fixture: str) -> Path:
    run = tmp_path / fixture
    shutil.copytree(FIX / fixture, run)
    return run


def _dead_pid() -> int:
    """A pid no process can have: above the kernel's limit."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


def _assert_quotes_real_lines(finding):
    for e in finding["evidence"]:
        path, _, line = e["where"].rpartition(":")
        if line.isdigit():
            assert Path(path).read_text().splitlines()[int(line) - 1].strip()[:300] == e["text"], e  # an excerpt


# (fixture, id, symptom, texts the evidence must hold, words of the culprit, words of the fix)
FATE_CASES = [
    ("crashed_run", "run_crashed", "run crashed: StatisticsError: mean requires at least one data point",
     ["ERROR Crashed: StatisticsError: mean requires", "statistics.StatisticsError: mean requires at least one",
      'File "/home/ana/project/my_rewards.py", line 14, in length_bonus'],
     "raised in your code at /home/ana/project/my_rewards.py:14 (in length_bonus)",
     "fix /home/ana/project/my_rewards.py:14"),
    ("error_stopped_run", "run_error",
     ("run stopped with an error: alignment check failed: trainer vs engine (see the `Alignment check` lines in "
      "train.log)"),
     ["ERROR error: alignment check failed: trainer vs engine"], "(exit 3)", "fix what the message names"),
    ("worker_crashed_run", "run_error",
     ("run stopped with an error: WorkerCrashed: trainer rank 1 on node 192.0.2.2 (vm), pid 8791 failed during train: "
      "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
      "Worker unexpectedly exi"),
     ["ERROR error: WorkerCrashed: trainer rank 1 on node 192.0.2.2"], "a Ray-hosted worker died or failed (exit 1)",
     "fix what the message names"),
    ("sigterm_run", "run_signal", "run stopped by SIGTERM during step 3 of 10 (resumable)",
     ["WARNING Stopped by SIGTERM during step 3 of 10"], "preemption",
     ("resume: `miles train --hf-checkpoint /models/tiny-llama --num-rollout 10 --output-dir /runs/sigterm "
      "--save-interval 1 --load /runs/sigterm/checkpoints`")),
    ("nonfinite_stopped_run", "run_nonfinite",
     "run stopped: non-finite values (skipped step(s) 4, 5, 6: non-finite grad_norm)",
     ["ERROR Stopping: 3 consecutive steps with non-finite values", "WARNING Skipped step 4: non-finite grad_norm",
      "WARNING Skipped step 6: non-finite grad_norm"], "chat template", "--precision fp32"),
    ("killed_run", "run_killed", "run was killed (no Done: line, no error): last finished step 7 of 10",
     ["INFO step 7/10 |", "INFO Saved rollout 7 (16 samples)", "is not alive"], "the OOM killer, `kill -9`",
     "dmesg -T"),
]


@pytest.mark.parametrize("fixture,fid,symptom,evidence,culprit,fix", FATE_CASES, ids=[c[0] for c in FATE_CASES])
def test_how_the_run_ended_is_the_top_finding(capsys, tmp_path, fixture, fid, symptom, evidence, culprit, fix):
    run = _copy(tmp_path, fixture)
    if fixture == "killed_run":
        _lock(run, _dead_pid())
    rc, report = findings(capsys, run)
    top = report["findings"][0]
    assert rc == 1 and (top["id"], top["symptom"]) == (fid, symptom), top
    texts = [e["text"] for e in top["evidence"]]
    for want in evidence:
        assert any(want in t for t in texts), (want, texts)
    assert culprit in top["likely_culprit"] and fix in top["fix"], top
    assert [f["id"] for f in report["findings"]].count(fid) == 1
    if fixture == "error_stopped_run":  # the FAIL that stopped it comes next
        assert report["findings"][1]["symptom"].startswith("Alignment check FAIL: trainer vs engine")
    _assert_quotes_real_lines(top)
    assert report["runs"][0]["state"] == {"run_crashed": "crashed", "run_error": "error", "run_signal": "signal",
                                          "run_nonfinite": "nonfinite", "run_killed": "killed"}[fid]


def test_a_true_on_policy_stop_is_named_as_the_modes_check(capsys, tmp_path):
    """The stop of --true-on-policy-mode's check (miles/loop.py: check_true_on_policy, exit 3) is named as that
    check failing, with what breaks it and --true-on-policy-check rescore to train meanwhile; not as a bad flag."""
    run = _copy(tmp_path, "error_stopped_run")
    lines = (run / "train.log").read_text().splitlines()
    lines[-1] = ("2026-12-01 10:00:04 ERROR error: --true-on-policy-mode: at step 3 the engine's log-probs differ "
                 "from the trainer's by up to 0.0186; they must be equal bit for bit, so a kernel outside the mode's "
                 "ran on one side: report it with `miles doctor RUN_DIR --bundle bug.md`")
    (run / "train.log").write_text("\n".join(lines) + "\n")
    _, report = findings(capsys, run)
    top = report["findings"][0]
    assert top["id"] == "run_error" and "at step 3 the engine's log-probs differ" in top["symptom"], top
    assert "check failed (exit 3)" in top["likely_culprit"] and "batch-invariant" in top["likely_culprit"], top
    assert "--true-on-policy-check rescore" in top["fix"], top


def test_a_fate_outranks_more_confident_symptoms(capsys, tmp_path):
    """A SIGTERM stop (medium confidence) still comes before a weight-sync FAIL (high)."""
    run = _copy(tmp_path, "weight_sync_fail")
    with open(run / "train.log", "a") as f:
        f.write("2026-11-29 14:02:20 WARNING Stopped by SIGINT during step 2 of 2; saved checkpoints/step_1; "
                "resume with --load /runs/x/checkpoints\n")
    _, report = findings(capsys, run)
    ids = [f["id"] for f in report["findings"]]
    assert ids == ["run_signal", "weight_sync_mismatch", "train_engine_mismatch"]
    top = report["findings"][0]
    assert top["confidence"] < report["findings"][1]["confidence"]
    assert top["symptom"] == "run stopped by SIGINT during step 2 of 2 (resumable)"
    assert "Ctrl-C" in top["likely_culprit"]
    assert "--load /runs/x/checkpoints" in top["fix"]


def test_killed_run_with_a_reaped_childs_pid(capsys, tmp_path):
    run = _copy(tmp_path, "killed_run")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid is free
    _lock(run, child.pid)
    _, report = findings(capsys, run)
    top = report["findings"][0]
    assert top["id"] == "run_killed" and top["confidence"] == 0.9
    assert any(f"pid {child.pid} on this host" in e["text"] and "is not alive" in e["text"] for e in top["evidence"])


def test_killed_run_without_a_lock_or_with_another_hosts_lock_says_so(capsys, tmp_path):
    run = _copy(tmp_path, "killed_run")
    _, report = findings(capsys, run)
    top = report["findings"][0]
    assert top["id"] == "run_killed" and top["confidence"] == 0.7
    assert "no .miles.lock either" in top["likely_culprit"]
    _lock(run, os.getpid(), host="gpu-node-17")  # a live pid here, but the lock is another host's
    _, report = findings(capsys, run)
    top = report["findings"][0]
    assert top["id"] == "run_killed" and top["confidence"] == 0.5
    assert top["likely_culprit"].startswith("if it is not still running on gpu-node-17")
    assert "check on gpu-node-17 whether pid" in top["fix"]


def test_a_live_run_is_no_death(capsys, tmp_path):
    run = _copy(tmp_path, "live_run")
    _lock(run, os.getpid())
    rc, report = findings(capsys, run)
    assert rc == 0 and report["findings"] == [], report["findings"]
    assert report["runs"][0]["state"] == "running"
    rc, out, _ = doctor(capsys, run)
    assert f"{run}: in progress: pid {os.getpid()} on this host is alive" in out
    assert "last finished step 3 of 10 (no `Done:` line yet, which is no death)" in out


@pytest.mark.parametrize("fixture", ["clean_run", "resumed_finished_run"])
def test_a_finished_run_has_no_fate(capsys, fixture):
    """resumed_finished_run: preempted by SIGTERM, resumed into the same dir, then `Done:`."""
    rc, report = findings(capsys, FIX / fixture)
    assert rc == 0 and report["findings"] == [], report["findings"]
    assert [r["state"] for r in report["runs"]] == ["finished"]


def test_only_the_last_invocation_counts(capsys, tmp_path):
    """An ending followed by a new start line is an earlier invocation's: here a crash, resumed, then killed;
    and the `error:` line after the non-finite stop is that stop's exit message."""
    run = _copy(tmp_path, "crashed_run")
    with open(run / "train.log", "a") as f:
        f.write("2026-12-01 11:00:00 INFO miles 0.1.0 | device=cpu precision=fp32 | output_dir=/runs/crashed\n"
                "2026-12-01 11:00:03 INFO step 3/10 | reward 0.5 | loss 0.1 | grad_norm 1.0 | 0.1s\n")
    _, report = findings(capsys, run)
    assert report["findings"][0]["symptom"] == "run was killed (no Done: line, no error): last finished step 3 of 10"
    run = _copy(tmp_path, "nonfinite_stopped_run")
    with open(run / "train.log", "a") as f:
        f.write("2026-12-01 10:00:13 ERROR error: 3 consecutive non-finite steps (--max-nonfinite-steps 3)\n")
    _, report = findings(capsys, run)
    assert report["findings"][0]["id"] == "run_nonfinite"


def test_traceback_logged_one_record_per_line(capsys, tmp_path):
    run = _copy(tmp_path, "crashed_run")
    lines = (run / "train.log").read_text().splitlines()
    k = next(i for i, line in enumerate(lines) if "Crashed:" in line)
    lines[k + 1:] = [f"2026-12-01 10:00:09 ERROR {line}" for line in lines[k + 1:]]
    (run / "train.log").write_text("\n".join(lines) + "\n")
    _, report = findings(capsys, run)
    top = report["findings"][0]
    assert top["id"] == "run_crashed" and "at /home/ana/project/my_rewards.py:14" in top["likely_culprit"]
    assert top["evidence"][1]["where"].endswith("train.log:30")  # the traceback's last line
    # A message of two lines: the traceback starts one line further down.
    lines = (FIX / "crashed_run" / "train.log").read_text().splitlines()
    lines.insert(k + 1, "  (while scoring rollout 2)")
    (run / "train.log").write_text("\n".join(lines) + "\n")
    _, report = findings(capsys, run)
    assert "at /home/ana/project/my_rewards.py:14" in report["findings"][0]["likely_culprit"]


def test_two_crashed_runs_are_two_findings(capsys, tmp_path):
    a, b = _copy(tmp_path / "a", "crashed_run"), _copy(tmp_path / "b", "crashed_run")
    _, report = findings(capsys, a, b)
    fates = [f for f in report["findings"] if f["id"] == "run_crashed"]
    assert [f["evidence"][0]["where"].split("/crashed_run/")[0] for f in fates] == [str(tmp_path / "a"),
                                                                                    str(tmp_path / "b")]


def test_logs_of_other_frameworks_have_no_fate(capsys):
    for fixture in ("slime_kl_config.log", "verl_moe_collapse.log", "trl_rewards_zero.log", "megatron_fp8_nan.log",
                    "oom_colocate", "ray_worker_crashed", "plain_stdout.txt"):
        _, report = findings(capsys, FIX / fixture)
        assert not FATES & {f["id"] for f in report["findings"]} and report["runs"] == [], fixture


# -- what cannot be read: FIFOs, sockets, devices, unreadable and non-UTF-8 files --------------------

def _doctor_subprocess(*args):
    return subprocess.run([sys.executable, "-m", "miles", "doctor", *map(str, args)], check=False,
                          capture_output=True, text=True, timeout=30, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_fifo_named_train_log_is_skipped_not_opened(tmp_path):
    os.mkfifo(tmp_path / "train.log")  # nobody writes to it: opening it for reading would wait forever
    shutil.copy(FIX / "clean_run" / "metrics.jsonl", tmp_path / "metrics.jsonl")
    done = _doctor_subprocess(tmp_path)
    assert done.returncode in (0, 1), done.stderr
    assert f"{tmp_path / 'train.log'} (a FIFO, not a regular file: not opened)" in done.stdout
    assert f"{tmp_path / 'metrics.jsonl'} (metrics:" in done.stdout
    done = _doctor_subprocess(tmp_path / "train.log", "--json")  # the FIFO itself, named on the command line
    assert done.returncode == 2 and "a FIFO, not a regular file" in done.stderr


def test_a_fifo_lock_or_dump_does_not_block(tmp_path):
    run = _copy(tmp_path, "killed_run")
    os.mkfifo(run / ".miles.lock")
    (run / "dumps").mkdir()
    os.mkfifo(run / "dumps" / "data_0.pt")
    done = _doctor_subprocess(run, "--json")
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    top = report["findings"][0]
    assert top["id"] == "run_killed" and ".miles.lock is a FIFO, not a regular file" in top["likely_culprit"]
    assert {"path": str(run / "dumps" / "data_0.pt"), "why": "a FIFO, not a regular file: not opened"} \
        in report["skipped"]


def test_unreadable_and_non_utf8_files_do_not_crash_it(capsys, tmp_path, monkeypatch):
    from miles.debug.doctor import readers

    run = _copy(tmp_path, "crashed_run")
    (run / "config.json").write_bytes(b'{"command_line": "miles train \xff\xfe"}')
    with open(run / "train.log", "ab") as f:
        f.write(b"2026-12-01 10:00:10 INFO caf\xe9 \xff\n")
    (run / "secret.log").write_text("x")
    real = readers.open_regular

    def no_permission(path):  # tests may run as root, which reads any mode: refuse as the kernel would
        if Path(path).name == "secret.log":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(readers, "open_regular", no_permission)
    rc, report = findings(capsys, run)
    assert rc == 1 and report["findings"][0]["id"] == "run_crashed"
    assert {"path": str(run / "secret.log"), "why": "Permission denied"} in report["skipped"]
    assert any(r.startswith(str(run / "train.log")) for r in report["read"])


def test_a_collapse_is_a_rise_then_a_fall_back_beyond_the_noise():
    import random

    from miles.debug.doctor.rules import find_collapse

    rise = [k / 32 for k in range(32)]
    collapsed = find_collapse(rise + [1.0] * 16 + [0.0] * 16)
    assert collapsed is not None and collapsed[2] > 0.9 and collapsed[3] < 0.1
    assert find_collapse(rise + [1.0] * 16 + [0.4] * 16) is None  # fell, but not back to where it started
    assert find_collapse([k / 8 for k in range(8)] + [0.0] * 12) is None  # 20 steps: too few to tell
    noise = random.Random(0)
    assert not any(find_collapse([noise.gauss(0, 1) for _ in range(64)]) for _ in range(20))  # noisy flat series
