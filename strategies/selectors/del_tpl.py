"""``del_tpl``: DEL's exit layer and draft length by Token-per-Layer from free shadow-token statistics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from framework import (
    DeviceOps,
    Draft,
    LayerPlan,
    LayerSelector,
    LengthHint,
    ModelInfo,
    RoundView,
    Verification,
    register_selector,
)
from framework.config_fields import ConfigError, check_range, check_types, param
from framework.search.budget import BudgetedWork, budget_param, check_budget


@dataclass(frozen=True)
class DelTplConfig:
    decay: float = param(0.95, help="omega: weight of a round one step older in the running sums; in (0, 1]")
    max_length: int = param(18, help="d_max: the longest draft length TPL considers; in [1, 64]")
    min_exit: int = param(1, help="smallest exit layer considered; in [1, L-1]")
    max_exit: int | None = param(None, help="largest exit layer considered; in [min_exit, L-1]; None = L-1")
    layer_stride: int = param(
        1, help="consider every layer_stride-th exit layer from min_exit (not in the paper); in [1, 64]"
    )
    alpha_denominator: Literal["window", "paper_literal"] = param(
        "window",
        help="'window': alpha = S(c)/S(u+1), the corrected estimate in [0, 1]; 'paper_literal': "
        "S(c)/S(u) as printed (off by one)",
    )
    window: Literal["shadow", "accepted"] = param(
        "shadow",
        help="'shadow': the valid window ends at the first position where layer E's shadow token "
        "differs from the target's (paper); 'accepted': also at the verifier's rejection point",
    )
    cap_by_length: bool = param(
        False,
        help="cap each round's draft at the TPL-chosen length; False drafts up to max_length and "
        "lets the dynamic threshold stop it (full DEL)",
    )
    no_draft_when_unprofitable: bool = param(
        True,
        help="when no (layer, length >= 1) beats plain decoding's TPL 1/L, do not draft this round",
    )
    init_tokens: int = param(
        32, help="last prompt positions used to initialise the statistics (0: none); in [0, 4096]"
    )
    init_reference: Literal["target", "prompt"] = param(
        "target",
        help="reference tokens of the prompt initialisation: the full model's argmax ('target') or "
        "the actual next prompt token ('prompt')",
    )
    empty_mismatch: Literal["zero", "keep"] = param(
        "zero",
        help="threshold when a layer has no decayed mismatch yet: mismatched mean := 0 ('zero') or "
        "keep that layer's previous threshold ('keep')",
    )
    shadow_rows: Literal["chain", "window"] = param(
        "chain",
        help="how a round's shadow tokens are computed, on every device (the statistics are the same): "
        "'chain' scores every candidate over the whole chain on the device, the window applied there "
        "(no read of its own: the sums come with the verifier's read); 'window' finds the window's end "
        "first (a second read), then scores the candidates over the window only (fewest LM-head rows; "
        "on a CPU with the full head DEL decodes about 1.2x faster so, measured 2026-12-02). 'auto', "
        "the device-dependent choice of earlier versions, reads as 'chain'",
    )
    work_budget: float = budget_param(
        "skip a round's statistics update (shadow tokens; the prompt initialisation is a unit too, "
        "generations included)"
    )

    def __post_init__(self) -> None:
        if self.shadow_rows == "auto":  # a saved configuration of an earlier version
            object.__setattr__(self, "shadow_rows", "chain")
        check_types(self)
        check_range("decay", self.decay, 0.0, 1.0, lo_open=True)
        check_range("max_length", self.max_length, 1, 64, integer=True)
        check_range("min_exit", self.min_exit, 1, None, integer=True)
        if self.max_exit is not None:
            check_range("max_exit", self.max_exit, self.min_exit, None, integer=True)
        check_range("layer_stride", self.layer_stride, 1, 64, integer=True)
        check_range("init_tokens", self.init_tokens, 0, 4096, integer=True)
        check_budget(self)


def tpl_table(
    alpha: Sequence[float], layers: Sequence[int], num_layers: int, max_length: int
) -> list[list[float]]:
    """Token-per-Layer of every (exit layer, draft length): DEL Eq. 1, one row per candidate layer
    ``layers[i]`` with acceptance estimate ``alpha[i]``, columns d = 0..d_max (column 0 is 1/L).

    ``TPL(l, d) = sum_{i=0..d} alpha_l^i / (d * l + L)``: the expected tokens of a round that drafts
    d tokens with exit layer l (bonus included, i.i.d. acceptance) over the layers it loads. The
    geometric sum is accumulated term by term, so alpha = 1 needs no special case. Python floats:
    the statistics live on the host (a few tens of microseconds, no device work).
    """
    table = []
    for a, ell in zip(alpha, layers, strict=True):
        a, ell = float(a), int(ell)
        row, tokens, term = [], 0.0, 1.0
        for d in range(max_length + 1):
            tokens += term  # sum_{i<=d} a^i
            term *= a
            row.append(tokens / (d * ell + num_layers))
        table.append(row)
    return table


def choose_exit(
    alpha: Sequence[float], layers: Sequence[int], num_layers: int, max_length: int
) -> tuple[int, int, float]:
    """DEL's (E, d) = argmax TPL over the candidates: ``(exit layer, draft length, its TPL)``.

    Drafting must beat plain decoding strictly (TPL(l, 0) = 1/L for every l), so when nothing does
    the length is 0; E is then the layer with the best TPL over d >= 1, so that next round's
    statistics follow the most promising exit. Ties go to the smaller layer, then the shorter draft.
    """
    best, e, d = -1.0, int(layers[0]), 1
    for ell, row in zip(layers, tpl_table(alpha, layers, num_layers, max_length), strict=True):
        for length in range(1, max_length + 1):
            if row[length] > best:  # strictly: the first maximum wins
                best, e, d = row[length], int(ell), length
    if best > 1.0 / num_layers:
        return e, d, best
    return e, 0, 1.0 / num_layers


def window(diff: torch.Tensor) -> torch.Tensor:
    """DEL's valid window: the positions up to and including the first where layer E's shadow token
    differs from the target's (``diff``, BoolTensor (n,)), as a BoolTensor (n,), on the device."""
    return diff.cumsum(dim=0) <= diff  # no disagreement before the position


def prefix_sums(match: torch.Tensor, conf: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """One round's per-layer sums over the valid window (``valid`` (n,); ``None``: all n) of k
    layers' shadow tokens (``match`` (k, n): == the target's; ``conf`` (k, n): their top-1
    probabilities), on the device, for one read: FloatTensor (3k + 1, n), the matches ``c``, the
    matched confidence ``tcs`` and the mismatched ``fcs`` of each layer (k rows each), then the
    window length. Column j sums positions 0..j (``window = "accepted"`` takes the accepted count's
    column, the paper's window the last)."""
    w = torch.ones_like(conf[0]) if valid is None else valid.to(conf.dtype)
    hit = match * w
    return torch.cat([hit, conf * hit, conf * (w - hit), w[None]]).cumsum(dim=1)


@dataclass(frozen=True)
class RoundSums:
    """One round's sums over the valid window, by name: a column of `prefix_sums` for k layers.

    Attributes:
        matches: per layer, the shadow tokens matching the target (``c``).
        matched_conf: per layer, the summed top-1 probabilities of those matches (``tcs``).
        mismatched_conf: per layer, those of the mismatches (``fcs``).
        window: the window's length u + 1.
    """

    matches: tuple[float, ...]
    matched_conf: tuple[float, ...]
    mismatched_conf: tuple[float, ...]
    window: float

    @classmethod
    def of(cls, column: Sequence[float], k: int) -> RoundSums:
        """The sums of a column of `prefix_sums` (its rows: k matches, k matched and k mismatched
        confidences, then the window) read to the host."""
        c = [float(x) for x in column]
        return cls(tuple(c[:k]), tuple(c[k : 2 * k]), tuple(c[2 * k : 3 * k]), c[3 * k])


def column(sums: Sequence[float], rows: int, j: int) -> list[float]:
    """Column ``j`` of a (rows, n) table of `prefix_sums` read flat (row-major), ``j`` cut to n - 1."""
    n = len(sums) // rows
    j = min(j, n - 1)
    return [sums[r * n + j] for r in range(rows)]


def chain_sums(
    ops: DeviceOps, hidden: torch.Tensor, rows: torch.Tensor, exit_row: torch.Tensor
) -> dict[str, torch.Tensor]:
    """A round's `prefix_sums` over a whole verified chain ``hidden`` (L+1, n, d), the device work
    of DEL's statistics (`RoundView.compute`): the shadow tokens of the candidate layers ``rows``
    (k,) through the draft's head, the target's through the full head, the window ending where
    the exit layer (``exit_row``: its place among the candidates) first disagrees.
    ``{"sums": FloatTensor (3k + 1, n)}``."""
    toks, conf = ops.top1(hidden.index_select(0, rows), draft_head=True)  # (k, n)
    ref = ops.top1(hidden[-1])[0]  # the target's: layer L, the full head
    diff = toks.index_select(0, exit_row)[0] != ref  # layer E against the target
    return {"sums": prefix_sums(toks == ref, conf, window(diff))}


class ShadowStatistics:
    """DEL's exponentially decayed per-layer sums (DEL §4.2, Appendix A), as Python floats on the
    host (a round adds k + 1 numbers read at once; no device work).

    Indexed by exit layer l = 0..L (entry 0 unused). After a round with window length ``n = u + 1``
    and, per layer, ``c`` shadow tokens matching the target, ``tcs``/``fcs`` the summed confidences
    of the matching / mismatching ones: ``S <- omega * S + value`` for each sum.
    """

    def __init__(self, num_layers: int, decay: float) -> None:
        self.decay = decay
        self.c, self.tcs, self.fcs, self.tau = ([0.0] * (num_layers + 1) for _ in range(4))
        self.n = 0.0  # decayed window lengths u + 1
        self.u = 0.0  # decayed u (the paper-literal denominator)
        self.guards = {"no_match": 0, "no_mismatch": 0}

    def update(self, layers: Sequence[int], sums: Sequence[float]) -> None:
        """Add one round (or the prompt initialisation) and decay the history. ``sums``: a column
        of `prefix_sums` read to the host: per layer of ``layers`` (k) the shadow tokens matching
        the target in the window ``c``, the summed top-1 probabilities of those matches ``tcs`` and
        of the mismatches ``fcs``, then the window length u + 1."""
        w, got = self.decay, RoundSums.of(sums, len(layers))
        for acc in (self.c, self.tcs, self.fcs):
            acc[:] = [w * x for x in acc]
        for i, ell in enumerate(layers):
            self.c[ell] += got.matches[i]
            self.tcs[ell] += got.matched_conf[i]
            self.fcs[ell] += got.mismatched_conf[i]
        self.n = w * self.n + got.window
        self.u = w * self.u + (got.window - 1)

    def alpha(self, layers: Sequence[int], denominator: str = "window") -> list[float]:
        """Acceptance estimates ``S(c) / S(u + 1)`` (or ``S(c) / S(u)``, paper-literal); 0 without data."""
        den = self.n if denominator == "window" else self.u
        if den <= 0:
            return [0.0] * len(layers)
        return [self.c[ell] / den for ell in layers]

    def thresholds(
        self, layers: Sequence[int], denominator: str = "window", keep_empty: bool = False
    ) -> list[float]:
        """``tau_l = (S(tcs)/S(c) + S(fcs)/S(n - c)) / 2``, clamped to [0, 1], with the guards.

        No decayed match: matched mean := 1. No decayed mismatch: mismatched mean := 0, or the
        layer keeps its previous threshold (``keep_empty``). Updates and returns ``tau[layers]``.
        """
        den, eps, out = (self.n if denominator == "window" else self.u), 1e-12, []
        for ell in layers:
            c, mis = self.c[ell], den - self.c[ell]
            matched = self.tcs[ell] / c if c > eps else 1.0
            mismatched = self.fcs[ell] / mis if mis > eps else 0.0
            tau = min(1.0, max(0.0, 0.5 * (matched + mismatched)))
            self.guards["no_match"] += int(c <= eps)
            if mis <= eps:
                self.guards["no_mismatch"] += 1
                if keep_empty:
                    tau = self.tau[ell]
            self.tau[ell] = tau
            out.append(tau)
        return out


@register_selector("del_tpl", config=DelTplConfig)
class DelTplSelector(BudgetedWork, LayerSelector):
    """Choose next round's exit layer E and draft length by maximising Token-per-Layer.

    DEL (Entezari Zarch et al., 2025). After each verification the hidden states the verify pass
    already produced go through the final norm and LM head at every candidate layer (one chunked,
    batched call; no extra transformer block): these "shadow tokens" are what an exit at each
    layer would have drafted. Over the valid window (positions up to the first disagreement of
    layer E with the target) the per-layer matches and confidences enter decayed sums, which give
    alpha_l and a per-layer dynamic threshold tau_l. ``(E, d) = argmax TPL(l, d)``; the prompt's last
    ``init_tokens`` positions initialise the sums at the first round.

    The sums are what the selector `reads` of each verified chain (and of the prompt), with the
    round's one read, computed by one device function (`chain_sums`) on every device.

    The plan is an early exit at E (run by ``early_exit``, or by ``layer_skip``). Length and
    threshold reach the length controller as this round's `length_hint` (``del_dynamic`` uses it;
    other controllers ignore it). When no exit beats plain decoding the hint asks for no draft.
    With ``work_budget`` (an extension) a round's statistics update is skipped while the updates
    took more than that share of the wall time (generations included); the choice stays the last one
    made. Over budget, a generation starts without the prompt initialisation.
    """

    needs_hidden_states = True

    def __init__(self, config: DelTplConfig | None = None) -> None:
        super().__init__(config)
        self._L, self._layers = 0, list[int]()
        self.reset()

    # ------------------------------------------------------------------ set-up
    def setup(self, info: ModelInfo) -> None:
        c, n = self.config, info.num_layers
        if n < 2:
            raise ConfigError("--selector", "del_tpl", f"a model with at least 2 blocks (it has {n})")
        hi, blocks = n - 1 if c.max_exit is None else c.max_exit, f"(the model has {n} blocks)"
        if not 1 <= c.min_exit <= n - 1:
            raise ConfigError("--selector.min_exit", c.min_exit, f"in [1, {n - 1}] {blocks}")
        if not c.min_exit <= hi <= n - 1:
            raise ConfigError("--selector.max_exit", c.max_exit, f"in [{c.min_exit}, {n - 1}] {blocks}")
        self._L, self._layers = n, list(range(c.min_exit, hi + 1, c.layer_stride))
        self.reset()

    def reset(self) -> None:
        self._stats = ShadowStatistics(self._L, self.config.decay) if self._L else None
        self._initialised = False
        self._exit, self._length, self._tpl = (self._layers[0] if self._layers else 1), 0, 0.0
        self._hint: LengthHint | None = None
        self._trace: list[dict[str, Any]] = []
        self._loads0 = self._tokens = self._loads = self._rows = self._init_positions = 0
        self._seconds = 0.0
        self._sum_layers: list[int] = []  # the layers of the sums `reads` asked for, in their order
        self._read = 0  # rounds whose sums were read (with the verifier's read, or at the commit)
        self.budget.resume()  # it spans generations (the prompt initialisation is a unit too)

    @property
    def candidate_layers(self) -> list[int]:
        return list(self._layers)

    @property
    def statistics(self) -> ShadowStatistics | None:
        return self._stats

    # ------------------------------------------------------------------ statistics
    def _shadow(
        self, state: RoundView, hidden: torch.Tensor, layers: list[int], *, target: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Shadow tokens and confidences (len(layers), n) of ``hidden`` (L+1, n, d) at ``layers``:
        what a draft exiting there predicts (through the draft's head, ``state.draft_head``), and
        with ``target`` the target's tokens (n,) (layer L, the full LM head; else ``None``)."""
        self._rows += (len(layers) + target) * hidden.shape[1]
        rows = state.constant(list(layers))  # an index on the device, uploaded once
        toks, conf = state.top1_from_hidden(hidden[rows], draft_head=True)
        return toks, conf, state.top1_from_hidden(hidden[self._L])[0] if target else None

    def _choose(self) -> None:
        c = self.config
        alpha = self._stats.alpha(self._layers, c.alpha_denominator)
        tau = self._stats.thresholds(self._layers, c.alpha_denominator, keep_empty=c.empty_mismatch == "keep")
        e, d, tpl = choose_exit(alpha, self._layers, self._L, c.max_length)
        self._exit, self._length, self._tpl = e, d, tpl
        cap = d if (c.cap_by_length and d > 0) else c.max_length
        cap = 0 if d == 0 and c.no_draft_when_unprofitable else cap
        self._hint = LengthHint(max_length=cap, threshold=tau[self._layers.index(e)], source="del_tpl")
        self._alpha_now = [round(a, 4) for a in alpha]

    # ------------------------------------------------------------------ the statistics' reads
    def reads(self, state: RoundView, chain: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The sums to read with the round's one transfer (`prefix_sums`, by position): of the
        prompt's last ``init_tokens`` positions at the prefill (DEL §4.2's initialisation), then
        of each verified chain (L+1, B, n, d); one unit of the work budget each (``None`` when
        spent: the statistics then skip it, and E, d and tau stay what they were)."""
        prompt = not self._initialised
        if prompt:
            w = min(self.config.init_tokens, state.prompt_len - 1)
            if w <= 0 or chain.shape[2] < state.prompt_len:
                return None
        if not self.budget.allows():
            return None
        with self.budget.unit() as unit:
            h = chain[:, 0]
            sums = self._prompt_sums(state, h, w) if prompt else self._round_sums(state, h)
        self._seconds += unit.seconds
        self._read += not prompt
        return {"sums": sums}

    def _prompt_sums(self, state: RoundView, hs: torch.Tensor, w: int) -> torch.Tensor:
        """Prefix sums of the last ``w`` prompt positions (all valid) of the prefill's ``hs``
        (L+1, P, d), against the target's tokens or (``init_reference='prompt'``) each position's
        next token (the last one's is the first generated token)."""
        p, prompt = state.prompt_len, self.config.init_reference == "prompt"
        toks, conf, ref = self._shadow(state, hs[:, p - w : p], self._layers, target=not prompt)
        if prompt:
            ref = state.tokens[0, p - w + 1 : p + 1].to(toks.device)
        self._sum_layers, self._init_positions = list(self._layers), w
        return prefix_sums(toks == ref, conf)

    def _round_sums(self, state: RoundView, h: torch.Tensor) -> torch.Tensor:
        """Prefix sums of a verified chain ``h`` (L+1, n, d) over DEL's window (up to the first
        position where layer E's shadow token differs from the target's). ``shadow_rows`` says how
        (`DelTplConfig`); the sums are the same."""
        e, layers = self._exit, self._layers
        if self.config.shadow_rows == "chain":  # every candidate over the chain, the window on the device
            self._sum_layers = list(layers)
            self._rows += (len(layers) + 1) * h.shape[1]
            rows, exit_row = state.constant(list(layers)), state.constant([layers.index(e)])
            return state.compute(chain_sums, h, rows, exit_row)["sums"]
        # the window's end first (layer E and the target), then the other layers over it
        x_e, conf_e, ref = self._shadow(state, h, [e])
        n = int(window(x_e[0] != ref).sum())  # a read: the window's length
        others = [ell for ell in layers if ell != e]
        toks, conf, _ = self._shadow(state, h[:, :n], others, target=False)
        toks, conf = torch.cat([toks, x_e[:, :n]]), torch.cat([conf, conf_e[:, :n]])
        self._sum_layers = [*others, e]
        return prefix_sums(toks == ref[:n], conf)

    def _apply(self, sums: Sequence[float] | None, accepted: int | None) -> None:
        """A round's sums, read (`prefix_sums`: the column of ``accepted`` with
        ``window='accepted'``, else the window's), into the decayed statistics; then next round's
        choice. ``None``: nothing was read (over budget, no hidden states), nothing changes but
        the choice at the first round."""
        if sums is not None:
            clock, rows = self.budget.clock, 3 * len(self._sum_layers) + 1
            t0 = clock()
            j = accepted if accepted is not None and self.config.window == "accepted" else len(sums)
            self._stats.update(self._sum_layers, column(sums, rows, j))
            seconds = clock() - t0
            self.budget.charge(seconds)  # the host half of the unit whose device half `reads` timed
            self._seconds += seconds
            self._choose()
        elif accepted is None:
            self._choose()

    # ------------------------------------------------------------------ interface
    def plan(self, state: RoundView) -> LayerPlan:
        if self._stats is None:
            raise RuntimeError("del_tpl: setup() was not called")
        if not self._initialised:  # DEL §4.2: the last prompt positions as one all-valid round
            self._initialised = True
            self._apply(state.values_for(self).get("sums"), None)
        self._loads0, hint = state.layer_loads, self._hint
        trace = {"exit_layer": self._exit, "length": self._length, "max_length": hint.max_length}
        trace |= {"threshold": round(hint.threshold, 4), "tpl": round(self._tpl, 5), "alpha": self._alpha_now}
        self._trace.append(trace)
        return state.prefix_plan(self._exit)

    def length_hint(self, state: RoundView) -> LengthHint | None:
        """This round's cap and threshold: the TPL choice made after the last verification."""
        return self._hint

    def observe(self, state: RoundView, draft: Draft, result: Verification) -> None:
        loads, tokens = state.layer_loads - self._loads0, int(result.new_tokens.shape[1])
        self._tokens, self._loads = self._tokens + tokens, self._loads + loads
        if self._trace:
            self._trace[-1]["etpl"] = round(tokens / loads, 5) if loads else None
        self._apply(state.values_for(self).get("sums"), result.accepted)

    def summary(self) -> dict[str, Any]:
        if self._stats is None:
            return {}
        rounds, lists = (
            self._trace,
            {"exit_layers": "exit_layer", "lengths": "length", "max_lengths": "max_length"},
        )
        lists |= {"thresholds": "threshold", "expected_tpl": "tpl", "round_etpl": "etpl", "alpha": "alpha"}
        return {
            "etpl": round(self._tokens / self._loads, 5) if self._loads else None,
            **{name: [r.get(key) for r in rounds] for name, key in lists.items()},
            "alpha_layers": self.candidate_layers,
            "no_draft_rounds": sum(r["max_length"] == 0 for r in rounds),
            "init_positions": self._init_positions,
            "guards": dict(self._stats.guards),
            "shadow_rows": self._rows,
            "rounds_read": self._read,
            "update_seconds": round(self._seconds, 6),
            **self.budget.summary(),
        }
