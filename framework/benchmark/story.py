"""What happened, in plain sentences: the benchmark's numbers read for a newcomer.

`what_happened` turns the summary of a benchmark (`framework.benchmark.report.summarize`) and the
measured cost models into one short paragraph per method and a verdict: what each method did
(drafted, accepted, declined), what a draft token cost next to a full step and how much of that
went before any layer ran (embedding, final norm, LM head), what the cost model says the method
could reach at its measured acceptance, and what acceptance layer skipping would need to pay on
this model. Every number comes from the run; nothing is said about a method the run did not show.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from framework.results.metrics import plan_for_skip_ratio
from framework.session.methods import BASELINE, RAW_SUFFIX

#: A speedup within this distance of 1.0 reads as "no faster and no slower" (the run-to-run noise
#: of a shared CPU is about that size).
EVEN = 0.03


def _x(v: float) -> str:
    return f"{v:.2f}x"


def _pct(v: float) -> str:
    return f"{100 * v:.0f}%"


def alpha_needed(cost: Any, skip_ratio: float, gain: float = 1.05, max_k: int = 16) -> float | None:
    """The smallest acceptance rate (0.01 steps) at which drafting with a plan of ``skip_ratio``
    reaches ``gain`` x plain decoding under ``cost`` (any draft length 1..max_k); ``None`` if even
    alpha = 1 does not."""
    plan = plan_for_skip_ratio(cost.num_layers, skip_ratio)
    for i in range(101):
        alpha = i / 100
        best = max(cost.expected_speedup(alpha, k, plan) for k in range(1, max_k + 1))
        if best >= gain:
            return alpha
    return None


def _draft_cost(cost: Any, skip_ratio: float) -> tuple[float, float]:
    """(a draft token, its part before any sub-layer) as shares of a full step."""
    plan = plan_for_skip_ratio(cost.num_layers, skip_ratio)
    return cost.draft_step(plan) / cost.step, cost.base / cost.step


def _forwards(e: Mapping[str, Any]) -> float:
    """Draft forwards per drafted token (0 for copied tokens; 1 when the summary does not say)."""
    f = e.get("forwards_per_draft_token")
    return 1.0 if f is None else f


def faster(s: float, e: Mapping[str, Any] | None = None) -> bool | None:
    """Whether a speedup ``s`` says the method is faster (True), slower (False) or neither
    (``None``), as its measurement allows: with several repeats every repeat must clear the noise
    band (`EVEN`), with one the speedup itself; a method whose gate declined 90% of the rounds or
    more decoded like vanilla, whatever its speedup."""
    e = e or {}
    gate = e.get("gate")
    if gate and gate.get("rounds") and gate["declined"] / gate["rounds"] >= 0.9:
        return None
    reps = [r for r in e.get("overall_by_repeat") or [] if r is not None]
    lo, hi = (min(reps), max(reps)) if len(reps) > 1 else (s, s)
    if lo >= 1.0 + EVEN:
        return True
    if hi <= 1.0 - EVEN:
        return False
    return None


def _speed_words(s: float, e: Mapping[str, Any] | None = None) -> str:
    verdict = faster(s, e)
    if verdict is True:
        return f"{_x(s)}: faster than vanilla"
    if verdict is False:
        return f"{_x(s)}: slower than vanilla"
    reps = [r for r in (e or {}).get("overall_by_repeat") or [] if r is not None]
    if len(reps) > 1 and (max(reps) >= 1.0 + EVEN or min(reps) <= 1.0 - EVEN):
        return (
            f"{_x(s)}: not told apart from vanilla (its repeats ran from {_x(min(reps))} to {_x(max(reps))})"
        )
    return f"{_x(s)}: as fast as vanilla, within noise"


def method_sentence(label: str, e: Mapping[str, Any], cost: Any = None) -> str | None:
    """One plain paragraph on what ``label`` did (``None`` for the baseline or a failed method)."""
    speed = e["speedup"].get("overall")
    if label == BASELINE or speed is None:
        return None
    gate = e.get("gate")
    declined = gate["declined"] / gate["rounds"] if gate and gate["rounds"] else None
    alpha, m = e.get("alpha"), e.get("M")
    parts = []
    if label.endswith(RAW_SUFFIX):
        parts.append(f"**{label}** (the same method with its draft gate off)")
    else:
        parts.append(f"**{label}**")
    if declined is not None and declined >= 0.9:
        parts.append(
            f"declined to draft in {_pct(declined)} of the rounds: its gate measured the acceptance and "
            "the cost of a draft and found that drafting would lose, so it decoded almost like vanilla"
        )
    elif not e.get("drafted"):
        parts.append("drafted nothing")
    elif alpha is not None and m is not None:
        txt = f"committed {m:.2f} tokens per verification, {_pct(alpha)} of its draft tokens accepted"
        if declined:
            txt += f" (the gate declined {_pct(declined)} of the rounds)"
        parts.append(txt)
    sentence = " ".join(parts) + f"; {_speed_words(speed, e)}."
    cm = e.get("cost_model")
    if cost is not None and cm and e.get("skip_ratio") is not None and (declined or 0.0) < 0.9:
        draft, before = _draft_cost(cost, e["skip_ratio"])
        if _forwards(e) >= 0.5:
            sentence += (
                f" A draft token cost {draft:.2f} of a full step ({before:.2f} of it before any layer ran: "
                f"embedding, final norm, LM head), so at {_pct(cm['alpha'])} acceptance the cost model's "
                f"best for a fixed draft length is {_x(cm['ceiling'])}"
                + (" (not drafting at all)" if cm["ceiling_k"] == 0 else f" (k = {cm['ceiling_k']})")
                + " (a controller that stops early where confidence is low can do better)."
            )
        else:
            sentence += (
                f" Most of its drafts were copied from the context (no forward pass), so a draft costs "
                f"little; the cost model's best for a fixed draft length at {_pct(cm['alpha'])} acceptance is "
                f"{_x(cm['ceiling'])}."
            )
    if e.get("mismatches"):
        sentence += (
            f" **{e['mismatches']} of {e['prompts']} prompts differ from vanilla greedy decoding** "
            "(see the notes under the table)."
        )
    return sentence


def what_happened(summary: Mapping[str, Any], costs: Mapping[str, Any] | None = None) -> str:
    """The paragraph under the benchmark's table: one sentence per method, the fastest method, and
    what layer skipping would need on this model (from the measured cost model).

    Args:
        summary: `framework.benchmark.report.summarize`'s result.
        costs: ``{method: CostModel}`` each method was priced with (``None``: no cost sentences).
    """
    # a cost model measured on a loaded machine predicts nothing (`CostModel.inconsistent`)
    costs = {k: c for k, c in (costs or {}).items() if c is not None and not getattr(c, "inconsistent", "")}
    methods = summary["methods"]
    lines = []
    for label, e in methods.items():
        s = method_sentence(label, e, costs.get(label))
        if s:
            lines.append(f"- {s}")
    ranked = [
        (e["speedup"]["overall"], label, e)
        for label, e in methods.items()
        if label != BASELINE and e["speedup"].get("overall") is not None
    ]
    if ranked:
        best, label, _ = max(ranked, key=lambda t: (t[0], t[1]))
        winners = [(s, lab) for s, lab, e in ranked if faster(s, e)]
        if winners:
            best, label = max(winners)
            lines.append(f"- Fastest here: **{label}** ({_x(best)}).")
        else:
            lines.append(f"- No method was measurably faster than vanilla here (best: {label}, {_x(best)}).")
    # What layer skipping would need: the layer-skip row with the most drafting and a cost model.
    skip_rows = [
        (label, e)
        for label, e in methods.items()
        if e.get("skip_ratio")
        and e.get("alpha") is not None
        and costs.get(label) is not None
        and _forwards(e) >= 0.5
    ]
    if skip_rows:
        label, e = max(skip_rows, key=lambda r: r[1].get("drafted", 0))
        cost = costs[label]
        need = alpha_needed(cost, e["skip_ratio"])
        draft, before = _draft_cost(cost, e["skip_ratio"])
        where = (
            f"- Where the time goes: a full step of this model takes {cost.step * 1e3:.1f} ms; a draft "
            f"that skips {_pct(e['skip_ratio'])} of the sub-layers still costs {draft:.2f} of it, "
            f"{before:.2f} before any layer runs."
        )
        if need is None:
            where += (
                " Even drafts that were always accepted would not make layer skipping 5% faster at this "
                "skip ratio; it needs cheaper drafts (more layers skipped at a high acceptance)."
            )
        else:
            where += (
                f" Layer skipping at this skip ratio needs about {_pct(need)} acceptance to be 5% faster "
                f"than vanilla at its best draft length; {label} measured {_pct(e['alpha'])}."
            )
            speed = e["speedup"].get("overall")
            rounds = (e.get("cost_model") or {}).get("rounds")
            if e["alpha"] >= need and speed is not None and speed < 1.0 and rounds is not None:
                where += (
                    f" That is enough in the cost model's ideal, but for the rounds {label} actually ran "
                    f"(the draft lengths its controller chose) the cost model predicts {_x(rounds)}, and it "
                    f"measured {_x(speed)}: the rest is the engine's own time per round."
                )
        lines.append(where)
    return "\n".join(lines)


__all__ = ["alpha_needed", "method_sentence", "what_happened"]
