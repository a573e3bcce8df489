"""`miles selftest`: the shipped known-good recipe reproduces here, and a departure is named."""

import json

from miles.cli.main import main
from miles.debug.selftest import EXPECTED


def test_selftest_reproduces_the_shipped_reference(capsys):
    assert main(["selftest"]) == 0
    out = capsys.readouterr().out
    assert "Selftest: PASS" in out


def test_selftest_names_the_first_departure(tmp_path, capsys):
    expected = json.loads(EXPECTED.read_text())
    expected["hashes"][1]["trainer_log_probs"] = "0" * 16
    expected["metrics"][1]["train/grad_norm"] *= 1.01
    path = tmp_path / "expected.json"
    path.write_text(json.dumps(expected))
    assert main(["selftest", "--expected", str(path)]) == 3
    out = capsys.readouterr().out
    assert "hashes: first departure at step 2, trainer_log_probs" in out
    assert "Selftest: FAIL, first departs at step 2, train/grad_norm" in out
