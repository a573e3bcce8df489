import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_code_passes_ruff():
    """Every file passes `ruff check` with pyproject.toml's rules (F, E9, E501 at 120 characters)."""
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "miles", "tests", "benchmarks", "scripts"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
