"""Aggregating per-prompt records into the metrics the papers report (the report itself is
`framework.benchmark.report`, for one method as for several).

Definitions (``docs/concepts.md`` has the long form):

- tokens/s of a method in a category: mean over prompts of (new tokens / wall time), all turns;
- speedup: tokens/s of the method / tokens/s of vanilla on the same prompts (Spec-Bench's ratio of
  means), both measured in the same process, interleaved, after warm-up;
- M (mean accepted length): tokens committed per verification round, bonus token included;
- alpha (acceptance rate): accepted draft tokens / drafted tokens;
- skip ratio: mean fraction of sub-layers the draft skipped, over rounds that drafted;
- lossless: prompts whose every turn is token-identical to vanilla greedy decoding.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from framework.data.prompts import category_sort_key
from framework.types import LayerPlan
from framework.utils import align_markdown

PHASES = ("prefill", "draft", "verify", "select", "length", "commit")


def speedup(method_tokens_per_s: Sequence[float], baseline_tokens_per_s: Sequence[float]) -> float:
    """The speedup of a method over its baseline, as every table, tracker key and plot reports it:
    the ratio of the mean tokens/s over prompts (or repeats), each list one value per prompt; NaN
    when the baseline has no tokens/s to divide by."""
    m, b = method_tokens_per_s, baseline_tokens_per_s
    mean_b = sum(b) / len(b) if b else 0.0
    return (sum(m) / len(m) if m else 0.0) / mean_b if mean_b > 0 else float("nan")


@dataclass
class MethodStats:
    """Pooled statistics of one method over a set of prompts."""

    prompts: int = 0
    tokens_per_s: list[float] = field(default_factory=list)
    new_tokens: int = 0
    wall_time: float = 0.0
    rounds: int = 0
    committed: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_forwards: int = 0
    draft_forwards_known: bool = True
    skip_ratio_sum: float = 0.0
    skip_rounds: int = 0
    lossless: int = 0
    lossless_checked: int = 0
    timings: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, rec: dict[str, Any]) -> None:
        self.prompts += 1
        self.new_tokens += rec["new_tokens"]
        self.wall_time += rec["wall_time"]
        self.tokens_per_s.append(rec["new_tokens"] / rec["wall_time"] if rec["wall_time"] > 0 else 0.0)
        self.rounds += len(rec["accept_lengths"])
        self.committed += sum(rec["accept_lengths"])
        self.drafted += rec["drafted"]
        self.accepted += rec["accepted"]
        for t in rec["turns"]:
            if "draft_forwards" in t:
                self.draft_forwards += t["draft_forwards"]
            else:  # records of HF methods or older files
                self.draft_forwards_known = False
            self.skip_ratio_sum += sum(t.get("skip_ratios", []))
            self.skip_rounds += len(t.get("skip_ratios", []))
        if rec.get("lossless") is not None:
            self.lossless_checked += 1
            self.lossless += int(bool(rec["lossless"]))
        for k, v in rec.get("timings", {}).items():
            self.timings[k] += v

    @property
    def mean_tokens_per_s(self) -> float:
        return sum(self.tokens_per_s) / len(self.tokens_per_s) if self.tokens_per_s else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.committed / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def forwards_per_draft_token(self) -> float:
        """Draft forwards per drafted token: 1 for a model draft, 0 for a copy (prompt lookup),
        in between for a drafter that mixes both (hybrid); 1 when the records do not say."""
        if not self.drafted or not self.draft_forwards_known:
            return 1.0
        return self.draft_forwards / self.drafted

    @property
    def skip_ratio(self) -> float:
        return self.skip_ratio_sum / self.skip_rounds if self.skip_rounds else 0.0


def aggregate(
    records: Iterable[dict[str, Any]], baseline: str = "vanilla"
) -> dict[str, dict[str, MethodStats]]:
    """``{category or "overall": {method: MethodStats}}`` from per-prompt records."""
    out: dict[str, dict[str, MethodStats]] = defaultdict(lambda: defaultdict(MethodStats))
    for rec in records:
        for cat in (rec["category"], "overall"):
            out[cat][rec["method"]].add(rec)
    cats = sorted((c for c in out if c != "overall"), key=category_sort_key) + ["overall"]
    return {c: dict(out[c]) for c in cats if c in out}


def gate_counts(records: Sequence[dict[str, Any]]) -> dict[str, int] | None:
    """The draft gate's rounds and declined rounds summed over the turns of ``records`` (each turn
    records its generation's counters under ``strategy_summary.length.gate``), or ``None`` when
    no turn ran with a gate."""
    rounds = declined = 0
    seen = False
    for rec in records:
        for turn in rec.get("turns", []):
            gate = (turn.get("strategy_summary") or {}).get("length", {}).get("gate")
            if gate:
                seen = True
                rounds += int(gate.get("rounds", 0))
                declined += int(gate.get("declined", 0))
    return {"rounds": rounds, "declined": declined} if seen else None


def synthetic_note(p: float) -> str:
    """What a synthetic-acceptance method's numbers are (`framework.engine.synthetic`)."""
    return (
        f"synthetic acceptance P = {p:g}: every draft token accepted with probability {p:g} whatever the "
        "target says; its output is NOT the model's (not checked against vanilla, no answer files); its "
        "speed is the system's at that acceptance"
    )


def time_breakdown(records: list[dict[str, Any]], methods: Iterable[str]) -> str:
    """Where the time goes: share of wall time per phase, per method (overall)."""
    agg = aggregate(records)["overall"] if records else {}
    rows = [
        "| method | wall s | prefill | draft | verify | (LM head, inside prefill+draft+verify) | select | length | commit | other |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in methods:
        s = agg.get(name)
        if s is None or s.wall_time <= 0:
            continue
        t = s.timings

        def share(p: str, t=t, s=s) -> str:  # n/a: not timed (--phase-timing off, CUDA's default)
            if p not in t and ("decode" in t or p == "lm_head"):
                return "n/a"
            return f"{100 * t.get(p, 0.0) / s.wall_time:.1f}%"

        other = s.wall_time - sum(t.get(p, 0.0) for p in PHASES)
        cells = [share(p) for p in ("prefill", "draft", "verify", "lm_head", "select", "length", "commit")]
        cells.append("n/a" if "decode" in t else f"{100 * other / s.wall_time:.1f}%")
        rows.append(f"| {name} | {s.wall_time:.1f} | " + " | ".join(cells) + " |")
    return align_markdown("\n".join(rows))


def plan_for_skip_ratio(num_layers: int, skip_ratio: float) -> LayerPlan:
    """A plan skipping ``skip_ratio`` of the ``2 * num_layers`` sub-layers (only the count matters to
    the cost model): how a measured mean skip ratio is priced."""
    skipped = round(skip_ratio * 2 * num_layers)
    return LayerPlan.from_indices(num_layers, attn=range((skipped + 1) // 2), mlp=range(skipped // 2))


def cost_model_prediction(
    cost: Any, acceptance_rate: float, skip_ratio: float, forwards_per_token: float = 1.0
) -> dict[str, Any]:
    """What a `CostModel` predicts for a measured acceptance rate and skip ratio.

    The measured skip ratio becomes a plan skipping that many sub-layers (only the count matters
    to the cost model); alpha is capped at 1 (a tree verifier can accept more than it "drafted").
    ``forwards_per_token`` scales the draft step (`MethodStats.forwards_per_draft_token`): 0 prices
    a drafter that runs no forward (prompt lookup) as free.

    Returns:
        ``{"alpha", "skip_ratio", "ceiling", "ceiling_k", "drafting", "drafting_k"}``: the best
        speedup over draft lengths ``k = 0..16`` (`CostModel.ceiling`; ``k = 0`` is plain decoding,
        1.0) and the best over ``k = 1..16`` (what drafting at all can reach).
    """
    plan = plan_for_skip_ratio(cost.num_layers, skip_ratio)
    f = max(0.0, forwards_per_token)
    alpha = min(1.0, acceptance_rate)
    ceiling, k = cost.ceiling(alpha, plan, draft_scale=f)
    drafting, k_draft = max((cost.expected_speedup(alpha, j, plan, draft_scale=f), j) for j in range(1, 17))
    return {
        "alpha": alpha,
        "skip_ratio": skip_ratio,
        "ceiling": ceiling,
        "ceiling_k": k,
        "drafting": drafting,
        "drafting_k": k_draft,
    }


def rounds_prediction(cost: Any, records: Iterable[dict[str, Any]]) -> float | None:
    """The speedup a `CostModel` predicts for the rounds a method actually ran.

    Where `cost_model_prediction` bounds what any drafter could reach at the method's mean
    acceptance, this prices what the method did: every round of k drafted tokens costs k draft
    steps of the plan it drafted with (times the turn's draft forwards per drafted token: 0 for
    copied tokens) plus a verification of ``1 + k * width`` tokens (``width``: the turn's verified
    tokens per drafted token, 1 for a chain or when the record does not say), and plain decoding
    would have spent one step per committed token. Each round is priced at its own context (the
    turn's ``prompt_tokens`` plus the tokens committed before it; `CostModel.at_context`) when the
    record says the prompt's length. The measured speedup over this prediction is
    the engine's efficiency: how much of what the cost model says these rounds are worth the
    decode loop delivers (the prefill is in neither). ``None`` without rounds.
    """
    n = cost.num_layers
    full = LayerPlan.full(n)
    plans: dict[str, LayerPlan] = {}
    spent = plain = 0.0
    for rec in records:
        for t in rec.get("turns", []):
            lengths, commits = t.get("draft_lengths") or [], t.get("accept_lengths") or []
            if not commits:
                continue
            drafted = sum(lengths)
            scale = t["draft_forwards"] / drafted if drafted and "draft_forwards" in t else 1.0
            width = 1.0
            if drafted and t.get("verify_tokens"):
                width = max(1.0, (t["verify_tokens"] - len(commits)) / drafted)
            codes = iter(t.get("plans") or [])
            context = t.get("prompt_tokens") or 0  # 0: unknown (older records), the near context
            for i, c in enumerate(commits):
                here = cost.at_context(context) if t.get("prompt_tokens") else cost
                if i < len(lengths):
                    k, plan = lengths[i], full
                    if k:
                        code = next(codes, None)
                        plan = full if code is None else plans.setdefault(code, LayerPlan.from_code(code))
                    spent += here.round_time(k, plan, draft_scale=scale, width=width)
                plain += c * here.step
                context += c
    return plain / spent if spent > 0 else None


def compare_table(runs: dict[str, list[dict[str, Any]]], category: str = "overall") -> str:
    """One row per run: each method against the vanilla baseline measured in its own run.

    Args:
        runs: ``{label: records}``, e.g. one results JSONL per method.
        category: the category row to report (``overall`` by default).
    """
    rows = [
        "| method | prompts | vanilla tok/s | method tok/s | speedup | M | alpha | skip ratio | select share "
        "| lossless |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, records in runs.items():
        agg = aggregate(records).get(category, {})
        b = agg.get("vanilla")
        for name, m in agg.items():
            if name == "vanilla" or b is None:
                continue
            speed = speedup(m.tokens_per_s, b.tokens_per_s)
            lossless = f"{m.lossless}/{m.lossless_checked}" if m.lossless_checked else "n/a"
            # The selector's own time (optimisation, e.g. SWIFT's matchness passes) per wall time.
            select = m.timings.get("select", 0.0) / m.wall_time if m.wall_time else 0.0
            select_cell = (
                f"{100 * select:.1f}%" if "select" in m.timings or "decode" not in m.timings else "n/a"
            )
            rows.append(
                f"| {label if label == name else f'{label}: {name}'} | {m.prompts} | {b.mean_tokens_per_s:.2f} | "
                f"{m.mean_tokens_per_s:.2f} | {speed:.3f}x | {m.mean_accepted_length:.2f} | "
                f"{m.acceptance_rate:.3f} | {m.skip_ratio:.3f} | {select_cell} | {lossless} |"
            )
    return align_markdown("\n".join(rows))
