"""framework.interfaces: the ABCs and the typed data objects (LayerPlan, Draft, Verification)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from framework import (
    Draft,
    Drafter,
    LayerPlan,
    LayerSelector,
    LengthController,
    ModelInfo,
    Verification,
    Verifier,
)


@dataclass(frozen=True)
class _Cfg:
    a: int = 1


@dataclass(frozen=True)
class _OtherCfg:
    a: int = 1


ABSTRACT = {
    LayerSelector: "plan",
    LengthController: "max_length",
    Drafter: "draft",
    Verifier: "verify",
}


@pytest.mark.parametrize("abc", list(ABSTRACT), ids=lambda c: c.__name__)
def test_abstract_raises(abc):
    with pytest.raises(TypeError):
        abc(_Cfg())


@pytest.mark.parametrize("abc, method", list(ABSTRACT.items()), ids=lambda c: getattr(c, "__name__", c))
def test_subclass_missing_abstract_method_fails_at_construction(abc, method):
    incomplete = type("Incomplete", (abc,), {"Config": _Cfg})
    with pytest.raises(TypeError, match=method):
        incomplete()
    complete = type("Complete", (abc,), {"Config": _Cfg, method: lambda self, *a, **k: None})
    inst = complete()
    assert isinstance(inst.config, _Cfg)


def test_strategy_config_handling():
    cls = type("S", (LengthController,), {"Config": _Cfg, "max_length": lambda self, state, hint=None: 3})
    assert cls().config == _Cfg()
    cfg = _Cfg(a=5)
    assert cls(cfg).config is cfg
    with pytest.raises(TypeError, match="expects a _Cfg"):
        cls(_OtherCfg())
    no_cfg = type("N", (LengthController,), {"max_length": lambda self, state, hint=None: 3})
    with pytest.raises(TypeError, match="has no Config"):
        no_cfg()


def test_default_hooks():
    cls = type("S", (LengthController,), {"Config": _Cfg, "max_length": lambda self, state, hint=None: 3})
    inst = cls()
    assert inst.should_continue(1, None) is True
    assert inst.summary() == {}
    assert LayerSelector.needs_hidden_states is False
    assert LengthController.needs_confidence is False
    assert Verifier.needs_draft_probs is False
    v = type("V", (Verifier,), {"Config": _Cfg, "verify": lambda self, s, d: None})()
    logits = torch.tensor([[0.1, 0.9, 0.3], [2.0, -1.0, 1.0]])
    assert v.choose(logits).tolist() == [1, 0]


# ----------------------------------------------------------------------------------- LayerPlan


def test_full_plan():
    p = LayerPlan.full(5)
    assert p.num_layers == 5 and p.blocks_run == 5
    assert p.num_skipped == 0 and p.skip_ratio == 0.0 and p.is_full
    assert p.to_bits() == (0,) * 10
    assert all(p.runs_attn(i) and p.runs_mlp(i) for i in range(5))


def test_from_indices():
    p = LayerPlan.from_indices(4, attn=[1, 3], mlp=(0,))
    assert p.attn_skip == (False, True, False, True)
    assert p.mlp_skip == (True, False, False, False)
    assert p.num_skipped == 3 and p.skip_ratio == 3 / 8 and not p.is_full
    assert p.to_bits() == (0, 1, 0, 1, 1, 0, 0, 0)
    assert p.describe() == {"attn_skip": [1, 3], "mlp_skip": [0], "exit_layer": None, "skip_ratio": 0.375}


@pytest.mark.parametrize("attn, mlp, bad", [([4], [], "[4]"), ([], [-1], "[-1]"), ([0, 7], [5], "[5, 7]")])
def test_from_indices_out_of_range(attn, mlp, bad):
    with pytest.raises(ValueError) as exc:
        LayerPlan.from_indices(4, attn=attn, mlp=mlp)
    assert bad in str(exc.value) and "0..3" in str(exc.value)


def test_exit_layer_counts_skipped():
    p = LayerPlan.from_indices(4, attn=[0], exit_layer=2)
    assert p.blocks_run == 2
    # blocks 2 and 3 are exited (4 sub-layers) + attention 0
    assert p.num_skipped == 5 and p.skip_ratio == 5 / 8
    assert p.to_bits() == (1, 0, 1, 1, 0, 0, 1, 1)
    assert not p.runs_attn(2) and not p.runs_mlp(3) and p.runs_mlp(0) and p.runs_attn(1)
    # a skip flag beyond the exit is not double-counted
    q = LayerPlan.from_indices(4, attn=[3], mlp=[3], exit_layer=3)
    assert q.num_skipped == 2
    assert LayerPlan.from_indices(4, exit_layer=4).num_skipped == 0


@pytest.mark.parametrize("exit_layer", [0, 5, -1])
def test_bad_exit_layer(exit_layer):
    with pytest.raises(ValueError, match="exit_layer must be in"):
        LayerPlan.from_indices(4, exit_layer=exit_layer)


def test_mismatched_lengths_rejected():
    with pytest.raises(ValueError, match="one entry per block"):
        LayerPlan((False, True), (False,))


def test_from_bits_errors_and_layout():
    with pytest.raises(ValueError, match="2L entries"):
        LayerPlan.from_bits([0, 1, 0])
    p = LayerPlan.from_bits([1, 0, 0, 0, 1, 1])  # z[i] attention of block i, z[L+i] its MLP
    assert p.attn_skip == (True, False, False) and p.mlp_skip == (False, True, True)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.integers(1, 8).flatmap(
        lambda n: st.tuples(
            st.lists(st.booleans(), min_size=2 * n, max_size=2 * n), st.none() | st.integers(1, n)
        )
    )
)
def test_bits_round_trip(args):
    bits, exit_layer = args
    n = len(bits) // 2
    p = LayerPlan.from_bits(bits)
    assert p.to_bits() == tuple(int(b) for b in bits)
    assert LayerPlan.from_bits(p.to_bits()) == p
    assert p.num_skipped == sum(bits)
    q = LayerPlan.from_bits(bits, exit_layer=exit_layer)
    # to_bits marks exited blocks skipped: the plan without exit_layer built from them is equivalent
    r = LayerPlan.from_bits(q.to_bits())
    assert r.to_bits() == q.to_bits() and r.num_skipped == q.num_skipped
    assert all(r.runs_attn(i) == q.runs_attn(i) and r.runs_mlp(i) == q.runs_mlp(i) for i in range(n))
    assert q.skip_ratio == q.num_skipped / (2 * n)
    assert 0.0 <= q.skip_ratio <= 1.0


def test_layer_plan_frozen_and_hashable():
    p = LayerPlan.from_indices(3, attn=[1])
    with pytest.raises(AttributeError):
        p.exit_layer = 2  # type: ignore[misc]
    assert p == LayerPlan.from_indices(3, attn=[1]) and hash(p) == hash(LayerPlan.from_indices(3, attn=[1]))


# ----------------------------------------------------------------------------- Draft & friends


def test_draft_and_verification_objects():
    plan = LayerPlan.full(2)
    d = Draft(torch.tensor([[3, 4, 5]]), plan)
    assert d.length == 3 and d.confidences is None and d.probs is None and d.source == ""
    e = Draft.empty(1, plan)
    assert e.length == 0 and e.tokens.shape == (1, 0) and e.tokens.dtype == torch.long
    v = Verification(num_accepted=torch.tensor([2]), new_tokens=torch.tensor([[3, 4, 9]]))
    assert v.accepted == 2 and v.kv_keep is None
    v2 = Verification(num_accepted=torch.tensor([1, 2]), new_tokens=torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="batch size 1"):
        _ = v2.accepted


def test_verification_exposes_the_committed_positions():
    """`kept_offsets`, `path_hidden` and `last_hidden` for a chain and for a tree (kv_keep)."""
    L, T, d = 2, 4, 3
    hs = torch.arange((L + 1) * T * d, dtype=torch.float64).reshape(L + 1, 1, T, d)
    chain = Verification(torch.tensor([1]), torch.tensor([[3, 9]]), hidden_states=hs)
    assert chain.kept_offsets.tolist() == [0, 1]
    assert torch.equal(chain.path_hidden, hs)  # a chain: every verified position
    assert torch.equal(chain.last_hidden, hs[:, :, 1])
    tree = Verification(
        torch.tensor([2]), torch.tensor([[3, 4, 9]]), kv_keep=torch.tensor([0, 2, 3]), hidden_states=hs
    )
    assert tree.kept_offsets.tolist() == [0, 2, 3]
    assert torch.equal(tree.path_hidden, hs[:, :, [0, 2, 3]])
    assert torch.equal(tree.last_hidden, hs[:, :, 3])
    bare = Verification(torch.tensor([0]), torch.tensor([[5]]))
    assert bare.kept_offsets.tolist() == [0] and bare.path_hidden is None and bare.last_hidden is None


def test_optional_hooks_default_to_nothing():
    sel = type("S", (LayerSelector,), {"Config": _Cfg, "plan": lambda self, state: None})()
    assert sel.length_hint(None) is None
    ver = type("V", (Verifier,), {"Config": _Cfg, "verify": lambda self, state, draft: None})()
    assert ver.observe(None, None, None) is None


def test_model_info_defaults():
    info = ModelInfo(num_layers=4, hidden_size=64, vocab_size=128, max_context=512)
    assert info.dtype == torch.float32 and info.device == torch.device("cpu") and info.name == ""


# ------------------------------------------------------------- framework.testing contract mixins
# The mixins are what researchers' own tests inherit: check that they have teeth, i.e. that a
# strategy breaking the interface contract fails them.


def _contract_for(mixin, instance_factory):
    return type("TestBroken", (mixin,), {"make": lambda self: instance_factory()})()


def test_contract_rejects_plan_of_wrong_size():
    from framework.testing import LayerSelectorContract

    class WrongSize(LayerSelector):
        Config = _Cfg

        def plan(self, state):
            return LayerPlan.full(state.info.num_layers + 1)

    with pytest.raises(AssertionError):
        _contract_for(LayerSelectorContract, WrongSize).test_plan_is_valid_layer_plan()


def test_contract_rejects_negative_max_length():
    from framework.testing import LengthControllerContract

    class Negative(LengthController):
        Config = _Cfg

        def max_length(self, state, hint=None):
            return -1

    with pytest.raises(AssertionError):
        _contract_for(LengthControllerContract, Negative).test_max_length_is_nonnegative_int()


def test_contract_rejects_overlong_and_unstoppable_drafts():
    from framework.testing import AlwaysAcceptDrafter, DrafterContract

    class Overlong(AlwaysAcceptDrafter):
        def draft(self, state, plan, length, max_tokens):
            return super().draft(state, plan, length, max_tokens + 1)

    with pytest.raises(AssertionError):
        _contract_for(DrafterContract, Overlong).test_draft_shapes_and_bounds()
    # AlwaysAcceptDrafter ignores should_continue: the contract notices
    with pytest.raises(AssertionError, match="should_continue"):
        _contract_for(DrafterContract, AlwaysAcceptDrafter).test_stops_when_length_says_so()


def test_contract_accepts_a_drafter_that_declines_when_allowed():
    """``may_decline``: an empty draft passes the shape checks (it has no tokens to bound), and is
    still rejected by a contract that requires at least one token."""
    from framework.testing import DrafterContract

    class Declines(Drafter):
        Config = _Cfg

        def draft(self, state, plan, length, max_tokens):
            return Draft.empty(state.pending.shape[0], plan, state.device)

    allowed = type(
        "TestDeclines", (DrafterContract,), {"make": lambda self: Declines(), "may_decline": True}
    )()
    allowed.test_draft_shapes_and_bounds()
    allowed.test_committed_cache_untouched()
    allowed.test_greedy_equality()
    with pytest.raises(AssertionError):
        _contract_for(DrafterContract, Declines).test_draft_shapes_and_bounds()


def test_contract_rejects_lossy_verifier():
    from framework.testing import VerifierContract

    class AcceptEverything(Verifier):
        """Accepts every draft token whatever the target says: not lossless."""

        Config = _Cfg

        def verify(self, state, draft):
            block = torch.cat([state.pending, draft.tokens], dim=1)
            target = state.forward_verify(block).logits.argmax(-1)
            k = draft.length
            new = torch.cat([draft.tokens, target[:, k:]], dim=1)
            return Verification(num_accepted=torch.tensor([k]), new_tokens=new)

    contract = _contract_for(VerifierContract, AcceptEverything)
    contract.test_empty_draft()  # shapes are fine...
    with pytest.raises(AssertionError, match="differs from vanilla"):
        contract.test_greedy_equality()  # ...but the output is not the target's


def test_contract_passes_for_stub_strategies():
    from framework.testing import (
        DrafterContract,
        NeverAcceptDrafter,
        RejectAllVerifier,
        VerifierContract,
    )

    c = _contract_for(VerifierContract, RejectAllVerifier)
    c.test_verify_bounds_and_commit()
    c.test_greedy_equality()
    d = _contract_for(DrafterContract, NeverAcceptDrafter)
    d.test_committed_cache_untouched()
    d.test_greedy_equality()


def test_default_strategy_instance():
    from framework import REGISTRIES
    from framework.testing import default_strategy_instance

    for kind, reg in REGISTRIES.items():
        for name in reg.names():
            inst = default_strategy_instance(kind, name)
            assert type(inst) is reg.get(name) and inst.config == reg.entry(name).config()
        assert type(default_strategy_instance(kind)).name in reg
    with pytest.raises(ValueError, match="unknown strategy kind"):
        default_strategy_instance("drafters")
    with pytest.raises(KeyError, match="Did you mean 'static'"):
        default_strategy_instance("selector", "statc")


def test_the_engine_objects_have_what_the_api_protocols_promise():
    """`ReducedHead`, `CostPrices` and `DraftWeights` (framework.types) declare what a strategy uses
    of the engine's draft head, cost model and compressed weights, and `PrepareView` what it uses
    of the engine's `PrepareContext`: each member exists there, a property as a property and a
    method as a method."""
    import inspect

    from framework.engine.context import PrepareContext
    from framework.engine.cost_model import CostModel
    from framework.engine.draft_head import DraftHead
    from framework.interfaces import PrepareView
    from framework.kernels.fused import FusedBlocks
    from framework.kernels.lowbit import LowBitLinears
    from framework.types import CostPrices, DraftWeights, ReducedHead

    pairs = [(ReducedHead, DraftHead), (CostPrices, CostModel), (PrepareView, PrepareContext)]
    pairs += [(DraftWeights, FusedBlocks), (DraftWeights, LowBitLinears)]
    for proto, cls in pairs:
        fields = getattr(cls, "__dataclass_fields__", {})
        for name, member in vars(proto).items():
            if name.startswith("_"):
                continue
            got = inspect.getattr_static(cls, name, None)
            assert got is not None, (proto.__name__, cls.__name__, name)
            assert isinstance(got, property) == isinstance(member, property), (cls.__name__, name)
        if fields:  # a dataclass: its declared attributes too (others set theirs in __init__)
            for name in getattr(proto, "__annotations__", {}):
                got = inspect.getattr_static(cls, name, None)
                assert name in fields or isinstance(got, property), (proto.__name__, cls.__name__, name)
