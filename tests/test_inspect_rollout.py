"""`miles inspect-rollout DIR`: a directory is bad input that names the dump files in it."""

import subprocess
import sys

from miles.cli.main import main

# Runs the CLI in a fresh interpreter and fails (exit 7) if torch was imported on the way.
NO_TORCH = ("import sys; from miles.cli.main import main; rc = main(sys.argv[1:]); "
            "sys.exit(7 if 'torch' in sys.modules else rc)")


def error_line(capsys, path) -> str:
    rc = main(["inspect-rollout", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: "), (rc, err)
    return err.strip()


def test_directory_names_its_dumps_in_rollout_order(tmp_path, capsys):
    for i in (10, 2, 0, 1):
        (tmp_path / f"data_{i}.pt").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("not a dump")
    assert error_line(capsys, tmp_path) == (f"error: inspect-rollout: {tmp_path} is a directory; give one dump file: "
                                            "data_0.pt, data_1.pt, ..., data_10.pt (4 files)")
    (tmp_path / "data_10.pt").unlink()
    (tmp_path / "data_2.pt").unlink()
    assert error_line(capsys, tmp_path).endswith("give one dump file: data_0.pt, data_1.pt (2 files)")


def test_directory_without_dumps(tmp_path, capsys):
    assert error_line(capsys, tmp_path) == (f"error: inspect-rollout: {tmp_path} is a directory with no *.pt dump "
                                            "files; give one dump file")


def test_directory_is_refused_before_torch_is_imported(tmp_path):
    (tmp_path / "data_0.pt").write_bytes(b"")
    r = subprocess.run([sys.executable, "-c", NO_TORCH, "inspect-rollout", str(tmp_path)], capture_output=True,
                       text=True)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: inspect-rollout: ") and "data_0.pt (1 file)" in r.stderr
