"""`miles selftest`: the shipped reference holds here, another kernel path passes within tolerance,
and a departure planted in a reference this test writes itself is named (step and component).

Three recipe runs in all: this install's reference (written once, reused), one made under
ATEN_CPU_CAPABILITY=default, and the CLI against the latter.
"""

import copy
import json
import os
import subprocess
import sys

import pytest

from miles.cli.main import main
from miles.debug import selftest


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> dict:
    """This install's record, written by `miles selftest --write-expected`."""
    path = tmp_path_factory.mktemp("selftest") / "native.json"
    assert main(["selftest", "--write-expected", str(path)]) == 0
    return json.loads(path.read_text())


def other_kernels(record: dict) -> dict:
    """A copy of `record` that claims another kernel path, so only the tolerance claims apply."""
    other = copy.deepcopy(record)
    other["platform"]["cpu_capability"] = "AVX2" if record["platform"]["cpu_capability"] == "AVX512" else "AVX512"
    return other


def test_shipped_reference_passes_here(native):
    # Bitwise on the CPU kind that made it, within tolerance on any other.
    code, lines = selftest.verdict(native, selftest.read_reference(str(selftest.EXPECTED)), native["platform"])
    assert code == 0, "\n".join(lines)
    assert lines[-1].startswith("Selftest: PASS")


def test_selftest_names_the_first_departure(native):
    planted = copy.deepcopy(native)
    planted["hashes"][1]["trainer_log_probs"] = "0" * 16
    planted["metrics"][1]["train/grad_norm"] *= 1.01

    code, lines = selftest.verdict(native, planted, native["platform"])
    assert code == 3
    assert "claims: bitwise" in lines[2]
    assert lines[3].startswith("bitwise: first departure at step 2, trainer_log_probs")
    assert lines[4].startswith("tolerance: first departure at step 2, train/grad_norm")

    code, lines = selftest.verdict(native, other_kernels(planted), native["platform"])
    assert code == 3
    assert "claims: within tolerance, not bitwise (kernels differ: " in lines[2]
    assert lines[-1].startswith("Selftest: FAIL, first departs at step 2, train/grad_norm")


def test_one_flipped_sample_passes_and_more_fail(native):
    flipped = other_kernels(native)
    flipped["samples"][1][5] = "0" * 12  # a rounding flip at step 2: later steps train on another rollout
    flipped["metrics"][2]["train/grad_norm"] *= 2
    code, lines = selftest.verdict(native, flipped, native["platform"])
    assert code == 0, "\n".join(lines)
    assert "at step 2 one sample's tokens flipped" in lines[-1]

    flipped["samples"][1][6] = "0" * 12
    code, lines = selftest.verdict(native, flipped, native["platform"])
    assert code == 3
    assert lines[-1].startswith("Selftest: FAIL, first departs at step 2, rollout_tokens: 2 of 16 samples")


@pytest.mark.skipif(os.environ.get("ATEN_CPU_CAPABILITY") is not None, reason="the kernel path is forced already")
def test_another_kernel_path_passes_within_tolerance(tmp_path, capsys):
    import torch

    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this install already runs the default kernels")
    reference = tmp_path / "default_kernels.json"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    subprocess.run([sys.executable, "-m", "miles", "selftest", "--write-expected", str(reference)], env=env,
                   check=True, capture_output=True)
    assert json.loads(reference.read_text())["platform"]["cpu_capability"] == "DEFAULT"

    assert main(["selftest", "--expected", str(reference)]) == 0
    out = capsys.readouterr().out
    assert f"claims: within tolerance, not bitwise (kernels differ: DEFAULT vs " \
           f"{torch.backends.cpu.get_cpu_capability()})" in out
    assert "Selftest: PASS within tolerance for 3 steps" in out
