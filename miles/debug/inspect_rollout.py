"""`miles inspect-rollout PATH`: what is in a rollout dump, at a glance or token by token.

    miles inspect-rollout dumps/data_0.pt             # table of samples + summary
    miles inspect-rollout dumps/data_0.pt --sample 3  # one sample: prompt, response, per-token log-probs
    miles inspect-rollout dumps/data_0.pt --json      # the same, for machines

A debugging tool shows what is there: a dump whose fields have the right types is shown even when
their values would make a replay refuse it (log-probs of the wrong length or missing on some
samples, a NaN reward, broken groups); each such problem is one `warning:` line on stderr (and the
`problems` list of --json). A field of the wrong type is an `error:` line, as for a replay.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

from miles.bridge.types import mean_rollout_log_prob
from miles.errors import UsageError

# A dump broken throughout (every sample's log-probs cut short) should not bury the table under
# thousands of identical lines: a screenful of warnings, then a count.
MAX_WARNINGS = 20


def register(commands) -> None:
    p = commands.add_parser("inspect-rollout", help="show a rollout dump: samples, rewards, lengths, log-prob stats",
                            description=__doc__.splitlines()[0])
    p.add_argument("path", metavar="PATH", help="a dump written by --save-debug-rollout-data (or by Miles/slime)")
    p.add_argument("--sample", type=int, metavar="K", help="show sample K in full, with per-token log-probs")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--tokenizer", metavar="DIR", help="decode tokens with this tokenizer (default: the dump's model, "
                                                       "if it is a local dir)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if Path(args.path).is_dir():  # before the dump reader (and torch) is imported
        raise UsageError(directory_error(Path(args.path)))
    if args.tokenizer is not None and args.sample is None:
        raise UsageError(f"--tokenizer {args.tokenizer} decodes the tokens of one sample: give --sample K too")
    if args.tokenizer is not None and not Path(args.tokenizer, "tokenizer_config.json").is_file():
        raise UsageError(f"--tokenizer {args.tokenizer}: no tokenizer files (tokenizer_config.json) there")
    from miles.bridge.rollout_dump import plain, read_dump, samples_from_dump, samples_per_prompt, validate_samples

    path = Path(args.path)
    payload = read_dump(path, source="inspect-rollout")
    metadata = payload.get("metadata") or {}
    n_per_prompt = samples_per_prompt(payload, path)
    samples = samples_from_dump(payload, path, n_per_prompt)
    problems = validate_samples(samples, path, n_per_prompt)
    warn(problems)
    if args.sample is not None:
        if not 0 <= args.sample < len(samples):
            raise UsageError(f"--sample {args.sample}: {path} has samples 0..{len(samples) - 1}")
        return show_sample(samples[args.sample], metadata, args)
    summary = summarize(samples, n_per_prompt)
    if args.json:
        rows = [sample_row(s) for s in samples]
        print(json.dumps(plain({"path": str(path), "format": payload.get("format", "slime"),
                                "rollout_id": payload.get("rollout_id"), "metadata": metadata, "summary": summary,
                                "problems": problems, "samples": rows}), indent=2, default=str))
        return 0
    print_table(path, payload, metadata, samples, summary)
    return 0


def warn(problems: list[str]) -> None:
    """One `warning:` line per problem, the first MAX_WARNINGS of them."""
    for p in problems[:MAX_WARNINGS]:
        print(f"warning: {p}", file=sys.stderr)
    if len(problems) > MAX_WARNINGS:
        print(f"warning: ... and {len(problems) - MAX_WARNINGS} more problems (--json lists them all)", file=sys.stderr)


def directory_error(path: Path) -> str:
    """Says PATH is a directory and names the dump files in it, in rollout-id order."""
    dumps = sorted((f.name for f in path.glob("*.pt") if f.is_file()),
                   key=lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)])
    if not dumps:
        return f"inspect-rollout: {path} is a directory with no *.pt dump files; give one dump file"
    shown = dumps if len(dumps) <= 3 else [*dumps[:2], "...", dumps[-1]]
    return (f"inspect-rollout: {path} is a directory; give one dump file: {', '.join(shown)} "
            f"({len(dumps)} file{'s' if len(dumps) > 1 else ''})")


def sample_row(s) -> dict:
    lp = s.rollout_log_probs
    return {"index": s.index, "group": s.group_index, "reward": s.reward, "prompt_len": s.prompt_length,
            "response_len": s.response_length, "status": s.status,
            "logp_mean": mean_rollout_log_prob([s]),
            "logp_min": min((x for x, m in zip(lp, s.loss_mask) if m), default=None) if lp else None,
            "masked": s.response_length - sum(s.loss_mask[:s.response_length]), "response": s.response}


def spans(loss_mask: list[int]) -> list[tuple[str, int, int]]:
    """The response's runs of policy tokens (mask 1) and masked ones (mask 0: tool or environment
    output, not trained on), as (kind, first, last) positions."""
    out: list[tuple[str, int, int]] = []
    for i, m in enumerate(loss_mask):
        kind = "policy" if m else "masked"
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1], i)
        else:
            out.append((kind, i, i))
    return out


def summarize(samples, n_per_prompt: int) -> dict:
    rewards = [s.reward for s in samples]
    lengths = [s.response_length for s in samples]
    log_probs = [lp for s in samples for lp, m in zip(s.rollout_log_probs, s.loss_mask) if m]  # not placeholders
    groups: dict[int, list[float]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s.reward)
    statuses: dict[str, int] = {}
    for s in samples:
        statuses[s.status] = statuses.get(s.status, 0) + 1
    return {
        "samples": len(samples),
        "groups": len(groups),
        "reward_mean": _mean(rewards),
        "reward_std": _std(rewards),
        "reward_min": min(rewards),
        "reward_max": max(rewards),
        # A group whose rewards are all equal gives GRPO zero advantage: no learning signal.
        "groups_with_signal": sum(len(set(r)) > 1 for r in groups.values()),
        "response_len_mean": statistics.fmean(lengths),
        "response_len_min": min(lengths),
        "response_len_max": max(lengths),
        "status": statuses,
        "logp_mean": mean_rollout_log_prob(samples),
        "logp_min": min(log_probs) if log_probs else None,
        "samples_without_logp": sum(not s.rollout_log_probs for s in samples),
    }


def print_table(path, payload, metadata, samples, summary) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text  # the dump's text as it is: "[/INST]" in a response is not rich markup

    console = Console()
    if not console.is_terminal:  # piped into a file or a pager: don't squeeze the table into 80 columns
        console.width = 160
    title = f"{path}  rollout {payload.get('rollout_id')}  ({payload.get('format', 'slime/Miles format')})"
    table = Table(title=Text(title), title_justify="left")
    multi_turn = any(sample_row(s)["masked"] for s in samples)  # custom generation: show the masked tokens
    columns = ("idx", "group", "reward", "prompt", "resp") + (("masked",) if multi_turn else ()) + \
        ("status", "logp mean", "logp min", "response")
    for col in columns:
        table.add_column(col, justify="right" if col not in ("status", "response") else "left",
                         overflow="ellipsis", no_wrap=True, max_width=60 if col == "response" else None)
    for s in samples:
        r = sample_row(s)
        masked = (str(r["masked"]),) if multi_turn else ()
        table.add_row(str(r["index"]), str(r["group"]), f"{r['reward']:.3f}", str(r["prompt_len"]),
                      str(r["response_len"]), *masked, Text(_safe(r["status"])), _fmt(r["logp_mean"]),
                      _fmt(r["logp_min"]), Text(_safe(" ".join(s.response.split()))))
    console.print(table)
    sm = summary
    console.print(
        f"samples {sm['samples']} in {sm['groups']} groups | reward mean {sm['reward_mean']:.3f} "
        f"std {sm['reward_std']:.3f} [{sm['reward_min']:.3f}, {sm['reward_max']:.3f}] | groups with mixed rewards "
        f"{sm['groups_with_signal']}/{sm['groups']}\nresponse length mean {sm['response_len_mean']:.1f} "
        f"[{sm['response_len_min']}, {sm['response_len_max']}] | status "
        + ", ".join(f"{_safe(k)} {v}" for k, v in sorted(sm["status"].items()))
        + f" | engine logp/token mean {_fmt(sm['logp_mean'])} min {_fmt(sm['logp_min'])}",
        markup=False, highlight=False, soft_wrap=True)
    if metadata:
        console.print(_safe("metadata: " + ", ".join(f"{k}={v}" for k, v in metadata.items())), markup=False,
                      highlight=False, soft_wrap=True)


def show_sample(s, metadata: dict, args: argparse.Namespace) -> int:
    from miles.bridge.rollout_dump import plain

    captured_with = metadata.get("hf_checkpoint")
    pieces = _decode_pieces(s.response_tokens, args.tokenizer or (captured_with if isinstance(captured_with, str)
                                                                   else None))
    tokens = [{"id": t, "text": p, "logp": lp, "loss_mask": m}
              for t, p, lp, m in zip(s.response_tokens, pieces, _pad(s.rollout_log_probs, s.response_length),
                                     s.loss_mask)]
    if args.json:
        print(json.dumps(plain({**s.to_dict(), "response_tokens": tokens}), indent=2, default=str))
        return 0
    from miles.debug.print_rollout import prompt_text

    print(f"sample {s.index} (group {s.group_index}) | reward {s.reward} | label {s.label!r} | "
          f"status {_safe(s.status)}")
    print(f"prompt ({s.prompt_length} tokens): {_safe(str(prompt_text(s.prompt)))}")
    print(f"response ({s.response_length} tokens): {_safe(s.response)}")
    runs = spans(s.loss_mask)
    if any(kind == "masked" for kind, _, _ in runs):  # a multi-turn sample: which tokens the policy made
        print("turns: " + " | ".join(f"{kind} {a}-{b}" + (f" {''.join(p or '' for p in pieces[a:b + 1])!r}"
                                                          if kind == "masked" and any(pieces[a:b + 1]) else "")
                                     for kind, a, b in runs))
    print(f"{'pos':>4} {'token':>7} {'logp':>9} {'p':>6} mask  text")
    for i, t in enumerate(tokens):
        lp = t["logp"] if t["loss_mask"] else None  # a masked token's log-prob is a placeholder
        print(f"{i:>4} {t['id']:>7} {_fmt(lp) if t['loss_mask'] else 'masked':>9} {_prob(lp):>6} "
              f"{t['loss_mask']:>4}  {t['text']!r}")
    return 0


def _decode_pieces(token_ids: list[int], tokenizer_dir: str | None) -> list[str | None]:
    if tokenizer_dir and Path(tokenizer_dir, "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        return [tok.decode([t]) if t < len(tok) else None for t in token_ids]  # a dump of another model
    return [None] * len(token_ids)


def _pad(values: list[float], n: int) -> list[float | None]:
    return list(values) + [None] * (n - len(values))


def _safe(text: str) -> str:
    """`text` as stdout can take it: a lone surrogate (not valid Unicode) shown as its escape, \\udXXX."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _prob(log_prob: float | None) -> str:
    if log_prob is None:
        return "n/a"
    return "inf" if log_prob > 700 else f"{math.exp(log_prob):.3f}"  # exp overflows past ~709 (bad log-probs)


def _mean(values: list[float]) -> float:
    """statistics.fmean, but inf/NaN/huge values (a broken dump) give inf/NaN instead of raising."""
    return sum(values) / len(values)


def _std(values: list[float]) -> float:
    if not all(math.isfinite(v) for v in values):
        return math.nan
    return statistics.pstdev(values)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
