"""`miles report RUN_DIR`: the run as pictures, in one offline HTML page.

    miles report runs/20250101-120000                        # RUN_DIR/report.html + RUN_DIR/report/*.png
    miles report RUN_DIR --dumps 'dumps/data_{rollout_id}.pt'  # dumps other than config.json's
    miles report RUN_DIR --model DIR --dumps dumps/data_3.pt    # score that dump's tokens with these weights

Plots the metrics of `metrics.jsonl` over steps (reward, response length, KL, grad norm, trainer vs
engine log-prob difference) and, from the rollout dumps, a scatter of the trainer's per-token
log-probs against the engine's. Dumps hold only the engine's log-probs, so the trainer's are
recomputed for one dump: the first whose sampling weights are at hand (the base model for rollout 0,
checkpoint `step_K` for rollout K), or with `--model`, the first dump found. A plot whose data is
absent is skipped with a note on the page. The page needs no network and no JavaScript: the PNGs
sit in RUN_DIR/report/ and are linked relatively.

RUN_DIR/report/index.json records which plots the page has and why the others were skipped. A new
report that would lack a plot the earlier one had (say, run from another directory, where the dumps'
relative paths no longer resolve) is refused (exit 2) unless `--force` is given; with `--force` the
page and the output name each plot lost, and why.
"""

from __future__ import annotations

import argparse
import glob
import html
import io
import json
import math
import os
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from miles.errors import UsageError
from miles.utils.io import atomic_write_bytes, atomic_write_json, check_model_dir

# (file stem, title, panels: each a list of metric keys drawn on one axis, log y-scale)
PLOTS = [
    ("reward", "Reward mean", [["rollout/reward_mean"]], False),
    ("response_length", "Response length (tokens)", [["rollout/response_len_mean"]], False),
    ("kl", "KL to reference / PPO KL", [["rollout/kl", "train/kl_loss"], ["train/ppo_kl"]], False),
    ("grad_norm", "Gradient norm (before clipping)", [["train/grad_norm"]], False),
    ("logprob_diff", "Trainer vs engine log-prob difference",
     [["train/train_rollout_logprob_abs_diff", "forward_logp_max_diff"]], True),
]
SCATTER_TITLE = "Trainer vs engine per-token log-probs"
EVAL_TITLE = "Evaluation on held-out prompts (mean reward; pass@k)"
INDEX = "report/index.json"  # what the page holds, for the next report to compare with
MAX_SCORED_SAMPLES = 64  # of one dump; scoring is a forward pass per sample: keep the report cheap on big models


def register(commands) -> None:
    p = commands.add_parser("report", help="write RUN_DIR/report.html (+ PNG plots) of a run's metrics",
                            description=__doc__.splitlines()[0])
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run's --output-dir (holds metrics.jsonl)")
    p.add_argument("--dumps", metavar="TEMPLATE_OR_GLOB",
                   help="rollout dumps for the log-prob scatter (default: config.json's --save-debug-rollout-data)")
    p.add_argument("--model", metavar="DIR", help="HF model dir that scores the first dump's tokens (default: the "
                                                   "weights that dump was sampled with, when they are at hand)")
    p.add_argument("--force", action="store_true",
                   help="write the report even where it lacks plots the earlier RUN_DIR/report.html had")
    p.set_defaults(run=run)


@dataclass(frozen=True, kw_only=True)
class Plot:
    id: str  # logprob_scatter, or engine_logprobs for its engine-only stand-in
    file: str  # relative to RUN_DIR
    title: str
    caption: str
    png: bytes


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"RUN_DIR {run_dir} is not a directory")
    if args.model:
        check_model_dir(args.model, "--model")
    rows = read_metrics(run_dir / "metrics.jsonl")
    config_path = run_dir / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    notes: list[str] = []
    plots, skipped = draw(run_dir, rows, config, args, notes)
    lost = lost_plots(run_dir, plots, skipped, notes)
    if lost and not args.force:
        hint = ", or --dumps/--model to make them" if {"logprob_scatter", "engine_logprobs"} & set(lost) else ""
        raise UsageError(f"{run_dir / 'report.html'} has plots this report would lack ("
                         + "; ".join(f"{i}: {why}" for i, why in lost.items()) + f"); pass --force to overwrite{hint}")
    notes += [f"the earlier report had {i}, this one lacks it: {why}" for i, why in lost.items()]
    for plot in plots:
        atomic_write_bytes(run_dir / plot.file, plot.png)
    atomic_write_json(run_dir / INDEX, {"format": "miles.report/1", "plots": [
        {"id": p.id, "file": p.file, "title": p.title} for p in plots], "skipped": skipped})
    figures = [(p.file, p.title, p.caption) for p in plots]
    atomic_write_bytes(run_dir / "report.html", render_html(run_dir, rows, config, figures, notes).encode())
    print(f"Wrote {run_dir / 'report.html'} ({len(plots)} plots in {run_dir / 'report'})")
    for note in notes:
        print(f"note: {note}")
    return 0


def draw(run_dir: Path, rows: list[dict], config: dict, args, notes: list[str]) -> tuple[list[Plot], dict[str, str]]:
    """Every plot whose data is at hand, in memory; for each of the others, why not (its notes)."""
    plots, skipped = [], {}
    for stem, title, panels, log in PLOTS:
        first = len(notes)
        png = line_plot(rows, title, panels, log, notes)
        if png is None:
            skipped[stem] = reason(notes[first:], title)
        else:
            plots.append(Plot(id=stem, file=f"report/{stem}.png", title=title, caption="", png=png))
    eval_means = sorted({k for r in rows for k in r if k.startswith("eval/") and k.count("/") == 1})
    if eval_means:  # --eval-prompt-data: each set's mean reward, and its pass@k where k > 1
        passes = sorted({k for r in rows for k in r if k.startswith("eval/") and "/pass@" in k})
        png = line_plot(rows, EVAL_TITLE, [eval_means] + ([passes] if passes else []), False, notes)
        plots.append(Plot(id="eval", file="report/eval.png", title=EVAL_TITLE, caption="", png=png))
    first = len(notes)
    plot_id, png, caption = logprob_scatter(run_dir, config, args, notes)
    if plot_id != "logprob_scatter":
        skipped["logprob_scatter"] = reason(notes[first:], SCATTER_TITLE)
    if png is not None:
        title = SCATTER_TITLE if plot_id == "logprob_scatter" else "Engine per-token log-probs"
        plots.append(Plot(id=plot_id, file="report/logprob_scatter.png", title=title, caption=caption, png=png))
    return plots, skipped


def reason(notes: list[str], title: str) -> str:
    return "; ".join(n.removeprefix(f"{title}: ").removeprefix("skipped, ") for n in notes) or "no data"


def lost_plots(run_dir: Path, plots: list[Plot], skipped: dict[str, str], notes: list[str]) -> dict[str, str]:
    """Plot id -> why, for each plot the earlier report (its index.json) had and this one lacks."""
    index = run_dir / INDEX
    if not (run_dir / "report.html").is_file() or not index.is_file():
        return {}
    try:
        earlier = [p["id"] for p in json.loads(index.read_text())["plots"]]
    except (ValueError, KeyError, TypeError) as e:
        notes.append(f"{index} is unreadable ({e!r}); the earlier report's plots were not compared")
        return {}
    have = {p.id for p in plots} | ({"engine_logprobs"} if any(p.id == "logprob_scatter" for p in plots) else set())
    return {i: skipped.get(i, "not drawn") for i in earlier if i not in have}


def read_metrics(path: Path) -> list[dict]:
    """Rows by step; NaN/Inf arrive as the strings "nan"/"inf" and become floats again."""
    if not path.is_file():
        raise UsageError(f"{path} does not exist: RUN_DIR must be a run's --output-dir with at least one step")
    by_step: dict[int, dict] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{n}: not a JSON object ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise UsageError(f"{path}:{n}: a metrics row needs an integer \"step\"")
        by_step[row["step"]] = {k: _number(v) for k, v in row.items()}  # a resumed run's rerun step wins
    if not by_step:
        raise UsageError(f"{path} holds no steps yet")
    return [by_step[s] for s in sorted(by_step)]


def _number(v):
    if isinstance(v, str) and v.strip().lower().lstrip("+-") in ("nan", "inf", "infinity"):
        return float(v)
    return v


def _figure(panels: int):
    # The Agg canvas directly, not pyplot: no global backend switch, nothing that wants a display.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # Panels stack vertically so every PNG keeps one width and its text stays legible in the page.
    fig = Figure(figsize=(7.0, 0.6 + 2.8 * panels), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, [fig.add_subplot(panels, 1, i + 1) for i in range(panels)]


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def line_plot(rows: list[dict], title: str, panels: list[list[str]], log: bool, notes: list[str]) -> bytes | None:
    present = [[k for k in keys if any(isinstance(r.get(k), (int, float)) for r in rows)] for keys in panels]
    missing = [k for keys, have in zip(panels, present) for k in keys if k not in have]
    present = [keys for keys in present if keys]
    if not present:
        notes.append(f"{title}: skipped, metrics.jsonl has no {' / '.join(missing)}")
        return None
    if missing:
        notes.append(f"{title}: {', '.join(missing)} absent from metrics.jsonl")
    from matplotlib.ticker import MaxNLocator

    fig, axes = _figure(len(present))
    for ax, keys in zip(axes, present):
        positive = False
        for key in keys:
            points = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
            steps, values = [s for s, _ in points], [v for _, v in points]
            bad = [s for s, v in points if not math.isfinite(v)]
            if bad:  # NaN/Inf would vanish from the line: mark the steps so nobody misses them
                notes.append(f"{key} is NaN/Inf at step(s) {', '.join(map(str, bad[:10]))} (red lines)")
                for i, s in enumerate(bad):
                    ax.axvline(s, color="red", linestyle=":", linewidth=1, label=f"{key} NaN/Inf" if i == 0 else None)
            if log and any(v == 0 for v in values):  # log scale cannot show exact zeros
                notes.append(f"{key} is exactly 0 at {sum(v == 0 for v in values)} step(s), not drawn on the "
                             f"log scale (0 means trainer and engine agree bitwise)")
            shown = [v if math.isfinite(v) and (v > 0 or not log) else math.nan for v in values]
            positive = positive or any(v > 0 for v in shown)
            ax.plot(steps, shown, marker="o" if len(steps) <= 50 else None, markersize=3, label=key)
        if log and positive:
            ax.set_yscale("log")
        # Every plot spans the whole run, so steps line up across plots even where a key has gaps.
        first, last = rows[0]["step"], rows[-1]["step"]
        margin = max((last - first) * 0.03, 0.5)
        ax.set_xlim(first - margin, last + margin)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _png(fig)


def find_dumps(run_dir: Path, config: dict, pattern: str | None) -> list[Path]:
    """Dump files from --dumps or config.json's template; relative paths may be relative to RUN_DIR."""
    pattern = pattern or config.get("save_debug_rollout_data")
    if not pattern:
        return []
    pattern = pattern.replace("{rollout_id}", "*")
    paths = glob.glob(pattern) or ([] if os.path.isabs(pattern) else glob.glob(str(run_dir / pattern)))
    # Natural order: data_2 before data_10.
    return sorted((Path(p) for p in paths), key=lambda p: [int(t) if t.isdigit() else t
                                                          for t in re.split(r"(\d+)", p.name)])


def dumps_tried(run_dir: Path, config: dict, pattern: str | None) -> str:
    """Where find_dumps looked, in words."""
    where = "--dumps" if pattern else "config.json's save_debug_rollout_data"
    pattern = pattern or config.get("save_debug_rollout_data")
    if not pattern:
        return f"via {where} (not set)"
    if os.path.isabs(pattern):
        return f"at {pattern} ({where})"
    return f"at {pattern} ({where}) under {os.getcwd()} or {run_dir}"


def weights_for(dump: dict, run_dir: Path, config: dict) -> Path | None:
    """The weights a dump was sampled with: rollout K comes from the policy after step K."""
    meta, rid = dump.get("metadata") or {}, dump.get("rollout_id")
    if rid == 0 and not meta.get("load") and meta.get("hf_checkpoint"):
        candidate = Path(meta["hf_checkpoint"])
    elif isinstance(rid, int):
        candidate = Path(config.get("save") or run_dir / "checkpoints") / f"step_{rid}"
    else:
        return None
    return candidate if (candidate / "config.json").is_file() else None


def logprob_scatter(run_dir: Path, config: dict, args, notes: list[str]) -> tuple[str | None, bytes | None, str]:
    """(plot id, PNG, caption): the scatter (`logprob_scatter`), the engine side alone when nothing can
    score the dumps (`engine_logprobs`), or (None, None, "") when skipped."""
    title = SCATTER_TITLE
    paths = find_dumps(run_dir, config, args.dumps)
    if not paths:
        notes.append(f"{title}: skipped, no rollout dumps found {dumps_tried(run_dir, config, args.dumps)} "
                     f"(capture with --save-debug-rollout-data)")
        return None, None, ""
    from miles.bridge.rollout_dump import read_dump, samples_from_dump

    weights, chosen, engine_only = Path(args.model) if args.model else None, [], []
    for path in paths:
        try:
            dump = read_dump(path)
        except UsageError as err:  # one corrupt dump should not cost the whole report
            notes.append(f"{title}: {err}")
            continue
        n = int((dump.get("metadata") or {}).get("n_samples_per_prompt") or 1)
        samples = [s for s in samples_from_dump(dump, path, n) if len(s.rollout_log_probs) == s.response_length]
        engine_only += samples
        w = weights or weights_for(dump, run_dir, config)
        if w is not None and samples:  # one dump, one model: weights from other steps would blur the scatter
            weights, meta = w, dump.get("metadata") or {}
            chosen = [(path, s) for s in samples[:MAX_SCORED_SAMPLES]]
            break
    if not engine_only:
        notes.append(f"{title}: skipped, the dumps carry no engine log-probs (rollout_log_probs)")
        return None, None, ""
    if not chosen:  # nothing to score with: show the engine side alone, and say why
        notes.append(f"{title}: no weights found for any dump (base model moved, or no step_K checkpoint); showing "
                     f"the engine's log-probs only; pass --model DIR to score them")
        fig, (ax,) = _figure(1)
        ax.hist([lp for s in engine_only for lp, m in zip(s.rollout_log_probs, s.loss_mask) if m], bins=50)
        ax.set_xlabel("engine log-prob per token")
        ax.set_ylabel("tokens")
        fig.suptitle("Engine per-token log-probs (trainer side not available)")
        return "engine_logprobs", _png(fig), "Engine log-probs only: no weights to compute the trainer's with"
    engine, trainer = score(weights, [s for _, s in chosen], meta, config)
    fig, (ax,) = _figure(1)
    fig.set_size_inches(7.0, 5.0)
    ax.scatter(engine, trainer, s=6, alpha=0.5)
    lo, hi = min(engine + trainer), max(engine + trainer)
    ax.plot([lo, hi], [lo, hi], color="black", linestyle="--", linewidth=1, label="y = x")
    diffs = [abs(a - b) for a, b in zip(engine, trainer)]
    ax.set_xlabel("engine (rollout) log-prob")
    ax.set_ylabel("trainer log-prob")
    ax.set_aspect("equal", adjustable="datalim")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"{title}\n{len(engine)} tokens of {chosen[0][0].name}; |diff| max {max(diffs):.2e}, "
                 f"mean {sum(diffs) / len(diffs):.2e}", fontsize=10)
    caption = f"trainer log-probs recomputed with {weights}; engine log-probs from the dumps"
    return "logprob_scatter", _png(fig), caption


def score(weights: Path, samples, meta: dict, config: dict) -> tuple[list[float], list[float]]:
    """Engine and trainer log-probs of every trained response token, computed as the trainer does
    (its own scoring pass, `score_rollout`, at the run's micro-batch size and precision)."""
    import torch

    from miles.train.batch import LOG_PROBS_CHUNK_SIZE, TrainBatch, score_rollout
    from miles.train.trainer import mixed_precision
    from miles.utils.models import load_causal_lm, load_tokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_causal_lm(weights, device=device, attention_backend=config.get("attention_backend") or "sdpa").eval()
    vocab = model.get_input_embeddings().weight.shape[0]
    if max(max(s.tokens) for s in samples) >= vocab:
        raise UsageError(f"--model {weights}: the dumps hold token ids outside its vocabulary ({vocab}); "
                         f"pass the model the run was trained from")
    pad = load_tokenizer(weights).pad_token_id or 0
    temperature = float(meta.get("temperature") or config.get("rollout_temperature") or 1.0)
    precision = meta.get("precision") or config.get("precision") or "fp32"
    batch = TrainBatch.from_samples(samples, pad, device)
    logp, _ = score_rollout(model, batch, int(config.get("micro_batch_size") or 8), temperature,
                            lambda: mixed_precision(precision, device),
                            packed=(config.get("qkv_format") or "bshd") == "thd",
                            chunk_size=int(config.get("log_probs_chunk_size") or LOG_PROBS_CHUNK_SIZE))
    keep = batch.mask.bool()
    return batch.rollout_log_probs[keep].tolist(), logp.float()[keep].tolist()


def render_html(run_dir: Path, rows: list[dict], config: dict, figures, notes: list[str]) -> str:
    e = html.escape
    imgs = "\n".join(f'<figure><img src="{e(src)}" alt="{e(alt)}"><figcaption>{e(caption)}</figcaption></figure>'
                     for src, alt, caption in figures)
    note_items = "".join(f"<li>{e(n)}</li>" for n in notes) or "<li>every plot had its data</li>"

    def table(d: dict) -> str:
        return "<table>" + "".join(f"<tr><th>{e(str(k))}</th><td>{e(_fmt(v))}</td></tr>" for k, v in d.items()
                                   if k != "command_line") + "</table>"

    command = f"<pre>{e(config['command_line'])}</pre>" if config.get("command_line") else ""
    # The script only records, for headless checks, that every plot decoded; the page needs no JS.
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>miles report: {e(run_dir.name)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
.plots {{ display: grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr)); gap: 1em; }}
figure {{ margin: 0; }} img {{ max-width: 100%; border: 1px solid #ddd; }}
figcaption {{ font-size: 0.85em; color: #555; }}
table {{ border-collapse: collapse; font-size: 0.8em; margin-bottom: 1em; }}
th, td {{ border: 1px solid #ddd; padding: 2px 6px; text-align: left; }} th {{ background: #f4f4f4; }}
.tables {{ display: flex; gap: 2em; flex-wrap: wrap; align-items: flex-start; }}
pre {{ white-space: pre-wrap; background: #f4f4f4; padding: 0.5em; font-size: 0.8em; }}
</style></head>
<body>
<h1>miles report: {e(run_dir.name)}</h1>
<p>{e(str(run_dir.resolve()))} &middot; {len(rows)} steps ({rows[0]['step']}&ndash;{rows[-1]['step']}) &middot;
generated {datetime.now().strftime('%Y-%m-%d %H:%M:%S')}</p>
{command}
<h2>Notes</h2><ul>{note_items}</ul>
<h2>Plots</h2><div class="plots">
{imgs}
</div>
<div class="tables">
<div><h2>Last metrics row (step {rows[-1]['step']})</h2>{table(rows[-1])}</div>
<div><h2>Config</h2>{table(config) if config else '<p>no config.json</p>'}</div>
</div>
<script>window.addEventListener("load", function () {{
  var ok = Array.prototype.filter.call(document.images, function (i) {{ return i.naturalWidth > 0; }}).length;
  document.body.setAttribute("data-images-loaded", ok + "/" + document.images.length);
}});</script>
</body></html>
"""


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return json.dumps(v) if isinstance(v, (list, dict)) else str(v)
