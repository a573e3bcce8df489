"""The doctor's unit of output: a `Finding` (symptom, confidence, evidence, likely culprit, fix).

Several rules can see the same symptom (miles' own `Alignment check` line and the metric it came from,
say); findings with one `id` are merged so a user reads each problem once, with all its evidence.
How a run ended (crashed, stopped, killed: `fate=True`) is the first thing to know, so those findings
rank above every symptom, whatever their confidence; each is about one run dir (`scope`), so two
crashed runs stay two findings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_EVIDENCE = 6  # per finding: enough to find the spot, short enough to read

# The culprit (kb/culprits.json id) each rule's finding names, where it names one culprit whatever the
# branch; rules whose culprit depends on what they saw set `kb` themselves.
RULE_CULPRITS = {
    "illegal_memory_access": "oom_disguised", "oom_colocate_step2": "oom_disguised", "oom": "oom_disguised",
    "sglang_kv_too_small": "oom_disguised", "inductor_cache": "inductor_cache", "nccl_timeout": "nccl_weight_sync",
    "engine_buffers_dropped": "engine_buffers_dropped", "weight_sync_mismatch": "weight_sync_stale",
    "no_checkpoint_loaded": "params_not_loaded", "instruct_logp": "chat_template", "moe_collapse": "moe_routing",
    "reward_constant": "reward_bug", "train_engine_mismatch": "logprob_semantics",
    "kl_step1": "nondeterministic_kernels", "garbled_rollout": "chat_template", "nan_grad": "chat_template",
    "no_weight_sync": "weight_sync_stale", "moe_routing_mismatch": "moe_routing",
}


@dataclass
class Evidence:
    where: str  # `file:line`, or `file:line` of a metrics.jsonl row
    text: str  # the line itself, or `step N key=value`


@dataclass
class Finding:
    id: str  # stable name of the symptom (for --json users and for merging)
    symptom: str
    confidence: float  # 0..1: how sure the doctor is that this is the problem
    evidence: list[Evidence] = field(default_factory=list)
    culprit: str = ""
    fix: str = ""
    fate: bool = False  # how a run ended (run_state.py): ranked above the symptoms
    scope: str = ""  # the run dir a fate is about: findings merge only within one scope
    kb: str = ""  # the culprit's id in kb/culprits.json ("" for how a run ended, or an unknown error)
    seen: list[dict] = field(default_factory=list)  # known cases with this culprit: url, framework, title, ...
    also: list[str] = field(default_factory=list)  # the next most likely culprit ids (knowledge-base findings)

    def __post_init__(self):
        self.kb = self.kb or RULE_CULPRITS.get(self.id, "")

    @property
    def level(self) -> str:
        return "high" if self.confidence >= 0.75 else "medium" if self.confidence >= 0.5 else "low"

    def to_dict(self) -> dict:
        return {"id": self.id, "symptom": self.symptom, "confidence": round(self.confidence, 2),
                "level": self.level, "evidence": [{"where": e.where, "text": e.text} for e in self.evidence],
                "likely_culprit": self.culprit, "fix": self.fix, "culprit_id": self.kb or None,
                "seen_before": self.seen, "also_possible": self.also}


def merge_and_rank(findings: list[Finding]) -> list[Finding]:
    """One finding per id and scope (the most confident one's words, everyone's evidence): how runs
    ended first, then the symptoms, each group most confident first. Ties keep rule order, which lists
    the more specific rules first."""
    by_id: dict[tuple[str, str], Finding] = {}
    order: list[tuple[str, str]] = []
    for f in findings:
        key = (f.id, f.scope)
        if key not in by_id:
            by_id[key] = f
            order.append(key)
            continue
        kept, other = (f, by_id[key]) if f.confidence > by_id[key].confidence else (by_id[key], f)
        kept.evidence = kept.evidence + other.evidence
        by_id[key] = kept
    for f in by_id.values():
        seen, unique = set(), []
        for e in f.evidence:
            if (e.where, e.text) not in seen:
                seen.add((e.where, e.text))
                unique.append(e)
        f.evidence = unique[:MAX_EVIDENCE]
    return sorted((by_id[k] for k in order), key=lambda f: (not f.fate, -f.confidence))
