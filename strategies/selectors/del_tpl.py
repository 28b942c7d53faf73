"""``del_tpl``: DEL's exit layer and draft length by Token-per-Layer from free shadow-token statistics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from framework import (
    Draft,
    LayerPlan,
    LayerSelector,
    LengthHint,
    ModelInfo,
    RoundView,
    Verification,
    register_selector,
)
from framework.config_fields import ConfigError, check_choice, check_range, param
from framework.search.budget import BudgetedWork, budget_param, check_budget


@dataclass(frozen=True)
class DelTplConfig:
    decay: float = param(0.95, help="omega: weight of a round one step older in the running sums; in (0, 1]")
    max_length: int = param(18, help="d_max: the longest draft length TPL considers; in [1, 64]")
    min_exit: int = param(1, help="smallest exit layer considered; in [1, L-1]")
    max_exit: int | None = param(None, help="largest exit layer considered; in [min_exit, L-1]; None = L-1")
    layer_stride: int = param(
        1,
        help="consider every layer_stride-th exit layer from min_exit (fewer shadow-token rows per "
        "round; not in the paper); in [1, 64]",
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
    work_budget: float = budget_param(
        "skip a round's statistics update (shadow tokens; the prompt initialisation is a unit too, "
        "generations included)"
    )

    def __post_init__(self) -> None:
        check_range("decay", self.decay, 0.0, 1.0, lo_open=True)
        check_range("max_length", self.max_length, 1, 64, integer=True)
        check_range("min_exit", self.min_exit, 1, None, integer=True)
        if self.max_exit is not None:
            check_range("max_exit", self.max_exit, self.min_exit, None, integer=True)
        check_range("layer_stride", self.layer_stride, 1, 64, integer=True)
        check_choice("alpha_denominator", self.alpha_denominator, ("window", "paper_literal"))
        check_choice("window", self.window, ("shadow", "accepted"))
        check_choice("cap_by_length", self.cap_by_length, (True, False))
        check_choice("no_draft_when_unprofitable", self.no_draft_when_unprofitable, (True, False))
        check_range("init_tokens", self.init_tokens, 0, 4096, integer=True)
        check_choice("init_reference", self.init_reference, ("target", "prompt"))
        check_choice("empty_mismatch", self.empty_mismatch, ("zero", "keep"))
        check_budget(self)


def tpl_table(alpha: torch.Tensor, layers: torch.Tensor, num_layers: int, max_length: int) -> torch.Tensor:
    """Token-per-Layer of every (exit layer, draft length): DEL Eq. 1.

    ``TPL(l, d) = sum_{i=0..d} alpha_l^i / (d * l + L)``: the expected tokens of a round that drafts
    d tokens with exit layer l (bonus included, i.i.d. acceptance) over the layers it loads. The
    geometric sum is computed directly, so alpha = 1 needs no special case.

    Args:
        alpha: (n,) acceptance estimates of the candidate layers.
        layers: (n,) the candidate exit layers l.
        num_layers: L.
        max_length: d_max.

    Returns:
        FloatTensor (n, d_max + 1) in float64; column 0 is 1/L.
    """
    a = alpha.double()[:, None]
    d = torch.arange(max_length + 1, dtype=torch.float64)[None]
    tokens = torch.cumsum(a.pow(d), dim=1)  # sum_{i<=d} a^i
    cost = d * layers.double()[:, None] + num_layers
    return tokens / cost


def choose_exit(
    alpha: torch.Tensor, layers: torch.Tensor, num_layers: int, max_length: int
) -> tuple[int, int, float]:
    """DEL's (E, d) = argmax TPL over the candidates.

    Drafting must beat plain decoding strictly (TPL(l, 0) = 1/L for every l), so when nothing does
    the length is 0; E is then the layer with the best TPL over d >= 1, so that next round's
    statistics follow the most promising exit. Ties go to the smaller layer, then the shorter draft.

    Returns:
        (exit layer, draft length, its TPL).
    """
    tab = tpl_table(alpha, layers, num_layers, max_length)
    best_per_layer, d_per_layer = tab[:, 1:].max(dim=1)  # first max: shorter draft on ties
    row = int(torch.argmax(best_per_layer))  # first max: smaller layer on ties
    e = int(layers[row])
    if float(best_per_layer[row]) > 1.0 / num_layers:
        return e, int(d_per_layer[row]) + 1, float(best_per_layer[row])
    return e, 0, 1.0 / num_layers


def _to_host(match: torch.Tensor, conf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A round's shadow matches and confidences (k, n each) in float64 on the host, where the
    statistics live: one device-to-host copy for both."""
    both = torch.stack([match.double(), conf.double()]).cpu()
    return both[0], both[1]


class ShadowStatistics:
    """DEL's exponentially decayed per-layer sums (DEL §4.2, Appendix A), in float64.

    Indexed by exit layer l = 0..L (entry 0 unused). After a round with window length ``n = u + 1``
    and, per layer, ``c`` shadow tokens matching the target, ``tcs``/``fcs`` the summed confidences
    of the matching / mismatching ones: ``S <- omega * S + value`` for each sum.
    """

    def __init__(self, num_layers: int, decay: float) -> None:
        self.decay = decay
        self.c = torch.zeros(num_layers + 1, dtype=torch.float64)
        self.tcs = torch.zeros(num_layers + 1, dtype=torch.float64)
        self.fcs = torch.zeros(num_layers + 1, dtype=torch.float64)
        self.n = 0.0  # decayed window lengths u + 1
        self.u = 0.0  # decayed u (the paper-literal denominator)
        self.tau = torch.zeros(num_layers + 1, dtype=torch.float64)
        self.guards = {"no_match": 0, "no_mismatch": 0}

    def update(self, layers: torch.Tensor, match: torch.Tensor, conf: torch.Tensor, n: int) -> None:
        """Add one round (or the prompt initialisation) and decay the history.

        Args:
            layers: (k,) the layers observed.
            match: BoolTensor (k, n): shadow token == target token in the window.
            conf: (k, n) top-1 probabilities of the shadow tokens.
            n: window length u + 1.
        """
        w = self.decay
        self.c.mul_(w)
        self.tcs.mul_(w)
        self.fcs.mul_(w)
        m = match.double()
        cf = conf.double()
        self.c[layers] += m.sum(dim=1)
        self.tcs[layers] += (cf * m).sum(dim=1)
        self.fcs[layers] += (cf * (1.0 - m)).sum(dim=1)
        self.n = w * self.n + n
        self.u = w * self.u + (n - 1)

    def alpha(self, layers: torch.Tensor, denominator: str = "window") -> torch.Tensor:
        """Acceptance estimates ``S(c) / S(u + 1)`` (or ``S(c) / S(u)``, paper-literal); 0 without data."""
        den = self.n if denominator == "window" else self.u
        if den <= 0:
            return torch.zeros(len(layers), dtype=torch.float64)
        return self.c[layers] / den

    def thresholds(
        self, layers: torch.Tensor, denominator: str = "window", keep_empty: bool = False
    ) -> torch.Tensor:
        """``tau_l = (S(tcs)/S(c) + S(fcs)/S(n - c)) / 2``, clamped to [0, 1], with the guards.

        No decayed match: matched mean := 1. No decayed mismatch: mismatched mean := 0, or the
        layer keeps its previous threshold (``keep_empty``). Updates and returns ``tau[layers]``.
        """
        den = self.n if denominator == "window" else self.u
        c = self.c[layers]
        mis = den - c
        eps = 1e-12
        matched = torch.where(c > eps, self.tcs[layers] / c.clamp_min(eps), torch.ones_like(c))
        mismatched = torch.where(mis > eps, self.fcs[layers] / mis.clamp_min(eps), torch.zeros_like(c))
        tau = (0.5 * (matched + mismatched)).clamp(0.0, 1.0)
        no_mis = mis <= eps
        if keep_empty:
            tau = torch.where(no_mis, self.tau[layers], tau)
        self.guards["no_match"] += int((c <= eps).sum())
        self.guards["no_mismatch"] += int(no_mis.sum())
        self.tau[layers] = tau
        return tau


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
        self._L = 0
        self._layers = torch.zeros(0, dtype=torch.long)
        # ``self.budget`` (BudgetedWork) caps the statistics' share of wall time; it spans
        # generations (`reset` resumes it)
        self.reset()

    # ------------------------------------------------------------------ set-up
    def setup(self, info: ModelInfo) -> None:
        c, n = self.config, info.num_layers
        if n < 2:
            raise ConfigError("--selector", "del_tpl", f"a model with at least 2 blocks (it has {n})")
        hi = n - 1 if c.max_exit is None else c.max_exit
        if not 1 <= c.min_exit <= n - 1:
            raise ConfigError(
                "--selector.min_exit", c.min_exit, f"in [1, {n - 1}] (the model has {n} blocks)"
            )
        if not c.min_exit <= hi <= n - 1:
            raise ConfigError(
                "--selector.max_exit", c.max_exit, f"in [{c.min_exit}, {n - 1}] (the model has {n} blocks)"
            )
        self._L = n
        self._layers = torch.arange(c.min_exit, hi + 1, c.layer_stride, dtype=torch.long)
        self.reset()

    def reset(self) -> None:
        self._stats = ShadowStatistics(self._L, self.config.decay) if self._L else None
        self._initialised = False
        self._exit = int(self._layers[0]) if len(self._layers) else 1
        self._length = 0
        self._tpl = 0.0
        self._hint: LengthHint | None = None
        self._trace: list[dict[str, Any]] = []
        self._loads0 = 0
        self._tokens = 0
        self._loads = 0
        self._seconds = 0.0
        self._rows = 0
        self._init_positions = 0
        # The budget spans generations, so that the prompt initialisation (once per generation)
        # is budgeted like the updates; the time between generations earns nothing.
        self.budget.resume()

    @property
    def candidate_layers(self) -> list[int]:
        return self._layers.tolist()

    @property
    def statistics(self) -> ShadowStatistics | None:
        return self._stats

    # ------------------------------------------------------------------ statistics
    def _shadow(
        self, state: RoundView, hidden: torch.Tensor, layers: torch.Tensor, *, target: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Shadow tokens and confidences (k, n) of ``hidden`` (L+1, n, d) at ``layers`` (k,): what
        a draft exiting there predicts, through the draft's head (``state.draft_head``), or with
        ``target`` what the target predicts (the full LM head)."""
        self._rows += int(len(layers) * hidden.shape[1])
        return state.top1_from_hidden(hidden[layers.to(hidden.device)], draft_head=not target)

    def _choose(self) -> None:
        c = self.config
        alpha = self._stats.alpha(self._layers, c.alpha_denominator)
        tau = self._stats.thresholds(self._layers, c.alpha_denominator, keep_empty=c.empty_mismatch == "keep")
        e, d, tpl = choose_exit(alpha, self._layers, self._L, c.max_length)
        self._exit, self._length, self._tpl = e, d, tpl
        threshold = float(tau[int((self._layers == e).nonzero()[0, 0])])
        if d == 0 and c.no_draft_when_unprofitable:
            cap = 0
        else:
            cap = d if (c.cap_by_length and d > 0) else c.max_length
        self._hint = LengthHint(max_length=cap, threshold=threshold, source="del_tpl")
        self._alpha_now = [round(float(a), 4) for a in alpha]

    def _initialise(self, state: RoundView) -> None:
        """Prompt initialisation (DEL §4.2): the last prompt positions as one all-valid round."""
        self._initialised = True
        hs = state.last_hidden_states
        p = state.prompt_len
        w = min(self.config.init_tokens, p - 1)
        # Over budget, the generation starts without statistics (its first rounds do not draft).
        if hs is not None and w > 0 and state.round == 0 and hs.shape[2] >= p and self.budget.allows():
            with self.budget.unit() as unit:
                h = hs[:, 0, p - w : p]  # (L+1, w, d)
                if self.config.init_reference == "target":
                    ref, _ = self._shadow(state, h, torch.tensor([self._L]), target=True)
                    ref = ref[0]
                else:
                    ref = state.tokens[0, p - w + 1 : p + 1]  # the next token of each position
                toks, conf = self._shadow(state, h, self._layers)
                self._stats.update(self._layers, *_to_host(toks == ref.to(toks.device)[None], conf), w)
                self._init_positions = w
            self._seconds += unit.seconds
        self._choose()

    # ------------------------------------------------------------------ interface
    def plan(self, state: RoundView) -> LayerPlan:
        if self._stats is None:
            raise RuntimeError("del_tpl: setup() was not called")
        if not self._initialised:
            self._initialise(state)
        self._loads0 = state.layer_loads
        self._trace.append(
            {
                "exit_layer": self._exit,
                "length": self._length,
                "max_length": self._hint.max_length,
                "threshold": round(self._hint.threshold, 4),
                "tpl": round(self._tpl, 5),
                "alpha": self._alpha_now,
            }
        )
        return state.prefix_plan(self._exit)

    def length_hint(self, state: RoundView) -> LengthHint | None:
        """This round's cap and threshold: the TPL choice made after the last verification."""
        return self._hint

    def observe(self, state: RoundView, draft: Draft, result: Verification) -> None:
        loads = state.layer_loads - self._loads0
        tokens = int(result.new_tokens.shape[1])
        self._tokens += tokens
        self._loads += loads
        if self._trace:
            self._trace[-1]["etpl"] = round(tokens / loads, 5) if loads else None
        hs = result.path_hidden  # (L+1, B, n, d): along the verified chain
        if hs is None:
            return
        # Over budget: this round never enters the decayed sums (they see fewer rounds), and E, d
        # and tau stay what the statistics so far chose.
        done = self.run_budgeted(self._update, state, result, hs)
        if done is not None:
            self._seconds += done[1]

    def _update(self, state: RoundView, result: Verification, hs: torch.Tensor) -> None:
        """One round's statistics: shadow tokens of ``hs`` (L+1, B, n, d), the verified chain
        (`Verification.path_hidden`), in the valid window, then next round's choice."""
        h = hs[:, 0]  # (L+1, n, d)
        e, L = self._exit, self._L
        if state.draft_head is None:  # one head call for both rows
            ends, end_conf = self._shadow(state, h, torch.tensor([e, L]))
            x_e, x_l = ends[0], ends[1]
        else:  # the draft's head at E, the target's full head at L
            x_e, end_conf = self._shadow(state, h, torch.tensor([e]))
            x_e = x_e[0]
            x_l = self._shadow(state, h, torch.tensor([L]), target=True)[0][0]
        diff = (x_e != x_l).nonzero()
        u = int(diff[0, 0]) if len(diff) else h.shape[1] - 1
        if self.config.window == "accepted":
            u = min(u, result.accepted)
        n = u + 1
        # Layer E's row is already known; the others only inside the window.
        is_e = self._layers == e
        others = self._layers[~is_e]
        toks = torch.empty(len(self._layers), n, dtype=torch.long, device=h.device)
        conf = torch.empty(len(self._layers), n, dtype=torch.float32, device=h.device)
        mask_e = is_e.to(h.device)
        if len(others):
            ot, oc = self._shadow(state, h[:, :n], others)
            toks[~mask_e], conf[~mask_e] = ot, oc
        if bool(is_e.any()):
            toks[mask_e], conf[mask_e] = x_e[:n], end_conf[0, :n]
        self._stats.update(self._layers, *_to_host(toks == x_l[None, :n], conf), n)
        self._choose()

    def summary(self) -> dict[str, Any]:
        if self._stats is None:
            return {}
        rounds = self._trace
        return {
            "etpl": round(self._tokens / self._loads, 5) if self._loads else None,
            "exit_layers": [r["exit_layer"] for r in rounds],
            "lengths": [r["length"] for r in rounds],
            "max_lengths": [r["max_length"] for r in rounds],
            "thresholds": [r["threshold"] for r in rounds],
            "expected_tpl": [r["tpl"] for r in rounds],
            "round_etpl": [r.get("etpl") for r in rounds],
            "alpha_layers": self.candidate_layers,
            "alpha": [r["alpha"] for r in rounds],
            "no_draft_rounds": sum(r["max_length"] == 0 for r in rounds),
            "init_positions": self._init_positions,
            "guards": dict(self._stats.guards),
            "shadow_rows": self._rows,
            "update_seconds": round(self._seconds, 6),
            **self.budget.summary(),
        }
