"""`miles doctor --bundle OUT`: one file holding what a good bug report needs, secrets redacted.

The guide's list: the launch command, `pip freeze`, the first 200 lines of trainer stdout; plus the
resolved config, torch / CUDA / driver versions, the doctor's findings and the last metrics rows.
Everything that goes into the file passes `redact`, config values included, because bundles get
pasted into public issues.
"""

from __future__ import annotations

import datetime
import json
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

from miles.debug.doctor.readers import Corpus
from miles.utils.io import atomic_write_text

REDACTED = "<redacted>"
_TEXT_SECRETS = [
    # Authorization: Bearer <token>, and bare bearer tokens
    (re.compile(r"(?i)(authorization['\"]?\s*[:=]\s*['\"]?(?:bearer|token|basic)\s+)[^\s'\",]+"), r"\1" + REDACTED),
    (re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]{8,}"), r"\1" + REDACTED),
    # env-var style: WANDB_API_KEY=..., HF_TOKEN=..., AWS_SECRET_ACCESS_KEY=..., DB_PASSWORD=...
    (re.compile(r"\b([A-Z][A-Z0-9_]*(?:API_KEY|APIKEY|TOKEN|SECRET|SECRET_KEY|ACCESS_KEY|PASSWORD|PASSWD)"
                r"(?:_[A-Z0-9]+)?)(\s*[=:]\s*)(['\"]?)[^\s'\",}]+"), r"\1\2\3" + REDACTED),
    # lower-case keys in configs, YAML, dict reprs: api_key: ..., "password": "...", wandb_key=...
    (re.compile(r"(?i)\b(api[_-]?key|access[_-]?token|auth[_-]?token|hf[_-]?token|wandb[_-]?(?:api[_-]?)?key|"
                r"secret[_-]?key|client[_-]?secret|password|passwd)(['\"]?\s*[:=]\s*['\"]?)[^\s'\",}]+"),
     r"\1\2" + REDACTED),
    # command-line flags ending in a secret word: --hf-token X, --wandb-key=X, --api-key X
    (re.compile(r"(?i)(--[\w-]*(?:api-key|token|secret|password|wandb-key)\b(?!-))(\s+|=)(?!--)\S+"),
     r"\1\2" + REDACTED),
    # well-known token shapes, wherever they appear
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}"), REDACTED),
    (re.compile(r"\bsk-[A-Za-z0-9_-]{16,}"), REDACTED),
    (re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}"), REDACTED),
    (re.compile(r"\bxox[abprs]-[A-Za-z0-9-]{10,}"), REDACTED),
    (re.compile(r"\bAKIA[0-9A-Z]{16}\b"), REDACTED),
    (re.compile(r"(?i)(wandb\b.*?)\b[0-9a-f]{40}\b"), r"\1" + REDACTED),  # `wandb login <40 hex>`
    (re.compile(r"(://[^/\s:@]+:)[^@\s/]+@"), r"\1" + REDACTED + "@"),  # https://user:pass@host
]
_SECRET_KEY = re.compile(r"(?i)(^|[_\-.])(api[_-]?key|apikey|token|auth[_-]?token|access[_-]?token|secret|"
                         r"secret[_-]?key|password|passwd|wandb[_-]?key|hf[_-]?token|credentials?)$")


def redact(text: str) -> str:
    for rx, repl in _TEXT_SECRETS:
        text = rx.sub(repl, text)
    return text


def redact_config(value, key: str = ""):
    """A config with secret-named keys blanked and every string value passed through `redact`."""
    if isinstance(value, dict):
        return {k: redact_config(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_config(v, key) for v in value]
    if _SECRET_KEY.search(key) and value not in (None, "", False):
        return REDACTED
    return redact(value) if isinstance(value, str) else value


def write_bundle(out: str, corpus: Corpus, paths: list[str], findings_text: str) -> Path:
    target = Path(out)
    if target.is_dir():
        target = target / "miles-doctor-bundle.md"
    target.parent.mkdir(parents=True, exist_ok=True)  # a place that cannot be written fails before pip freeze
    text = redact("\n".join(_sections(corpus, paths, findings_text)) + "\n")
    atomic_write_text(target, text)  # a half-written bundle never sits at OUT
    return target


def _sections(corpus: Corpus, paths: list[str], findings_text: str):
    config_path, config = next(((p, c) for p, c in corpus.configs if "command_line" in c),
                               corpus.configs[0] if corpus.configs else (None, None))
    yield "# miles doctor bundle"
    yield f"Written {datetime.datetime.now().isoformat(timespec='seconds')} by `miles doctor --bundle` from: " + \
          " ".join(paths) + ". Secrets are redacted as " + REDACTED + "."
    yield "\n## Launch command"
    yield _fence(config.get("command_line") if config and config.get("command_line") else _command_from_logs(corpus))
    yield f"\n## Resolved config ({config_path or 'no config.json found'})"
    yield _fence(json.dumps(redact_config(config), indent=2, default=str) if config else "(none)", "json")
    yield "\n## Versions"
    yield _fence(_versions())
    yield "\n## pip freeze"
    yield _fence(_run([sys.executable, "-m", "pip", "freeze"], timeout=120))
    log = _trainer_log(corpus)
    yield f"\n## First 200 lines of the trainer log ({log.path if log else 'none found'})"
    yield _fence("\n".join(log.lines[:200]) if log else "(none)")
    yield "\n## Doctor findings"
    yield _fence(findings_text.rstrip())
    metrics = next((p for p in _metrics_files(corpus)), None)
    yield f"\n## Last metrics rows ({metrics or 'no metrics.jsonl found'})"
    yield _fence("\n".join(metrics.read_text(errors="replace").splitlines()[-5:]) if metrics else "(none)", "json")


def _fence(text: str, lang: str = "text") -> str:
    return f"```{lang}\n{text.replace('```', '` ` `')}\n```"


def _command_from_logs(corpus: Corpus) -> str:
    rx = re.compile(r"(?:^|\s)(?:python\S*\s|torchrun\s|ray job submit\s|miles train\b|accelerate launch\s).*")
    for log in corpus.logs:
        for line in log.lines[:200]:
            m = rx.search(line)
            if m:
                return f"{m.group(0).strip()}   (from {log.path})"
    return "(not found: no config.json with command_line, no launch line in the logs)"


def _trainer_log(corpus: Corpus):
    miles = [log for log in corpus.logs if log.kind == "miles-train"]
    return (miles or corpus.logs or [None])[0]


def _metrics_files(corpus: Corpus):
    for m in corpus.metrics:
        if m.name.endswith(".jsonl"):
            yield Path(m.name)


def _versions() -> str:
    from miles import __version__

    lines = [f"miles {__version__}", f"python {sys.version.split()[0]} ({platform.platform()})"]
    try:
        import torch  # only here: the doctor itself never needs it

        lines.append(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuda available "
                     f"{torch.cuda.is_available()}")
        if torch.cuda.is_available():
            lines += [f"  gpu {i}: {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    except Exception as e:  # noqa: BLE001  (a broken torch install is itself worth reporting)
        lines.append(f"torch: import failed ({type(e).__name__}: {e})")
    if shutil.which("nvidia-smi"):
        lines.append("nvidia-smi: " + _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                            "--format=csv,noheader"], timeout=20))
    else:
        lines.append("nvidia-smi: not found (no NVIDIA driver on this machine)")
    return "\n".join(lines)


def _run(cmd: list[str], timeout: float) -> str:
    try:
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout)
        return done.stdout.strip() or f"(no output; exit {done.returncode}: {done.stderr.strip()[:300]})"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(failed: {type(e).__name__}: {e})"
