"""`miles report RUN_DIR`: an offline HTML page with PNG plots of a real tiny run, checked on disk
and rendered in headless Chromium."""

import json
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from miles.cli.main import main

PLOTS = ["reward", "response_length", "kl", "grad_norm", "logprob_diff", "logprob_scatter"]
CHROMIUM = Path("/usr/bin/chromium")
# Runs the CLI in a fresh interpreter and fails (exit 7) if torch was imported on the way.
NO_TORCH = ("import sys; from miles.cli.main import main; rc = main(sys.argv[1:]); "
            "sys.exit(7 if 'torch' in sys.modules else rc)")


@pytest.fixture(scope="module")
def run_dir(tiny_model, prompt_file, reward_module, tmp_path_factory) -> Path:
    """A 2-step run with KL loss and rollout dumps, so every plot has data (the tiny_args recipe)."""
    out = tmp_path_factory.mktemp("report") / "run"
    args = ["train", "--hf-checkpoint", str(tiny_model), "--prompt-data", str(prompt_file),
            "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
            "--custom-rm-path", reward_module, "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
            "--rollout-max-response-len", "12", "--rollout-temperature", "1.0", "--micro-batch-size", "4",
            "--num-rollout", "2", "--lr", "1e-3", "--output-dir", str(out),
            "--save-debug-rollout-data", str(out / "dumps" / "data_{rollout_id}.pt"),
            "--use-kl-loss", "--kl-loss-coef", "0.01"]
    assert main(args) == 0
    assert main(["report", str(out)]) == 0
    return out


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def img_sources(page: str) -> list[str]:
    return re.findall(r'<img src="([^"]+)"', page)


def test_report_has_every_plot_and_the_tables(run_dir, tiny_model):
    page = (run_dir / "report.html").read_text()
    assert img_sources(page) == [f"report/{name}.png" for name in PLOTS]  # relative: the page works offline
    for name in PLOTS:
        png = run_dir / "report" / f"{name}.png"
        width, height = png_size(png)
        assert 500 <= width <= 1200 and 250 <= height <= 1200, (name, width, height)
        assert png.stat().st_size > 8_000, name  # axes, lines and labels, not a blank canvas
    assert "every plot had its data" in page
    # The scatter's trainer side came from the weights rollout 0 was sampled with: the base model.
    assert f"trainer log-probs recomputed with {tiny_model}" in page
    assert "http://" not in page and "https://" not in page
    assert "<th>kl_loss_coef</th><td>0.01</td>" in page and "Last metrics row (step 2)" in page
    assert "<th>train/grad_norm</th>" in page


def test_model_flag_and_dump_glob(run_dir, tiny_model, tmp_path):
    run = shutil.copytree(run_dir, tmp_path / "run", ignore=shutil.ignore_patterns("report*"))
    # A glob relative to RUN_DIR; --model scores the first dump found.
    assert main(["report", str(run), "--dumps", "dumps/data_*.pt", "--model", str(tiny_model)]) == 0
    page = (run / "report.html").read_text()
    assert img_sources(page)[-1] == "report/logprob_scatter.png"
    assert f"trainer log-probs recomputed with {tiny_model}" in page


def test_without_weights_the_engine_side_is_shown_and_said(run_dir, tmp_path):
    run = shutil.copytree(run_dir, tmp_path / "run", ignore=shutil.ignore_patterns("report*"))
    shutil.rmtree(run / "checkpoints")
    # Rollout 1 was sampled after step 1, and step_1 was never saved: nothing can score it.
    assert main(["report", str(run), "--dumps", str(run / "dumps" / "data_1.pt")]) == 0
    page = (run / "report.html").read_text()
    assert "no weights found for any dump" in page and "pass --model DIR" in page
    png_size(run / "report" / "logprob_scatter.png")  # the engine log-prob histogram


def test_index_records_the_plots(run_dir):
    index = json.loads((run_dir / "report" / "index.json").read_text())
    assert [p["id"] for p in index["plots"]] == PLOTS and index["skipped"] == {}
    assert [p["file"] for p in index["plots"]] == img_sources((run_dir / "report.html").read_text())


def test_a_poorer_report_does_not_replace_a_richer_one_unless_forced(run_dir, tmp_path, monkeypatch, capsys):
    # The run as seen from its parent dir, with dumps recorded relative to it: runs/x/dumps/...
    run = shutil.copytree(run_dir, tmp_path / "work" / "runs" / "x")
    config = json.loads((run / "config.json").read_text())
    config["save_debug_rollout_data"] = "runs/x/dumps/data_{rollout_id}.pt"
    (run / "config.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)  # another working directory: the dumps no longer resolve
    page, scatter = (run / "report.html").read_bytes(), (run / "report" / "logprob_scatter.png").read_bytes()
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {run / 'report.html'} has plots this report would lack (logprob_scatter: no rollout "
                   f"dumps found at runs/x/dumps/data_{{rollout_id}}.pt (config.json's save_debug_rollout_data) under "
                   f"{tmp_path} or {run} (capture with --save-debug-rollout-data)); pass --force to overwrite, or "
                   f"--dumps/--model to make them\n")
    assert (run / "report.html").read_bytes() == page  # nothing of the earlier report was touched
    assert (run / "report" / "logprob_scatter.png").read_bytes() == scatter

    assert main(["report", str(run), "--force"]) == 0
    out = capsys.readouterr().out
    assert "note: the earlier report had logprob_scatter, this one lacks it: no rollout dumps found at runs/x" in out
    assert "the earlier report had logprob_scatter, this one lacks it" in (run / "report.html").read_text()
    assert "report/logprob_scatter.png" not in img_sources((run / "report.html").read_text())
    assert main(["report", str(run)]) == 0  # now the page on disk lacks it too: nothing to lose
    monkeypatch.chdir(tmp_path / "work")  # where the dumps resolve again: richer is always fine
    assert main(["report", str(run)]) == 0
    assert img_sources((run / "report.html").read_text())[-1] == "report/logprob_scatter.png"


def test_engine_histogram_does_not_replace_a_scatter_unless_forced(run_dir, tmp_path, capsys):
    run = shutil.copytree(run_dir, tmp_path / "run")
    shutil.rmtree(run / "checkpoints")
    dump = str(run / "dumps" / "data_1.pt")  # sampled after step 1, whose checkpoint is gone
    assert main(["report", str(run), "--dumps", dump]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run / 'report.html'} has plots this report would lack (logprob_scatter: no "
                          "weights found for any dump") and err.endswith("or --dumps/--model to make them\n"), err
    assert main(["report", str(run), "--dumps", dump, "--force"]) == 0
    index = json.loads((run / "report" / "index.json").read_text())
    assert index["plots"][-1]["id"] == "engine_logprobs"
    assert "no weights found" in index["skipped"]["logprob_scatter"]


def test_missing_keys_and_nan_are_notes_not_failures(tmp_path):
    rows = [{"step": 1, "rollout/reward_mean": 0.1, "train/grad_norm": "nan"},
            {"step": 2, "rollout/reward_mean": 0.3, "train/grad_norm": "inf", "forward_logp_max_diff": 0.0},
            {"step": 3, "rollout/reward_mean": "nan", "train/grad_norm": 2.5, "forward_logp_max_diff": 0.2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # No dumps, so the report never needs torch.
    r = subprocess.run([sys.executable, "-c", NO_TORCH, "report", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "report.html").read_text()
    assert img_sources(page) == ["report/reward.png", "report/grad_norm.png", "report/logprob_diff.png"]
    assert "Response length (tokens): skipped, metrics.jsonl has no rollout/response_len_mean" in page
    assert "KL to reference / PPO KL: skipped" in page
    assert ("train/grad_norm is NaN/Inf at step(s) 1, 2" in page
            and "rollout/reward_mean is NaN/Inf at step(s) 3" in page)
    assert "forward_logp_max_diff is exactly 0 at 1 step(s)" in page
    assert "no rollout dumps found" in page and "no config.json" in page


def test_module_imports_neither_torch_nor_matplotlib():
    code = "import sys, miles.debug.report; sys.exit(bool({'torch', 'matplotlib'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("case", ["no_dir", "no_metrics", "bad_line", "bad_model"])
def test_bad_input_is_one_error_line(tmp_path, case):
    args = {"no_dir": [str(tmp_path / "nope")], "no_metrics": [str(tmp_path)],
            "bad_line": [str(tmp_path)], "bad_model": [str(tmp_path), "--model", str(tmp_path / "nope")]}[case]
    if case in ("bad_line", "bad_model"):
        (tmp_path / "metrics.jsonl").write_text('{"step": 1, "rollout/reward_mean": 0.5}\n{"step": 2,\n')
    r = subprocess.run([sys.executable, "-c", NO_TORCH, "report", *args], capture_output=True, text=True)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    expected = {"no_dir": "is not a directory", "no_metrics": "metrics.jsonl does not exist",
                "bad_line": "metrics.jsonl:2: not a JSON object", "bad_model": "--model"}[case]
    assert expected in lines[0]


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium: apt-get install -y chromium")
def test_headless_chromium_renders_every_plot(run_dir, tmp_path):
    flags = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,2000"]
    url = (run_dir / "report.html").resolve().as_uri()
    shot = tmp_path / "shot.png"
    r = subprocess.run(flags + [f"--screenshot={shot}", url], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and shot.is_file(), r.stderr[-2000:]
    assert png_size(shot) == (1200, 2000)
    from PIL import Image

    # A rendered page with plots has many colours; a blank or error page has a handful.
    assert len(Image.open(shot).convert("RGB").getcolors(maxcolors=1 << 20)) > 50
    # The page's own script counts the <img> elements that decoded (naturalWidth > 0) once loaded.
    r = subprocess.run(flags + ["--virtual-time-budget=3000", "--dump-dom", url], capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f'data-images-loaded="{len(PLOTS)}/{len(PLOTS)}"' in r.stdout, r.stdout[:2000]
