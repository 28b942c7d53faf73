"""strategies/selectors/del_tpl.py: the contract, Token-per-Layer with hand-checked maximisers, the
decayed shadow-token statistics (window vs paper-literal denominator, threshold guards), the
prompt initialisation, the free estimation, the no-draft fallback, and bad input."""

from __future__ import annotations

import pytest
import torch

from framework import LayerPlan, LengthHint, ModelInfo, Verification
from framework.config_fields import ConfigError, build_config
from framework.engine.adapter import adapter_for
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.engine.state import DecodeState
from framework.search.budget import WorkBudget
from framework.testing import FakeClock, LayerSelectorContract, random_prompt, tiny_model
from strategies.drafters.early_exit import EarlyExitDrafter, EarlyExitDrafterConfig
from strategies.length.del_dynamic import DelDynamicLength
from strategies.length.fixed import FixedLength, FixedLengthConfig
from strategies.selectors.del_tpl import (
    DelTplConfig,
    DelTplSelector,
    ShadowStatistics,
    choose_exit,
    prefix_sums,
    tpl_table,
    window,
)
from strategies.verifiers.greedy import GreedyVerifier


class TestDelDefaultContract(LayerSelectorContract):
    def make(self):
        return DelTplSelector()


class TestDelVariantsContract(LayerSelectorContract):
    num_layers = 6
    arch = "mistral"

    def make(self):
        return DelTplSelector(
            DelTplConfig(
                cap_by_length=True,
                alpha_denominator="paper_literal",
                window="accepted",
                min_exit=2,
                layer_stride=2,
                init_reference="prompt",
                empty_mismatch="keep",
                no_draft_when_unprofitable=False,
            )
        )


def _info(n: int) -> ModelInfo:
    return ModelInfo(num_layers=n, hidden_size=64, vocab_size=128, max_context=512)


def _early_exit_friendly(num_layers: int = 6, keep: int = 2, scale: float = 0.05, seed: int = 1):
    """A tiny model whose blocks after ``keep`` barely move the residual stream, so that exits at
    ``keep`` predict the full model's tokens well (what LayerSkip training achieves)."""
    m = tiny_model("llama", num_layers=num_layers, seed=seed)
    with torch.no_grad():
        for blk in m.model.layers[keep:]:
            blk.self_attn.o_proj.weight.mul_(scale)
            blk.mlp.down_proj.weight.mul_(scale)
    return adapter_for(m)


# ------------------------------------------------------------------------------ Token-per-Layer


def test_tpl_algebra():
    tab = tpl_table([0.0, 0.3, 0.8, 1.0], [1, 4, 8, 8], 32, 18)
    assert len(tab) == 4 and {len(row) for row in tab} == {19}
    assert [row[0] for row in tab] == [1 / 32] * 4  # vanilla
    assert tab[0] == [1 / (d * 1 + 32) for d in range(19)]  # alpha = 0: only the bonus token
    assert tab[3] == pytest.approx([(d + 1) / (d * 8 + 32) for d in range(19)])  # (d+1)/(d l + L)
    assert tab[2][5] == pytest.approx((1 - 0.8**6) / (0.2 * (5 * 8 + 32)))
    assert tab[1][3] == pytest.approx((1 + 0.3 + 0.09 + 0.027) / (3 * 4 + 32))
    # drafting one token beats none iff alpha_l > l / L
    for a, ell in ((0.26, 8), (0.24, 8), (0.5, 16), (0.51, 16)):
        one = tpl_table([a], [ell], 32, 1)[0]
        assert (one[1] > one[0]) == (a > ell / 32)
    with pytest.raises(ValueError):
        tpl_table([0.5, 0.5], [1], 32, 4)  # an estimate per layer


@pytest.mark.parametrize(
    ("L", "ell", "alpha", "best_d", "tpl"),
    [(32, 8, 0.8, 3, 0.0527), (32, 8, 0.9, 6, 0.0652), (32, 4, 0.6, 3, 0.0495), (16, 3, 0.5, 2, 0.0795)],
)
def test_tpl_worked_values(L, ell, alpha, best_d, tpl):
    """The reference's worked values (seeds-clasp-del.md, B.3)."""
    e, d, value = choose_exit([alpha], [ell], L, 18)
    assert (e, d) == (ell, best_d)
    assert value == pytest.approx(tpl, abs=5e-5)


def test_choose_exit_hand_computed():
    # L = 4, exits 1..3 with alpha 0.5, 0.9, 1.0 and d_max = 2:
    #   TPL(1,1) = 1.5/5  = .3000   TPL(1,2) = 1.75/6 = .2917
    #   TPL(2,1) = 1.9/6  = .3167   TPL(2,2) = 2.71/8 = .3388   <- the maximum
    #   TPL(3,1) = 2/7    = .2857   TPL(3,2) = 3/10   = .3000   (plain decoding: 1/4 = .25)
    e, d, tpl = choose_exit([0.5, 0.9, 1.0], [1, 2, 3], 4, 2)
    assert (e, d) == (2, 2) and tpl == pytest.approx(2.71 / 8)
    # only layer 4 of 8 is any good, and perfect: TPL(4, d) = (d+1)/(4d+8) grows with d
    alpha = [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert choose_exit(alpha, list(range(1, 8)), 8, 18) == (4, 18, pytest.approx(19 / 80))
    # alpha_l <= l / L everywhere: drafting never pays; E = the layer with the best d >= 1
    # (L = 10: TPL(1,1) = 1.05/11 = .0955, TPL(2,1) = 1.15/12 = .0958, TPL(3,1) = 1.25/13 = .0962)
    e, d, tpl = choose_exit([0.05, 0.15, 0.25], [1, 2, 3], 10, 18)
    assert (e, d) == (3, 0) and tpl == pytest.approx(0.1)
    # exactly alpha = l / L: TPL(2, 1) = 1.25/10 = 1/8 ties plain decoding, which wins
    assert choose_exit([0.25], [2], 8, 18)[1] == 0
    assert choose_exit([0.26], [2], 8, 18)[1] >= 1


# ------------------------------------------------------------------------------ statistics


def _add(st, layers, match, conf, n=None):
    """One round into ``st`` through the device-side sums, over every position (or the first n)."""
    match, conf = torch.as_tensor(match, dtype=torch.bool), torch.as_tensor(conf, dtype=torch.float32)
    if conf.dim() == 0:
        conf = conf.expand(match.shape)
    valid = torch.arange(match.shape[1]) < (match.shape[1] if n is None else n)
    st.update(layers, prefix_sums(match, conf, valid)[:, -1].tolist())


def test_prefix_sums_count_only_the_window():
    match = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    conf = torch.tensor([[0.5, 0.25, 0.75, 1.0], [0.125, 0.5, 0.25, 0.5]])
    sums = prefix_sums(match, conf, torch.tensor([True, True, True, False]))[:, -1].tolist()
    # layer 1: matches at 0 and 2 (0.5 + 0.75), a mismatch at 1 (0.25); layer 2: matches at 1, 2
    # (0.5 + 0.25), a mismatch at 0 (0.125); position 3 is outside the window
    assert sums == [2.0, 2.0, 1.25, 0.75, 0.25, 0.125, 3.0]


def test_window_vs_paper_literal_denominator():
    """After a round with a mismatch at u, layer E matched exactly u of the u+1 window positions:
    the paper's S(c)/S(u) gives alpha_E = 1, the corrected S(c)/S(u+1) gives u/(u+1); a fully
    matched round pushes the literal estimate above 1."""
    st = ShadowStatistics(4, decay=0.95)
    layers = [1, 2, 3]
    # window of 4 positions (u = 3); layer 2 = E matches the first 3, layer 1 none, layer 3 all
    _add(st, layers, [[0, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], 0.5)
    assert st.alpha(layers, "window") == [0.0, 0.75, 1.0]
    assert st.alpha(layers, "paper_literal") == pytest.approx([0.0, 1.0, 4 / 3])
    # a round with u = 0 adds nothing to the literal denominator: 0/0 before, guarded to 0
    fresh = ShadowStatistics(4, decay=0.95)
    _add(fresh, layers, [[1], [1], [1]], 0.9)
    assert fresh.alpha(layers, "paper_literal") == [0.0, 0.0, 0.0]
    assert fresh.alpha(layers, "window") == [1.0, 1.0, 1.0]


def test_decay_weights_rounds():
    st = ShadowStatistics(2, decay=0.5)
    one = [1]
    _add(st, one, [[True, True]], 1.0)  # round 1: 2 of 2
    _add(st, one, [[False, True]], 1.0, n=1)  # round 2: 0 of 1 (the second position is outside)
    # S(c) = 0.5 * 2 + 0 = 1, S(n) = 0.5 * 2 + 1 = 2
    assert st.alpha(one)[0] == pytest.approx(0.5)
    assert st.n == pytest.approx(2.0) and st.u == pytest.approx(0.5)
    assert st.tcs[1] == pytest.approx(1.0) and st.fcs[1] == pytest.approx(1.0)


def test_threshold_midpoint_and_guards():
    st = ShadowStatistics(3, decay=1.0)
    layers = [1, 2, 3]
    match = [[1, 1, 0], [1, 1, 1], [0, 0, 0]]
    conf = [[0.9, 0.7, 0.3], [0.8, 0.6, 0.4], [0.2, 0.1, 0.3]]
    _add(st, layers, match, conf)
    tau = st.thresholds(layers)
    # layer 1: (mean(.9, .7) + .3) / 2; layer 2 never mismatched: (mean(.8,.6,.4) + 0) / 2;
    # layer 3 never matched: (1 + mean(.2,.1,.3)) / 2
    assert tau == pytest.approx([0.55, 0.3, 0.6], abs=1e-6)
    assert st.guards == {"no_match": 1, "no_mismatch": 1}
    # "keep": a layer without mismatches keeps its previous threshold
    _add(st, layers, [[1], [1], [1]], 0.5)
    kept = st.thresholds(layers, keep_empty=True)
    assert kept[1] == pytest.approx(0.3)
    assert st.thresholds([1, 2, 3]) == st.tau[1:]  # the thresholds are kept per layer


# ------------------------------------------------------------------------------ on a model


def _round(state, sel, drafter, length, k_max=18):
    plan = sel.plan(state)
    k = max(0, min(length.max_length(state, sel.length_hint(state)), k_max))
    from framework import Draft

    draft = drafter.draft(state, plan, length, k) if k else Draft.empty(1, plan)
    res = GreedyVerifier().verify(state, draft)
    state.commit(res)
    sel.observe(state, draft, res)
    length.observe(state, draft, res)
    return plan, draft, res


def _new_state(adapter, prompt_len=20, seed=0, sel=None, head=None):
    """A generation's state after its prefill and first token, ``sel`` reading the prompt (its
    `reads`, served with the first token's read as the decoder serves them)."""
    state = DecodeState(
        adapter,
        random_prompt(prompt_len, 128, seed),
        128,
        capture_hidden=True,
        need_confidence=True,
        readers=() if sel is None else (sel,),
    )
    state.draft_head = head
    first = state.prefill().argmax(-1)[:, None]
    state.append(first)
    state.read(token=first[0])
    return state


def _shadow(adapter, h):
    return adapter.top1_from_hidden(h)


@pytest.mark.parametrize(("init_tokens", "reference"), [(32, "target"), (8, "target"), (8, "prompt")])
def test_prompt_initialisation(init_tokens, reference):
    adapter = _early_exit_friendly()
    sel = DelTplSelector(DelTplConfig(init_tokens=init_tokens, init_reference=reference))
    sel.setup(adapter.arch.info())
    state = _new_state(adapter, prompt_len=20, sel=sel)
    plan = sel.plan(state)
    w = min(init_tokens, 19)  # never position 0
    h = state.last_hidden_states[:, 0, 20 - w : 20]
    if reference == "target":
        ref = _shadow(adapter, h[6])[0]
    else:
        ref = state.tokens[0, 21 - w : 21]
    toks, _ = _shadow(adapter, h[1:6])
    want = ((toks == ref).double().sum(dim=1) / w).tolist()
    assert sel.statistics.alpha([1, 2, 3, 4, 5]) == pytest.approx(want)
    assert sel.summary()["init_positions"] == w
    e, d, _ = choose_exit(want, [1, 2, 3, 4, 5], 6, 18)
    assert plan == LayerPlan.from_indices(6, exit_layer=e) and sel.length_hint(state).max_length == (
        18 if d else 0
    )


def test_no_prompt_statistics_means_no_draft_first():
    adapter = _early_exit_friendly()
    for init_tokens, prompt_len in ((0, 20), (32, 1)):
        sel = DelTplSelector(DelTplConfig(init_tokens=init_tokens))
        sel.setup(adapter.arch.info())
        state = _new_state(adapter, prompt_len=prompt_len, sel=sel)
        sel.plan(state)
        # no statistics: alpha = 0 everywhere; the threshold guards give (1 + 0) / 2
        assert sel.length_hint(state) == LengthHint(max_length=0, threshold=0.5, source="del_tpl")
        assert sel.summary()["init_positions"] == 0


def _first_early_exit_round(head=None, **config):
    """One verified round of a 4-token early-exit draft with no prompt statistics (every alpha is 0,
    so E is the smallest candidate, 2), with ``head`` the generation's draft head; the selector has
    not observed it yet (its sums were read with the verification)."""
    adapter = _early_exit_friendly()
    sel = DelTplSelector(
        DelTplConfig(decay=1.0, init_tokens=0, min_exit=2, no_draft_when_unprofitable=False, **config)
    )
    sel.setup(adapter.arch.info())
    state = _new_state(adapter, seed=2, sel=sel, head=None if head is None else head(adapter))
    drafter = EarlyExitDrafter()
    drafter.setup(adapter.arch.info())
    plan = sel.plan(state)
    draft = drafter.draft(state, plan, FixedLength(FixedLengthConfig(k=4)), 4)
    res = GreedyVerifier().verify(state, draft)
    state.commit(res)
    return adapter, state, sel, draft, res


def test_statistics_update_is_free_and_matches_a_hand_count():
    """observe() runs no transformer block (only the LM head on stored states), and its counts
    equal the shadow tokens recomputed by hand from the verify pass's hidden states."""
    adapter, state, sel, draft, res = _first_early_exit_round()
    e = draft.plan.exit_layer
    assert e == 2
    assert 0 < res.accepted < 4  # a window that ends at a rejection
    evals, loads = adapter.executor.block_evals, adapter.executor.layer_loads
    sel.observe(state, draft, res)
    assert adapter.executor.block_evals == evals and adapter.executor.layer_loads == loads
    h = res.hidden_states[:, 0]  # (L+1, T, d)
    x_l = _shadow(adapter, h[6])[0]
    x_e = _shadow(adapter, h[e])[0]
    diff = (x_e != x_l).nonzero()
    u = int(diff[0, 0]) if len(diff) else h.shape[1] - 1
    assert u == res.accepted  # greedy drafting: the window ends where the draft was rejected
    toks = _shadow(adapter, h[2:6, : u + 1])[0]
    want = ((toks == x_l[: u + 1]).double().sum(dim=1) / (u + 1)).tolist()
    assert sel.statistics.alpha([2, 3, 4, 5]) == pytest.approx(want)
    assert want[0] == res.accepted / (res.accepted + 1)  # layer E matched up to the rejection
    # layers loaded: 4 draft steps of E blocks, then L - E blocks over the reused positions and E
    # for the one position the draft never fed: d * E + L, DEL's cost model
    assert sel.summary()["round_etpl"][0] == pytest.approx((res.accepted + 1) / (4 * e + 6), abs=1e-5)


def test_del_drafts_where_shallow_exits_agree_and_is_lossless():
    adapter = _early_exit_friendly()
    prompt = random_prompt(20, 128, 0)
    want = VanillaDecoder(adapter).generate(prompt, StopCondition(40)).tokens
    dec = SpeculativeDecoder(
        adapter,
        DelTplSelector(),
        DelDynamicLength(),
        EarlyExitDrafter(EarlyExitDrafterConfig(on_stop="drop")),
        GreedyVerifier(),
    )
    loads = adapter.executor.layer_loads
    res = dec.generate(prompt, StopCondition(40))
    loads = adapter.executor.layer_loads - loads - 6  # minus the prefill
    assert res.tokens == want
    s = res.strategy_summary["selector"]
    rounds = len(res.accept_lengths)
    for key in ("exit_layers", "lengths", "max_lengths", "thresholds", "expected_tpl", "round_etpl", "alpha"):
        assert len(s[key]) == rounds, key
    assert s["alpha_layers"] == [1, 2, 3, 4, 5] and all(len(a) == 5 for a in s["alpha"])
    assert set(s["exit_layers"]) == {2}  # the shallowest exit that agrees with the target
    assert res.accepted > 0 and s["no_draft_rounds"] == 0
    assert s["etpl"] == pytest.approx(sum(res.accept_lengths) / loads, abs=1e-5)
    assert s["etpl"] > 1 / 6  # more tokens per layer loaded than plain decoding
    assert res.strategy_summary["length"]["rounds_from_selector"] == rounds


def test_del_falls_back_to_plain_decoding_when_drafting_does_not_pay():
    """On a random tiny model no early exit agrees with the target often enough (alpha_l <= l/L):
    every round declines to draft, each costs exactly L layers per token (eTPL = 1/L)."""
    adapter = adapter_for(tiny_model("llama", num_layers=6, seed=1))
    prompt = random_prompt(40, 128, 0)
    dec = SpeculativeDecoder(
        adapter, DelTplSelector(), DelDynamicLength(), EarlyExitDrafter(), GreedyVerifier()
    )
    res = dec.generate(prompt, StopCondition(20))
    assert res.tokens == VanillaDecoder(adapter).generate(prompt, StopCondition(20)).tokens
    s = res.strategy_summary["selector"]
    assert res.drafted == 0 and s["no_draft_rounds"] == len(res.accept_lengths)
    assert all(a[i] <= (i + 1) / 6 for a in s["alpha"] for i in range(5))
    assert s["etpl"] == pytest.approx(1 / 6, abs=1e-5)  # the summary rounds to 5 decimals
    assert all(r == pytest.approx(1 / 6, abs=1e-5) for r in s["round_etpl"])


def test_cap_by_length_and_no_draft_options():
    adapter = _early_exit_friendly()
    for cfg, check in (
        (DelTplConfig(cap_by_length=True), lambda s: s["max_lengths"] == s["lengths"]),
        (DelTplConfig(max_length=5), lambda s: set(s["max_lengths"]) == {5}),
    ):
        dec = SpeculativeDecoder(
            adapter, DelTplSelector(cfg), DelDynamicLength(), EarlyExitDrafter(), GreedyVerifier()
        )
        res = dec.generate(random_prompt(20, 128, 1), StopCondition(30))
        assert check(res.strategy_summary["selector"])
        assert max(res.draft_lengths) <= max(res.strategy_summary["selector"]["max_lengths"])
    # without the fallback the hint still allows drafting when TPL says d = 0
    plain = adapter_for(tiny_model("llama", num_layers=6, seed=1))
    sel = DelTplSelector(DelTplConfig(no_draft_when_unprofitable=False))
    dec = SpeculativeDecoder(plain, sel, DelDynamicLength(), EarlyExitDrafter(), GreedyVerifier())
    res = dec.generate(random_prompt(40, 128, 0), StopCondition(12))
    s = res.strategy_summary["selector"]
    assert set(s["lengths"]) == {0} and set(s["max_lengths"]) == {18} and res.drafted > 0


def test_accepted_window_option():
    """window='accepted' also ends the window at the verifier's rejection point."""
    adapter = _early_exit_friendly()
    for kind, want_n in (("shadow", None), ("accepted", 1)):
        sel = DelTplSelector(
            DelTplConfig(init_tokens=0, window=kind, min_exit=2, max_exit=2, no_draft_when_unprofitable=False)
        )
        sel.setup(adapter.arch.info())
        state = _new_state(adapter, seed=2, sel=sel)  # a prompt whose first exit-2 draft is partly accepted
        drafter = EarlyExitDrafter()
        drafter.setup(adapter.arch.info())
        plan = sel.plan(state)
        assert plan.exit_layer == 2
        draft = drafter.draft(state, plan, FixedLength(FixedLengthConfig(k=4)), 4)
        res = GreedyVerifier().verify(state, draft)
        state.commit(res)
        assert res.accepted > 0  # so that the two windows differ
        # pretend the verifier rejected everything (as a sampling verifier may)
        fake = Verification(
            num_accepted=torch.tensor([0]), new_tokens=res.new_tokens[:, :1], hidden_states=res.hidden_states
        )
        sel.observe(state, draft, fake)
        n = sel.statistics.n
        assert n == (want_n if want_n is not None else res.accepted + 1)


def test_bad_input():
    with pytest.raises(
        ConfigError, match=r"^--selector\.min_exit must be in \[1, 3\] \(the model has 4 blocks\), got 4$"
    ):
        DelTplSelector(DelTplConfig(min_exit=4)).setup(_info(4))
    with pytest.raises(
        ConfigError, match=r"^--selector\.max_exit must be in \[1, 3\] \(the model has 4 blocks\), got 4$"
    ):
        DelTplSelector(DelTplConfig(max_exit=4)).setup(_info(4))
    with pytest.raises(ConfigError, match=r"max_exit must be an integer >= 3, got 2"):
        DelTplConfig(min_exit=3, max_exit=2)
    with pytest.raises(ConfigError, match=r"min_exit must be an integer >= 1, got 0"):
        DelTplConfig(min_exit=0)
    with pytest.raises(ConfigError, match=r"^--selector\.decay must be in \(0, 1\], got 0\.0$"):
        build_config(DelTplConfig, {"decay": "0"}, flag_prefix="--selector.")
    with pytest.raises(ConfigError, match=r"max_length must be an integer in \[1, 64\], got 0"):
        DelTplConfig(max_length=0)
    with pytest.raises(ConfigError, match="alpha_denominator must be one of window, paper_literal"):
        build_config(DelTplConfig, {"alpha_denominator": "literal"})
    with pytest.raises(ConfigError, match="at least 2 blocks"):
        DelTplSelector().setup(_info(1))
    sel = DelTplSelector(DelTplConfig(min_exit=2, max_exit=7, layer_stride=2))
    sel.setup(_info(8))
    assert sel.candidate_layers == [2, 4, 6]


# ------------------------------------------------------------------------------ the work budget


def _on_fake_clock(sel, monkeypatch, update_seconds: float) -> list[bool]:
    """Give ``sel`` a budget of its configured share on a fake clock where every decoding round
    takes 1 s and every statistics update ``update_seconds`` (the updates run for real); returns
    the budget's answer of every round, filled while decoding."""
    clock = FakeClock()
    sel.budget = WorkBudget(sel.config.work_budget, clock=clock)
    plan, sums, allows = sel.plan, sel._round_sums, sel.budget.allows
    answers: list[bool] = []

    def timed_plan(state):
        clock.t += 1.0
        return plan(state)

    def timed_sums(*args, **kwargs):
        out = sums(*args, **kwargs)
        clock.t += update_seconds
        return out

    monkeypatch.setattr(sel, "plan", timed_plan)
    monkeypatch.setattr(sel, "_round_sums", timed_sums)
    monkeypatch.setattr(sel.budget, "allows", lambda: answers.append(allows()) or answers[-1])
    return answers


def _del_decoder(adapter, sel):
    return SpeculativeDecoder(
        adapter,
        sel,
        DelDynamicLength(),
        EarlyExitDrafter(EarlyExitDrafterConfig(on_stop="drop")),
        GreedyVerifier(),
    )


def test_work_budget_skips_statistics_updates_and_keeps_choosing_from_the_rest(monkeypatch):
    adapter = _early_exit_friendly()
    prompt = random_prompt(20, 128, 0)
    sel = DelTplSelector(DelTplConfig(work_budget=0.25))
    dec = _del_decoder(adapter, sel)
    answers = _on_fake_clock(sel, monkeypatch, update_seconds=1.0)
    res = dec.generate(prompt, StopCondition(40))
    assert res.tokens == VanillaDecoder(adapter).generate(prompt, StopCondition(40)).tokens
    s = res.strategy_summary["selector"]
    rounds = len(res.accept_lengths)
    init, updates = answers[0], answers[1:]
    assert init and len(updates) == rounds  # the initialisation (a first unit) and every round's update
    assert 0 < sum(updates) < rounds and s["budget_skipped"] == answers.count(False)
    assert s["budget_units"] == sum(answers)  # the prompt initialisation, then the updates run
    assert s["update_seconds"] == sum(updates) * 1.0  # (the initialisation took no fake time)
    # A skipped update leaves the statistics, so the next round's choice, exactly as they were.
    for i in range(rounds - 1):
        if not updates[i]:
            for key in ("exit_layers", "lengths", "max_lengths", "thresholds", "alpha"):
                assert s[key][i + 1] == s[key][i], (key, i)
    # and DEL still works on what it saw: the shallow exit that agrees, drafting and accepting
    assert set(s["exit_layers"]) == {2} and res.accepted > 0 and s["no_draft_rounds"] == 0


def test_zero_work_budget_changes_nothing(monkeypatch):
    """Unlimited: every round's update runs however long it takes, exactly as without the budget."""
    adapter = _early_exit_friendly()
    prompt = random_prompt(20, 128, 1)
    want = _del_decoder(adapter, DelTplSelector()).generate(prompt, StopCondition(30))
    sel = DelTplSelector(DelTplConfig(work_budget=0.0))
    dec = _del_decoder(adapter, sel)
    answers = _on_fake_clock(sel, monkeypatch, update_seconds=1000.0)
    res = dec.generate(prompt, StopCondition(30))
    s, w = res.strategy_summary["selector"], want.strategy_summary["selector"]
    assert res.tokens == want.tokens and res.accept_lengths == want.accept_lengths
    for key in ("exit_layers", "lengths", "max_lengths", "thresholds", "alpha", "shadow_rows"):
        assert s[key] == w[key], key
    assert all(answers) and s["budget_skipped"] == 0 and s["budget_units"] == len(answers)


def test_the_budget_spans_generations_and_covers_the_prompt_initialisation(monkeypatch):
    """Over budget after a generation of expensive updates, the next generation starts without
    the prompt initialisation (no statistics: its first round does not draft), still lossless."""
    adapter = _early_exit_friendly()
    prompt = random_prompt(20, 128, 2)
    sel = DelTplSelector(DelTplConfig(work_budget=0.01))
    dec = _del_decoder(adapter, sel)
    answers = _on_fake_clock(sel, monkeypatch, update_seconds=100.0)
    first = dec.generate(prompt, StopCondition(20))
    assert first.strategy_summary["selector"]["init_positions"] > 0 and answers[0]
    asked = len(answers)
    second = dec.generate(prompt, StopCondition(20))
    s = second.strategy_summary["selector"]
    assert answers[asked] is False and s["init_positions"] == 0
    assert second.draft_lengths[0] == 0
    assert second.tokens == VanillaDecoder(adapter).generate(prompt, StopCondition(20)).tokens


@pytest.mark.parametrize("value", ["-0.1", "1.0", "nan"])
def test_bad_work_budget(value):
    with pytest.raises(ConfigError, match=r"^--selector\.work_budget must be in \[0, 1\), got "):
        build_config(DelTplConfig, {"work_budget": value}, flag_prefix="--selector.")


def test_shadow_tokens_use_the_draft_head_and_the_reference_the_full_head():
    """With a reduced draft head, the candidate exits' shadow tokens are what a draft with that head
    proposes, while the reference (layer L: what the target emits) keeps the full LM head."""
    from framework.engine.draft_head import DraftHead

    def head(adapter):
        return DraftHead(adapter, list(range(0, 128, 3)) + [1, 5, 7, 11, 13])

    adapter, state, sel, draft, res = _first_early_exit_round(head=head)
    e = draft.plan.exit_layer
    h = res.hidden_states[:, 0]
    x_l = _shadow(adapter, h[6])[0]
    sel.observe(state, draft, res)
    x_e = adapter.top1_from_hidden(h[e], head=state.draft_head)[0]
    diff = (x_e != x_l).nonzero()
    u = int(diff[0, 0]) if len(diff) else h.shape[1] - 1
    toks = adapter.top1_from_hidden(h[2:6, : u + 1], head=state.draft_head)[0]
    want = ((toks == x_l[: u + 1]).double().sum(dim=1) / (u + 1)).tolist()
    assert sel.statistics.alpha([2, 3, 4, 5]) == pytest.approx(want)
    full = ((_shadow(adapter, h[2:6, : u + 1])[0] == x_l[: u + 1]).double().sum(dim=1) / (u + 1)).tolist()
    assert want != pytest.approx(full)  # the head changed the statistics: not vacuous


@pytest.mark.parametrize("with_head", [False, True])
def test_a_rounds_statistics_in_one_read_or_two_with_the_same_result(with_head):
    """Issue 38, item 3 and issue 46, item 3. ``shadow_rows='chain'`` (CUDA's choice): the round's
    shadow tokens (every candidate layer and the target), its window and its sums are one device
    function (`chain_sums`, handed to `RoundView.compute`) whose prefix sums travel with the
    verifier's read: the round reads once. ``'window'`` (the CPU's) reads where the window ends
    first and runs the candidates over the window only. Both give the same statistics; the decayed
    sums and the TPL choice are Python floats either way."""
    from framework.engine.draft_head import DraftHead
    from framework.testing.host_work import count_host_work

    seen = {}
    for rows in ("chain", "window"):
        adapter = _early_exit_friendly()
        sel = DelTplSelector(
            DelTplConfig(
                decay=1.0, init_tokens=0, min_exit=2, no_draft_when_unprofitable=False, shadow_rows=rows
            )
        )
        sel.setup(adapter.arch.info())
        head = DraftHead(adapter, list(range(0, 128, 2))) if with_head else None
        state = _new_state(adapter, seed=2, sel=sel, head=head)
        drafter = EarlyExitDrafter()
        drafter.setup(adapter.arch.info())
        draft = drafter.draft(state, sel.plan(state), FixedLength(FixedLengthConfig(k=4)), 4)
        # the verification (its read carries the chain's sums: `LayerSelector.reads`), then observe
        with torch.inference_mode(), count_host_work() as work:
            res = GreedyVerifier().verify(state, draft)
            state.commit(res)
            sel.observe(state, draft, res)
        st = sel.statistics
        chain, n = res.path_hidden.shape[2], int(st.n)  # decay 1: the round's window
        assert chain == 5 and n < chain  # the window ends inside the chain
        if not with_head:
            assert n == res.accepted + 1  # at the rejection
        seen[rows] = (st.c, st.tcs, st.fcs, st.n, st.tau, st.guards, sel.length_hint(state))
        assert sel.summary()["rounds_read"] == 1  # the sums came with the verifier's read
        if rows == "chain":  # one read: the verifier's, with the sums
            assert work.reads == 1, work.host_reads.by_site
            # the verification's own (its block, the early-exit reuse's concatenations around its
            # forwards, the commit), the rows' uploads (2, once a generation), the read's casts
            # and concatenation: the shadow tokens, window and sums are one device function (a
            # graph on the graph route, not counted, like a forward)
            assert work.ops <= 25, work.by_op
            assert sel.summary()["shadow_rows"] == 5 * chain  # 4 candidates and L
        else:  # the window's length, then the verifier's read with the sums
            assert work.reads == 2, work.host_reads.by_site
            assert sel.summary()["shadow_rows"] == 2 * chain + 3 * n  # E and L, then the others
    for a, b in zip(seen["chain"][:3], seen["window"][:3], strict=True):
        assert a == pytest.approx(b)
    assert seen["chain"][3] == seen["window"][3]
    assert seen["chain"][4] == pytest.approx(seen["window"][4])
    assert seen["chain"][5:] == seen["window"][5:]


def test_chain_sums_take_the_window_of_the_exit_they_are_given():
    """`chain_sums` (the device function of the statistics) against a hand count, for every exit
    row: the window ends where that layer's shadow token first leaves the target's; every column
    of its prefix sums is the sums over the positions up to it."""
    from framework.testing import device_ops
    from strategies.selectors.del_tpl import chain_sums, prefix_sums

    adapter, state, sel, draft, res = _first_early_exit_round()
    h = res.hidden_states[:, 0]  # (L+1, T, d)
    layers = [1, 2, 3, 4, 5]
    toks, conf = adapter.top1_from_hidden(h[layers])
    ref = adapter.top1_from_hidden(h[6])[0]
    ops = device_ops(top1=lambda x, draft_head=False: adapter.top1_from_hidden(x))
    got = {}
    for i in range(len(layers)):
        out = chain_sums(ops, h, torch.tensor(layers), torch.tensor([i]))["sums"]
        valid = window(toks[i] != ref)
        torch.testing.assert_close(out[:, -1], prefix_sums(toks == ref, conf, valid)[:, -1])
        for j in range(h.shape[1]):
            torch.testing.assert_close(
                out[:, j],
                prefix_sums(toks[:, : j + 1] == ref[: j + 1], conf[:, : j + 1], valid[: j + 1])[:, -1],
            )
        torch.testing.assert_close(out, prefix_sums(toks == ref, conf, valid))
        got[i] = out[-1, -1].item()  # the window's length
    assert len(set(got.values())) > 1, got  # the exits' windows differ: the exit row matters


@pytest.mark.parametrize("work_budget", [0.0, 0.3])
def test_the_sums_reach_del_whether_they_travel_with_the_verifiers_read_or_not(monkeypatch, work_budget):
    """Issue 46, item 3. The prompt's sums travel with the prefill's read and each round's with
    the verifier's (`LayerSelector.reads`): one read a round. Where the verifier reads nothing the
    engine could join (here: `DecodeState.read` serves no strategy), the engine reads the sums
    itself at the commit: DEL has one code path, and its decisions are the same, to the bit, with
    the work budget deciding on the same rounds; only the reads differ."""
    from framework.testing.syncs import count_host_reads
    from strategies.verifiers.greedy import greedy_rule

    class ReadsByItself(GreedyVerifier):
        """A verifier written outside the project that reads its result itself."""

        def verify(self, state, draft):
            block = torch.cat([state.pending, draft.tokens], dim=1)
            out = state.forward_verify(block, logits_at="all")
            checked = greedy_rule(None, block, out.logits)
            k = int(checked["accepted"][0])  # its own read: nothing the engine can join
            return Verification(
                num_accepted=checked["accepted"],
                new_tokens=checked["target"][:, : k + 1],
                hidden_states=out.hidden_states,
            )

    adapter = _early_exit_friendly()
    prompt = random_prompt(20, 128, 3)

    def decode(verifier):
        sel = DelTplSelector(DelTplConfig(shadow_rows="chain", init_tokens=8, work_budget=work_budget))
        answers = _on_fake_clock(sel, monkeypatch, update_seconds=1.0)
        dec = SpeculativeDecoder(
            adapter,
            sel,
            DelDynamicLength(),
            EarlyExitDrafter(EarlyExitDrafterConfig(on_stop="drop")),
            verifier,
        )
        with torch.inference_mode(), count_host_reads() as reads:
            res = dec.generate(prompt, StopCondition(40))
        return res, reads.total, answers

    joined, joined_reads, joined_answers = decode(GreedyVerifier())
    apart, apart_reads, apart_answers = decode(ReadsByItself())
    s, w = joined.strategy_summary["selector"], apart.strategy_summary["selector"]
    rounds = len(joined.accept_lengths)
    assert joined.tokens == apart.tokens and joined.accept_lengths == apart.accept_lengths
    for key in ("exit_layers", "lengths", "max_lengths", "thresholds", "alpha", "guards", "rounds_read"):
        assert s[key] == w[key], key
    assert joined_answers == apart_answers and s["budget_units"] == w["budget_units"]
    updates = sum(joined_answers[1:])
    assert s["rounds_read"] == updates and s["init_positions"] == w["init_positions"] == 8
    assert (updates < rounds) == (work_budget > 0)
    # besides its own reads (the verifier's, its early-exit block check, the committed tokens'
    # that the joined verifier's one read brought), each update's sums at the commit
    assert apart_reads - joined_reads >= updates + rounds


def test_shadow_rows_is_the_same_on_every_device():
    """Issue 56: the shadow tokens' path is the configuration's, never the device's; the
    device-dependent 'auto' of a saved configuration reads as the default, 'chain'."""
    assert DelTplConfig().shadow_rows == "chain" and DelTplConfig(shadow_rows="auto").shadow_rows == "chain"
    assert DelTplConfig(shadow_rows="window").shadow_rows == "window"
    with pytest.raises(ConfigError, match="shadow_rows must be one of chain, window"):
        build_config(DelTplConfig, {"shadow_rows": "all"})


def test_the_chain_and_window_ways_decide_alike_over_a_generation_with_strided_exits():
    """Over a whole generation whose exit layer moves among strided candidates (min_exit 2,
    stride 2: the exit's row among them is not its layer number), the chain way (the window on
    the device, from the exit's row) and the window way (the window read first) keep the same
    statistics and make the same choices."""
    adapter = _early_exit_friendly()
    prompt = random_prompt(20, 128, 4)
    got = {}
    for rows in ("chain", "window"):
        sel = DelTplSelector(DelTplConfig(shadow_rows=rows, min_exit=2, layer_stride=2, init_tokens=8))
        res = _del_decoder(adapter, sel).generate(prompt, StopCondition(40))
        s = res.strategy_summary["selector"]
        got[rows] = (res.tokens, [s[k] for k in ("exit_layers", "lengths", "thresholds", "alpha")])
    assert got["chain"][0] == got["window"][0]
    assert got["chain"][1][0] == got["window"][1][0]  # the exits chosen
    for a, b in zip(got["chain"][1][1:], got["window"][1][1:], strict=True):
        flat = lambda xs: [y for x in xs for y in (x if isinstance(x, list) else [x])]  # noqa: E731
        assert flat(a) == pytest.approx(flat(b))
