"""`miles check-weights A B`: do two weight sets hold the same tensors, and if not, how do they differ?

    miles check-weights ckpt/iter_10_hf dump/engine_weights   # checkpoint dirs, sharded or not
    miles check-weights a.safetensors b.safetensors --atol 1e-3 # single files; values within a tolerance
    miles check-weights A B --json                            # the same findings, for machines
    miles check-weights ckpt/step_3 http://127.0.0.1:30000    # does a running engine hold them?

Aimed at the weight-sync bugs of RL training: names lost in a mapping, a prefix (`model.`, `module.`)
added or dropped, a tensor written transposed, a silent dtype cast, buffers left behind, and pipeline
stages that number their layers from the wrong start. A layer offset d is B's index minus A's index:
"layer offset +1 for layers 0..2" means B's layer k+1 holds A's layer k, for k = 0..2. Layers are
compared whole (every tensor of the layer); an offset is reported wherever a layer of B that differs
from A's layer at its own index equals A's layer at another index, also when B holds that layer of A
in place. A tensor that differs because its layer of B holds a shifted layer of A is listed
as a consequence of the offset. Layers all equal to each other (identical init) give no offsets.
A prefix difference alone still counts as a match (it is a naming convention, not a weight change).

Exit 0 when the weights match, 3 when they differ, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

from miles.errors import UsageError

EXIT_DIFFER = 3  # SPEC: exit 3 when a weight check failed
# Non-greedy: in `model.layers.3.mlp...` the layer stack is `model.layers`, the index 3.
LAYER_RE = re.compile(r"^((?:.*?\.)?(?:layers|h|blocks))\.(\d+)\.(.+)$")
BUFFER_RE = re.compile(r"(?:^|\.)(?:inv_freq|rotary_emb\..*|[^.]*_buffer)$")
SECTIONS = {  # report key -> heading; the order is the order of the report
    "only_in_a": "only in A (missing from B)", "only_in_b": "only in B (extra)",
    "buffers_dropped": "buffers dropped", "shape_dtype": "shape/dtype differs", "transposed": "transposed",
    "layer_offsets": "layer offsets", "unmatched_layers": "unmatched layers", "values_differ": "values differ",
}


def register(commands) -> None:
    p = commands.add_parser("check-weights", help="compare two weight sets: names, shapes, dtypes, values, "
                            "transposes, layer offsets", description=__doc__.splitlines()[0])
    p.add_argument("a", metavar="A", help="checkpoint dir (HF safetensors, sharded or not) or a .safetensors file")
    p.add_argument("b", metavar="B", help="the other weight set, same forms as A, or an engine URL (`miles serve`, "
                                          "SGLang, vLLM): does the running engine hold A's weights?")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="against an engine without digests (vLLM, SGLang): the engine's precision, which sets the "
                        "probe's tolerance (default: fp32)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--atol", type=float, default=0.0, metavar="X",
                   help="compare values within X (as float32) instead of byte for byte")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.atol < 0:
        raise UsageError(f"--atol {args.atol}: must be >= 0")
    if "://" in args.a:
        raise UsageError(f"A: {args.a}: put the engine URL second (miles check-weights CHECKPOINT URL)")
    if args.b.startswith(("http://", "https://")):
        from miles.debug.check_engine import check_engine

        return check_engine(args.a, args.b, as_json=args.json, precision=args.precision)
    files_a, files_b = resolve("A", args.a), resolve("B", args.b)  # both paths checked before torch loads
    report = compare(WeightSet("A", args.a, files_a), WeightSet("B", args.b, files_b), args.atol)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["verdict"] == "match" else EXIT_DIFFER


def resolve(label: str, spec: str) -> list[Path]:
    """The safetensors files behind an argument; a UsageError naming the argument if there are none."""
    if "://" in spec:
        raise UsageError(f"{label}: {spec}: only http(s):// engine URLs are understood, as B")
    from miles.utils.safetensors_files import safetensors_files

    try:
        return safetensors_files(spec)
    except ValueError as e:
        raise UsageError(f"{label}: {e}") from None


class WeightSet:
    """Tensor names -> files, read lazily (safe_open maps the files), so big checkpoints are hashed
    one tensor at a time instead of being loaded twice into memory."""

    def __init__(self, label: str, spec: str, files: list[Path]):
        from safetensors import safe_open

        self.label, self.spec, self.n_files = label, spec, len(files)
        self.handles, self.names, self._digests = {}, {}, {}  # names: name as compared -> name as stored
        for f in files:
            try:
                self.handles[f] = safe_open(str(f), framework="pt")
            except Exception as e:  # a truncated or foreign file: say which, not a Rust traceback
                raise UsageError(f"{label}: cannot read {f}: {e}") from None
            for name in self.handles[f].keys():
                self.names.setdefault(name, (f, name))

    def strip(self, prefix: str) -> None:
        self.names = {(n[len(prefix):] if n.startswith(prefix) else n): v for n, v in self.names.items()}

    def get(self, name: str):
        f, stored = self.names[name]
        return self.handles[f].get_tensor(stored)

    def digest(self, name: str) -> str:
        if name not in self._digests:
            self._digests[name] = _typed_sha256(self.get(name))
        return self._digests[name]


def _typed_sha256(t) -> str:
    from miles.utils.digest import typed_tensor_sha256  # torch, only once there are tensors to hash

    return typed_tensor_sha256(t)


def find_prefix(a: set[str], b: set[str]) -> tuple[str, str] | None:
    """(side, prefix) whose removal from that side's names lines up the most extra names, if any."""
    best, base = None, len(a & b)
    for side, names, other in (("A", a, b), ("B", b, a)):
        parts = (n.split(".") for n in names)
        for p in {".".join(ps[:i]) + "." for ps in parts for i in (1, 2) if len(ps) > i}:
            stripped = {n[len(p):] if n.startswith(p) else n for n in names}
            gain = len(stripped & other) - base
            if len(stripped) == len(names) and gain > 0 and (best is None or gain > best[0]):
                best = (gain, side, p)  # (a strip that merges two names is no prefix)
    return best[1:] if best else None


def layers_of(ws: WeightSet) -> dict[tuple[str, int], dict[str, str]]:
    """(layer stack, index) -> {name within the layer: digest}."""
    out: dict[tuple[str, int], dict[str, str]] = {}
    for name in ws.names:
        if m := LAYER_RE.match(name):
            out.setdefault((m[1], int(m[2])), {})[m[3]] = ws.digest(name)
    return out


def find_layer_offsets(a: WeightSet, b: WeightSet):
    """Runs of consecutive layers of A that B holds whole at a fixed other index (the pipeline-stage
    numbering bug), whether or not B also holds them in place. Returns (offsets, unmatched layers, names
    of A explained by an offset, names of B likewise)."""
    la, lb = layers_of(a), layers_of(b)
    candidates = held_elsewhere(la, lb)
    offsets = pick_runs(candidates)
    # "Matches no layer" only means something next to an offset; otherwise it is a plain value change.
    unmatched = [{"stack": s, "layer": k} for (s, k) in sorted(la)
                 if offsets and lb.get((s, k)) != la[(s, k)] and not candidates.get((s, k))]
    explained_a = {f"{o['stack']}.{k}.{n}" for o in offsets for k in range(o["first"], o["last"] + 1)
                   for n in la[(o["stack"], k)]}
    explained_b = {f"{o['stack']}.{k + o['offset']}.{n}" for o in offsets
                   for k in range(o["first"], o["last"] + 1) for n in la[(o["stack"], k)]}
    return offsets, unmatched, explained_a, explained_b


def held_elsewhere(la: dict, lb: dict) -> dict[tuple[str, int], set[int]]:
    """(stack, k) -> the offsets d != 0 at which B's layer k+d equals A's layer k in every tensor, for
    layers of B that differ from A's layer at their own index. A layer equal to every other layer of
    A's stack (identical init) says nothing about where it went, and is left out."""
    where_a: dict[tuple, list[int]] = {}
    for (stack, k), tensors in la.items():
        where_a.setdefault((stack, frozenset(tensors.items())), []).append(k)
    n_layers = Counter(stack for stack, _ in la)
    out: dict[tuple[str, int], set[int]] = {}
    for (stack, m), tensors in lb.items():
        if la.get((stack, m)) == tensors:
            continue  # intact in place
        ks = where_a.get((stack, frozenset(tensors.items())), [])
        if len(ks) > 1 and len(ks) == n_layers[stack]:
            continue  # every layer of A is this layer
        for k in ks:
            out.setdefault((stack, k), set()).add(m - k)
    return out


def pick_runs(candidates: dict[tuple[str, int], set[int]]) -> list[dict]:
    """Maximal runs of consecutive layers sharing an offset; longest first, each layer of A and of B
    in at most one run (a layer matching at two offsets goes to the run that explains the most)."""
    runs = []
    for stack, d in {(s, d) for (s, _), ds in candidates.items() for d in ds}:
        ks = sorted(k for (s, k), ds in candidates.items() if s == stack and d in ds)
        start = ks[0]
        for prev, k in zip(ks, ks[1:] + [None]):
            if k is None or k != prev + 1:  # the run ends at prev
                runs.append((stack, d, start, prev))
                start = k
    offsets, taken_a, taken_b = [], set(), set()
    for stack, d, i, j in sorted(runs, key=lambda r: (-(r[3] - r[2]), abs(r[1]), r[0], r[2])):
        ks = range(i, j + 1)
        if not any((stack, k) in taken_a or (stack, k + d) in taken_b for k in ks):
            taken_a.update((stack, k) for k in ks)
            taken_b.update((stack, k + d) for k in ks)
            offsets.append({"stack": stack, "offset": d, "first": i, "last": j})
    return sorted(offsets, key=lambda o: (o["stack"], o["first"]))


def offset_consequence(name: str, offsets: list[dict]) -> dict | None:
    """For a tensor of a layer of B that holds a shifted layer of A: the offset and A's layer index."""
    m = LAYER_RE.match(name)
    for o in offsets if m else ():
        if m[1] == o["stack"] and o["first"] <= int(m[2]) - o["offset"] <= o["last"]:
            return {"offset": o["offset"], "a_layer": int(m[2]) - o["offset"], "b_layer": int(m[2])}
    return None


def compare_tensor(a: WeightSet, b: WeightSet, name: str, atol: float) -> tuple[str, dict]:
    """(kind, details) for one name present in both: identical, transposed, shape_dtype or values_differ."""
    if a.digest(name) == b.digest(name):
        return "identical", {}
    ta, tb = a.get(name), b.get(name)
    info = {"a": f"{str(ta.dtype).removeprefix('torch.')} {list(ta.shape)}",
            "b": f"{str(tb.dtype).removeprefix('torch.')} {list(tb.shape)}"}
    if ta.shape == tb.shape and ta.dtype == tb.dtype and atol > 0 and max_abs_diff(ta, tb) <= atol:
        return "identical", {}
    if ta.dim() == 2 and tb.shape == ta.shape[::-1] and ta.dtype == tb.dtype and (
            _typed_sha256(ta.t()) == b.digest(name) or (atol > 0 and max_abs_diff(ta.t(), tb) <= atol)):
        return "transposed", info
    if ta.shape != tb.shape or ta.dtype != tb.dtype:
        return "shape_dtype", {**info, "max_abs_diff": max_abs_diff(ta, tb) if ta.shape == tb.shape else None}
    return "values_differ", {**info, "max_abs_diff": max_abs_diff(ta, tb)}


def max_abs_diff(x, y) -> float:
    # NaN at the same place on both sides is no difference; NaN on one side is an infinite one.
    d = (x.float() - y.float()).abs().nan_to_num(nan=float("inf"))
    d[x.float().isnan() & y.float().isnan()] = 0
    return float(d.max()) if d.numel() else 0.0


def compare(a: WeightSet, b: WeightSet, atol: float) -> dict:
    report = {"a": a.spec, "b": b.spec, "tensors_a": len(a.names), "tensors_b": len(b.names), "atol": atol,
              "prefix": None, **{key: [] for key in SECTIONS}, "identical": 0}
    if prefix := find_prefix(set(a.names), set(b.names)):
        (a if prefix[0] == "A" else b).strip(prefix[1])
        report["prefix"] = {"side": prefix[0], "prefix": prefix[1]}
    offsets, unmatched, explained_a, explained_b = find_layer_offsets(a, b)
    report["layer_offsets"], report["unmatched_layers"] = offsets, unmatched
    for mine, other, explained, key in ((a, b, explained_a, "only_in_a"), (b, a, explained_b, "only_in_b")):
        for name in sorted(set(mine.names) - set(other.names) - explained, key=natural):
            if BUFFER_RE.search(name):
                report["buffers_dropped"].append({"name": name, "only_in": mine.label})
            else:
                report[key].append(name)
    for name in sorted((set(a.names) & set(b.names)) - explained_a, key=natural):
        kind, info = compare_tensor(a, b, name, atol)
        if kind == "identical":
            report["identical"] += 1
        elif cause := offset_consequence(name, offsets):  # B's layer holds another layer of A
            report[kind].append({"name": name, **info, "consequence_of_offset": cause})
        else:
            report[kind].append({"name": name, **info})
    report["verdict"] = "differ" if any(report[key] for key in SECTIONS) else "match"
    return report


def natural(name: str) -> list:
    """Sort key that puts layers.10 after layers.9."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def format_line(key: str, f) -> str:
    if key in ("only_in_a", "only_in_b"):
        return f
    if key == "buffers_dropped":
        return f"{f['name']}: buffer dropped (only in {f['only_in']})"
    if key == "layer_offsets":
        d, span = f["offset"], f"{f['first']}..{f['last']}"
        return f"layer offset {d:+d} for layers {span} of {f['stack']} (B's layer k{d:+d} holds A's layer k)"
    if key == "unmatched_layers":
        return f"layer {f['layer']} of A matches no layer of B ({f['stack']})"
    diff = "" if f.get("max_abs_diff") is None else f", max abs diff {f['max_abs_diff']:.3g}"
    line = f"{f['name']}: {SECTIONS[key]} (A {f['a']}, B {f['b']}{diff})"
    if cause := f.get("consequence_of_offset"):
        line += f"; consequence of the layer offset: B's layer {cause['b_layer']} holds A's layer {cause['a_layer']}"
    return line


def format_report(r: dict) -> str:
    lines = [f"A: {r['a']} ({r['tensors_a']} tensors)", f"B: {r['b']} ({r['tensors_b']} tensors)"]
    if r["prefix"]:
        lines.append(f"names differ by prefix '{r['prefix']['prefix']}' (present in {r['prefix']['side']}); "
                     "compared after stripping it")
    for key, heading in SECTIONS.items():
        if r[key]:
            lines += [f"{heading} ({len(r[key])}):"] + [f"  {format_line(key, f)}" for f in r[key]]
    tol = f" (within atol {r['atol']:g})" if r["atol"] else ""
    if r["verdict"] == "match":
        lines.append(f"Weights match: {r['identical']} tensors identical{tol}")
    else:
        counts = ", ".join(f"{heading.split(' (')[0]}: {len(r[key])}" for key, heading in SECTIONS.items() if r[key])
        lines.append(f"Weights differ: {counts}; {r['identical']} tensors identical{tol}")
    return "\n".join(lines)
