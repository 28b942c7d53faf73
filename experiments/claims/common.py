"""The machinery every claim module shares: the run's context (model, prompts, vanilla references,
cost model, cached decodes), decoding one configuration and pricing its rounds, small statistics,
the `Claim` record and its verdict, loading a mode, and the markdown / JSON output."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from framework import REGISTRIES, LayerPlan
from framework.config_fields import build_config
from framework.data.prompts import calibration_texts, encode_chat, load_prompts, stop_token_ids
from framework.engine.adapter import adapter_for
from framework.engine.context import PrepareContext
from framework.engine.cost_model import CostModel
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.engine.state import DecodeState
from framework.results.compare import first_mismatch

from . import stats

#: How the report prints the command that re-runs one claim.
SCRIPT = "python experiments/reproduce.py"

MODES = {
    # prompts per category, new tokens per prompt (first turn only)
    "smoke": {"limit": 1, "max_new": 36},
    "quick": {"limit": 1, "max_new": 40},
    "full": {"limit": 3, "max_new": 128},
}


@dataclass
class Decoded:
    """A configuration decoded on a set of prompts (pooled)."""

    label: str
    results: list[Any]
    lossless: int
    checked: int
    modelled_speedup: float | None
    base: list[float] = field(default_factory=list)  # per prompt: plain-decoding seconds of its tokens
    time: list[float] = field(default_factory=list)  # per prompt: the cost model's seconds of its rounds

    @property
    def drafted(self) -> int:
        return sum(r.drafted for r in self.results)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.results)

    @property
    def alpha(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def M(self) -> float:
        rounds = sum(len(r.accept_lengths) for r in self.results)
        return sum(sum(r.accept_lengths) for r in self.results) / rounds if rounds else 0.0

    def counts(self) -> dict[str, list]:
        """Per-prompt counts (`stats.counts`): what the verdicts' bootstraps resample."""
        return stats.counts(
            [r.accepted for r in self.results],
            [r.drafted for r in self.results],
            self.base if self.time else None,
            self.time if self.time else None,
            [sum(r.accept_lengths) for r in self.results],
            [len(r.accept_lengths) for r in self.results],
        )

    def brief(self) -> dict[str, Any]:
        return {
            "alpha": round(self.alpha, 4),
            "M": round(self.M, 3),
            "drafted": self.drafted,
            "modelled_speedup": None if self.modelled_speedup is None else round(self.modelled_speedup, 4),
            "lossless": f"{self.lossless}/{self.checked}",
        }


@dataclass
class Ctx:
    """One run: the model and its prompts, the vanilla reference of every prompt, the cost model
    (measured on first use), and caches shared by the claims (decodes by configuration, committed
    states, ``memo`` for anything else), so claims that need the same decode pay for it once."""

    mode: str
    model: Any
    tokenizer: Any
    adapter: Any
    prompts: list[Any]
    ids: list[torch.Tensor]
    max_new: int
    eos: list[int]
    skip_set: str | None
    log: Callable[[str], None]
    cost: CostModel | None = None
    prepare_ctx: PrepareContext | None = None
    _vanilla: dict[int, Any] = field(default_factory=dict)
    _decoded: dict[str, Decoded] = field(default_factory=dict)
    _states: dict[tuple[int, bool], Any] = field(default_factory=dict)
    memo: dict[str, Any] = field(default_factory=dict)
    lossless_total: list[int] = field(default_factory=lambda: [0, 0])
    repeats: int = 1  # timed (vanilla, method) pairs per prompt
    n_random: int = 5  # random sets a "vs random sets" comparison decodes

    @property
    def L(self) -> int:
        return self.adapter.arch.num_layers

    @property
    def smoke(self) -> bool:
        return self.mode == "smoke"

    @property
    def full(self) -> bool:
        return self.mode == "full"

    def stop(self, max_new: int | None = None) -> StopCondition:
        return StopCondition(max_new or self.max_new, self.eos)

    def vanilla(self, i: int) -> Any:
        if i not in self._vanilla:
            self._vanilla[i] = VanillaDecoder(self.adapter).generate(self.ids[i], self.stop())
        return self._vanilla[i]

    def cost_model(self) -> CostModel:
        if self.cost is None:
            self.cost = self.prepare_ctx.cost_model()
            self.log(f"[reproduce] cost model: {self.cost.describe()}")
        return self.cost


def build(kind: str, name: str, **values: Any) -> Any:
    """The registered strategy ``name`` of ``kind`` with its config built from ``values``."""
    entry = REGISTRIES[kind].entry(name)
    return entry.cls(build_config(entry.config, values))


def static_spec(plan: LayerPlan) -> tuple[str, dict[str, Any]]:
    """The ``static`` selector configuration that drafts with ``plan``."""
    d = plan.describe()
    if not d["attn_skip"] and not d["mlp_skip"]:
        return ("static", {"skip_ratio": 0.0})
    return ("static", {"skip_attn": tuple(d["attn_skip"]), "skip_mlp": tuple(d["mlp_skip"])})


def modelled_time(cost: CostModel, res: Any) -> float:
    """Seconds the cost model gives the counted rounds of one decode (prefill excluded): each round
    priced by `CostModel.round_time` with the plan it drafted with (``res.plans`` holds one
    `LayerPlan.code` per drafting round; a round that drafted nothing is a plain step)."""
    full = LayerPlan.full(cost.num_layers)
    codes = iter(res.plans)
    t = 0.0
    for k in res.draft_lengths:
        t += cost.round_time(k, LayerPlan.from_code(next(codes)) if k else full)
    return t


def decode(
    ctx: Ctx,
    label: str,
    selector: tuple[str, dict],
    length: tuple[str, dict],
    drafter: tuple[str, dict] = ("layer_skip", {}),
    verifier: tuple[str, dict] = ("greedy", {}),
    prompts: list[int] | None = None,
    hook: Callable[[SpeculativeDecoder], None] | None = None,
) -> Decoded:
    """Decode ``prompts`` (default all) with one configuration; cached by configuration."""
    idx = list(range(len(ctx.ids))) if prompts is None else prompts
    key = json.dumps([selector, length, drafter, verifier, idx], sort_keys=True, default=str)
    if key in ctx._decoded and hook is None:
        return ctx._decoded[key]
    t0 = time.perf_counter()
    dec = SpeculativeDecoder(
        ctx.adapter,
        build("selector", selector[0], **selector[1]),
        build("length", length[0], **length[1]),
        build("drafter", drafter[0], **drafter[1]),
        build("verifier", verifier[0], **verifier[1]),
    )
    dec.prepare(ctx.prepare_ctx)
    if hook is not None:
        hook(dec)
    results, ok = [], 0
    for i in idx:
        ref = ctx.vanilla(i)
        res = dec.generate(ctx.ids[i], ctx.stop())
        results.append(res)
        ok += first_mismatch([res.tokens], [ref.tokens]) is None
    modelled, base, times = None, [], []
    if verifier[0] != "tree":
        cost = ctx.cost_model()
        base = [(r.new_tokens - 1) * cost.step for r in results]
        times = [modelled_time(cost, r) for r in results]
        modelled = sum(base) / sum(times) if sum(times) > 0 else None
    out = Decoded(label, results, ok, len(idx), modelled, base, times)
    ctx.lossless_total[0] += ok
    ctx.lossless_total[1] += len(idx)
    ctx._decoded[key] = out
    ctx.log(
        f"[reproduce]   {label}: alpha {out.alpha:.3f}, M {out.M:.2f}, modelled "
        f"{'n/a' if modelled is None else f'{modelled:.3f}x'}, lossless {ok}/{len(idx)} "
        f"({time.perf_counter() - t0:.0f} s)"
    )
    return out


def committed(ctx: Ctx, i: int, capture_hidden: bool = True) -> tuple[DecodeState, torch.Tensor | None]:
    """A state holding prompt ``i`` and its vanilla continuation, all committed (KV for every token
    but the last), and the full model's hidden states (L+1, n-1, d) of the generated positions
    (position P + j holds token j+1 of the continuation and predicts token j+2)."""
    capture_hidden = True  # one state per prompt serves every use
    key = (i, capture_hidden)
    if key in ctx._states:
        return ctx._states[key]
    toks = ctx.vanilla(i).tokens
    ids = ctx.ids[i]
    state = DecodeState(ctx.adapter, ids, ids.shape[1] + len(toks) + 80, capture_hidden=capture_hidden)
    state.prefill()
    state.append(torch.tensor([[toks[0]]], device=state.device))
    hidden = None
    if len(toks) > 1:
        block = torch.tensor([toks[:-1]], device=state.device)
        out = state.forward_verify(block, logits_at=None)
        state.cache.commit(len(toks) - 1)
        state.append(torch.tensor([toks[1:]], device=state.device))
        hidden = out.hidden_states[:, 0] if capture_hidden else None
    ctx._states[key] = (state, hidden)
    return state, hidden


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation of ``x`` and ``y`` (`stats.spearman`)."""
    return stats.spearman(x, y)


def fmt(x: float, nd: int = 3) -> str:
    return f"{x:.{nd}f}"


def monotone(xs: list[float], increasing: bool, tol: float = 0.0) -> bool:
    """Whether ``xs`` never steps against the direction by more than ``tol``."""
    pairs = list(zip(xs, xs[1:], strict=False))
    return all((b >= a - tol) if increasing else (b <= a + tol) for a, b in pairs)


def unimodal(xs: list[float], tol: float = 0.0) -> bool:
    """Whether ``xs`` rises to its maximum and falls after it (each side `monotone` within ``tol``)."""
    k = max(range(len(xs)), key=lambda i: xs[i])
    return monotone(xs[: k + 1], True, tol) and monotone(xs[k:], False, tol)


#: The verdicts of an empirical claim, and of an implementation check.
YES, PARTLY, NO, NOT_TESTABLE = "yes", "partly", "no", "not testable here"
PASS, FAIL = "pass", "fail"

#: How every rule reads (printed at the top of the report).
POLICY = (
    "yes: every part of the claim holds by its rule, each comparison with its 95% confidence interval "
    "excluding the contrary; partly: some parts hold, not all; no: none holds. Intervals are "
    "percentile bootstraps over prompts (2000 resamples, paired: every configuration of a comparison "
    "is resampled with the same prompts; comparisons against random sets resample the sets too), "
    "over tokens for per-token quantities, and over interleaved (vanilla, method) pairs for timed "
    "speed ratios. Thresholds come from the paper's own numbers; where the paper gives only a "
    "direction the rule asks for the direction, established by the interval."
)


@dataclass
class Claim:
    """One testable claim of a seed paper, or one check of this implementation.

    Attributes:
        id: the claim's id (``--claims``), unique over `experiments.claims.CLAIMS`.
        paper: which paper (or papers) make it.
        ref: where the reference notes number it (``R1``/``R2`` and the claim number).
        says: what the paper says, in one sentence.
        run: measures it on the run's `Ctx` and returns `measured` (what was measured and every
            number behind it, no verdict); ``None`` when not testable here.
        rule: the verdict rule, written from the paper's numbers before the run; `decide`
            implements exactly this sentence.
        decide: the rule as code: ``numbers -> (verdict, why)``, a pure function of the numbers
            ``run`` returned (the unit tests feed it synthetic ones). ``None``: no verdict is
            possible here (``untestable`` says why); the claim is measured for context only.
        kind: ``"claim"``, an empirical claim of the paper (counted in the tally), or
            ``"check"``, a check of this implementation's algebra or exactness (reported apart as
            "pass" / "fail", never counted).
        untestable: why not, when ``run`` or ``decide`` is ``None``.
        test: for a check, the unit test(s) that cover the same property.
    """

    id: str
    paper: str
    ref: str
    says: str
    run: Callable[[Ctx], dict[str, Any]] | None = None
    untestable: str = ""  # reason when run (or decide) is None
    rule: str = ""
    decide: Callable[[dict[str, Any]], tuple[str, str]] | None = None
    kind: str = "claim"
    test: str = ""

    @property
    def tallied(self) -> bool:
        """Whether its verdict counts in the report's tally (an empirical claim with a rule)."""
        return self.kind == "claim" and self.run is not None and self.decide is not None


def measured(text: str, numbers: dict[str, Any] | None = None, note: str = "") -> dict[str, Any]:
    """What a claim's ``run`` returns: what was measured (one line), every number behind it (what
    `Claim.decide` reads), and a note."""
    return {"measured": text, "numbers": numbers or {}, "note": note}


def verdict(
    measured: str, holds: str, numbers: dict[str, Any] | None = None, note: str = "", why: str = ""
) -> dict[str, Any]:
    """A claim's record: what was measured (one line), the verdict ("yes", "partly", "no", "not
    testable here"; "pass" / "fail" for a check), why (which parts of the rule held), every number
    behind it, and a note."""
    return {"measured": measured, "holds": holds, "why": why, "numbers": numbers or {}, "note": note}


def ternary(parts: dict[str, bool]) -> tuple[str, str]:
    """The common rule: yes if every part holds, partly if some do, no if none; ``why`` names them."""
    held = [k for k, v in parts.items() if v]
    failed = [k for k, v in parts.items() if not v]
    v = YES if not failed else (PARTLY if held else NO)
    why = "; ".join(
        ([f"holds: {', '.join(held)}"] if held else []) + ([f"fails: {', '.join(failed)}"] if failed else [])
    )
    return v, why


def graded(established: bool, point: bool, what: str) -> tuple[str, str]:
    """The rule of a one-part claim: yes if the interval establishes it, partly if only the point
    estimate agrees (the interval includes the contrary), no if the point estimate contradicts it."""
    if established:
        return YES, f"{what}: established (95% CI)"
    if point:
        return PARTLY, f"{what}: point estimate agrees, 95% CI does not exclude the contrary"
    return NO, f"{what}: the point estimate contradicts it"


def check(ok: bool, why: str = "") -> tuple[str, str]:
    """The verdict of an implementation check."""
    return (PASS if ok else FAIL), why


#: The adaptive exit threshold of Draft & Verify, as most claims decode with it.
ADAPTIVE = ("adaptive_confidence", {})

#: The papers (`Claim.paper`) and the reference files whose numbered claims `Claim.ref` cites.
SD, SW, CL, DE, BOTH = "Draft & Verify (Self-SD)", "SWIFT", "CLaSp", "DEL", "Self-SD + SWIFT"
R1, R2 = "seeds-selfsd-swift.md Part E", "seeds-clasp-del.md Part D"


#: Per mode: timed repeats per prompt and random sets per comparison (``--repeats``, ``--random-sets``).
MODE_DEFAULTS = {
    "smoke": {"repeats": 1, "n_random": 2},
    "quick": {"repeats": 2, "n_random": 5},
    "full": {"repeats": 3, "n_random": 8},
}


def load(
    mode: str,
    threads: int | None,
    skip_set: str | None,
    log,
    repeats: int | None = None,
    n_random: int | None = None,
    model: str | None = None,
) -> Ctx:
    """The `Ctx` of a mode (`MODES`): ``model`` (default: the embedded default model) and the
    built-in prompts, or in ``smoke`` mode an 8-block tiny random Llama, random prompts and a
    synthetic cost model."""
    if threads:
        torch.set_num_threads(threads)
    p = MODES[mode]
    prompts = load_prompts(limit=p["limit"])
    if mode == "smoke":
        from framework.testing import prepare_context, random_prompt, tiny_model, tiny_tokenizer

        model = tiny_model("llama", num_layers=8, seed=0)
        tok = tiny_tokenizer()
        adapter = adapter_for(model)
        prompts = prompts[:2]
        ids = [random_prompt(8 + 2 * i, 128, seed=i) for i in range(len(prompts))]
        pctx = prepare_context(adapter)
        eos: list[int] = []
    else:
        from framework.models.loading import load_model

        model, tok = load_model(model, "float32", "cpu")
        adapter = adapter_for(model)
        ids = [torch.tensor([encode_chat(tok, [{"role": "user", "content": q.turns[0]}])]) for q in prompts]
        eos = stop_token_ids(tok, getattr(model, "generation_config", None))
        pctx = PrepareContext(
            adapter=adapter,
            encode=lambda text: encode_chat(tok, [{"role": "user", "content": text}]),
            eos_token_ids=frozenset(eos),
            log=log,
            load_prompts=calibration_texts,
        )
    d = MODE_DEFAULTS[mode]
    return Ctx(
        mode,
        model,
        tok,
        adapter,
        prompts,
        ids,
        p["max_new"],
        eos,
        skip_set,
        log,
        prepare_ctx=pctx,
        repeats=repeats or d["repeats"],
        n_random=n_random or d["n_random"],
    )


def model_label(mode: str, model: str | None) -> str:
    """The model's name in the report (the headline and ``env``)."""
    if mode == "smoke":
        return "tiny random llama (8 blocks)"
    from framework.models.loading import DEFAULT_MODEL, MODELS

    name = model or DEFAULT_MODEL
    return re.split(r"[,(]", MODELS[name].description)[0].strip() if name in MODELS else name


def command(
    mode: str,
    cid: str,
    threads: int | None,
    skip_set: str | None,
    repeats: int | None = None,
    random_sets: int | None = None,
    model: str | None = None,
) -> str:
    """The command line that re-runs claim ``cid`` alone (printed in the report)."""
    parts = [SCRIPT, f"--claims {cid}"]
    if model:
        parts.append(f"--model {model}")
    if mode in ("full", "smoke"):
        parts.append(f"--{mode}")
    if threads:
        parts.append(f"--threads {threads}")
    if skip_set:
        parts.append(f"--skip-set {skip_set}")
    if repeats:
        parts.append(f"--repeats {repeats}")
    if random_sets:
        parts.append(f"--random-sets {random_sets}")
    return " ".join(parts)


def row_md(c: Claim, rec: dict[str, Any]) -> str:
    """The claim's row of the report's table."""
    return f"| `{c.id}` | {c.says} | {rec['measured']} | {rec['holds']} |"


def section_md(c: Claim, rec: dict[str, Any]) -> str:
    """The claim's paragraph of the report (paper, rule, measured, verdict and why, command)."""
    label = "Check" if c.kind == "check" else "Paper"
    lines = [f"**`{c.id}`** ({c.paper}; {c.ref}). *{label}:* {c.says}.", ""]
    if c.rule:
        lines += [f"*Rule:* {c.rule}", ""]
    lines += [f"*Measured:* {rec['measured']}.", ""]
    verdict_line = f"*Verdict:* **{rec['holds']}**" + (f" ({rec['why']})" if rec.get("why") else "") + "."
    if rec.get("note"):
        note = rec["note"]
        verdict_line += f" {note[:1].upper()}{note[1:]}."
    lines.append(verdict_line)
    if c.test:
        lines += ["", f"*Unit test:* {c.test}."]
    if rec.get("command"):
        lines += ["", f"`{rec['command']}`"]
    return "\n".join(lines)


def tally(claims: dict[str, Claim], records: list[dict[str, Any]]) -> dict[str, Any]:
    """The verdict counts of a run: empirical claims by verdict (tallied ones only), claims that
    could not be tested, and implementation checks passed / run."""
    counted = [r for r in records if claims[r["id"]].tallied and r["holds"] in (YES, PARTLY, NO)]
    untested = [r for r in records if claims[r["id"]].kind == "claim" and r not in counted]
    checks = [r for r in records if claims[r["id"]].kind == "check"]
    by = {v: [r["id"] for r in counted if r["holds"] == v] for v in (YES, PARTLY, NO)}
    return {
        "claims": len(counted),
        **by,
        "untested": [r["id"] for r in untested],
        "checks": len(checks),
        "checks_passed": [r["id"] for r in checks if r["holds"] == PASS],
        "checks_failed": [r["id"] for r in checks if r["holds"] != PASS],
    }


def headline(t: dict[str, Any], model: str, setting: str) -> str:
    """The report's headline sentence, generated from `tally` (never written by hand)."""

    def n(k: int, one: str, many: str) -> str:
        return f"{k} {one if k == 1 else many}"

    parts = [
        f"Of {n(t['claims'], 'empirical claim', 'empirical claims')} tested on {model} ({setting}), "
        f"{len(t[YES])} {'holds' if len(t[YES]) == 1 else 'hold'}, {len(t[PARTLY])} "
        f"{'holds' if len(t[PARTLY]) == 1 else 'hold'} partly and {len(t[NO])} "
        f"{'does' if len(t[NO]) == 1 else 'do'} not."
    ]
    if t["untested"]:
        parts.append(f"{n(len(t['untested']), 'more claim', 'more claims')} could not be tested in this run.")
    if t["checks"]:
        failed = t["checks_failed"]
        parts.append(
            f"{len(t['checks_passed'])} of {n(t['checks'], 'implementation check', 'implementation checks')} "
            f"(not claims, not counted) passed" + (f"; failed: {', '.join(failed)}." if failed else ".")
        )
    return " ".join(parts)


def jsonable(x: Any) -> Any:
    """``x`` as JSON-ready values: string keys, lists, plans described, tensors listed, floats
    rounded to 6 places."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, LayerPlan):
        return x.describe()
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, float):
        return round(x, 6)
    return x
