"""framework.registry: registration rules, lookups, error messages."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from framework import (
    DRAFTERS,
    REGISTRIES,
    SELECTORS,
    Drafter,
    LayerPlan,
    LayerSelector,
    RegistryError,
    UnknownNameError,
    get_selector,
    list_selectors,
    register_selector,
)
from framework.config_fields import ConfigError, build_config
from framework.registry import Registry


@dataclass(frozen=True)
class _Cfg:
    alpha: float = 0.5


@dataclass
class _MutableCfg:
    alpha: float = 0.5


class _Sel(LayerSelector):
    """A test selector.

    More text that is not part of the description.
    """

    def plan(self, state):
        return LayerPlan.full(4)


@pytest.fixture
def registered():
    """Names registered by a test, removed afterwards so nothing leaks into other tests."""
    names: list[tuple[Registry, str]] = []
    yield names
    for reg, name in names:
        reg.unregister(name)


def _fresh_sel_class(doc: str | None = "A fresh selector.") -> type:
    cls = type("FreshSel", (_Sel,), {"__doc__": doc})
    return cls


def test_register_with_config(registered):
    cls = _fresh_sel_class("Skips nothing.\n\n    Long text.")
    out = register_selector("zz_test_sel", config=_Cfg)(cls)
    registered.append((SELECTORS, "zz_test_sel"))
    assert out is cls
    assert get_selector("zz_test_sel") is cls
    assert cls.Config is _Cfg and cls.name == "zz_test_sel"
    entry = SELECTORS.entry("zz_test_sel")
    assert entry.cls is cls and entry.config is _Cfg and entry.description == "Skips nothing."
    assert "zz_test_sel" in SELECTORS
    assert "zz_test_sel" in list_selectors()
    inst = cls()  # default config built from the registered Config
    assert inst.config == _Cfg()


def test_register_config_from_class_attribute(registered):
    cls = type("WithCfg", (_Sel,), {"Config": _Cfg})
    register_selector("zz_attr_cfg")(cls)
    registered.append((SELECTORS, "zz_attr_cfg"))
    assert SELECTORS.entry("zz_attr_cfg").config is _Cfg


def test_duplicate_name_rejected(registered):
    register_selector("zz_dup", config=_Cfg)(_fresh_sel_class())
    registered.append((SELECTORS, "zz_dup"))
    first = SELECTORS.get("zz_dup")
    with pytest.raises(RegistryError, match="already registered"):
        register_selector("zz_dup", config=_Cfg)(type("OtherSel", (_Sel,), {}))
    assert SELECTORS.get("zz_dup") is first  # the original entry survives


def test_registering_a_redefinition_again_replaces_it(registered):
    """A notebook cell that defines and registers a strategy can be run again."""
    first = register_selector("zz_again", config=_Cfg)(_fresh_sel_class())
    registered.append((SELECTORS, "zz_again"))
    again = _fresh_sel_class("Redefined.")  # same module and qualified name, a new class object
    assert again is not first
    assert register_selector("zz_again", config=_Cfg)(again) is again
    assert SELECTORS.get("zz_again") is again and SELECTORS.entry("zz_again").description == "Redefined."
    assert register_selector("zz_again", config=_Cfg)(again) is again  # the same class: a no-op


def test_builtin_duplicate_rejected():
    with pytest.raises(RegistryError, match="'static' is already registered"):
        register_selector("static", config=_Cfg)(_fresh_sel_class())


def test_non_subclass_rejected():
    class NotASelector:
        pass

    with pytest.raises(RegistryError, match="must subclass LayerSelector"):
        register_selector("zz_bad_base", config=_Cfg)(NotASelector)
    # a Drafter is a Strategy but not a LayerSelector
    with pytest.raises(RegistryError, match="must subclass LayerSelector"):
        register_selector("zz_bad_base", config=_Cfg)(type("D", (Drafter,), {}))
    assert "zz_bad_base" not in SELECTORS


def test_non_frozen_config_rejected():
    with pytest.raises(RegistryError, match="frozen config dataclass"):
        register_selector("zz_mutable", config=_MutableCfg)(_fresh_sel_class())
    assert "zz_mutable" not in SELECTORS


def test_a_strategy_without_parameters_needs_no_config(registered):
    cls = register_selector("zz_nocfg")(_fresh_sel_class())
    registered.append((SELECTORS, "zz_nocfg"))
    cfg = SELECTORS.entry("zz_nocfg").config
    assert dataclasses.is_dataclass(cfg) and cfg.__dataclass_params__.frozen
    assert dataclasses.fields(cfg) == () and cfg.__name__ == "FreshSelConfig"
    assert cls().config == cfg() and build_config(cfg, {}) == cfg()
    with pytest.raises(ConfigError, match="skip"):
        build_config(cfg, {"skip": 1})  # and it still refuses parameters it does not have


def test_a_config_that_is_not_a_frozen_dataclass_is_rejected():
    with pytest.raises(RegistryError, match="frozen config dataclass"):
        register_selector("zz_notdc", config=dict)(_fresh_sel_class())
    assert "zz_notdc" not in SELECTORS


@pytest.mark.parametrize(
    "bad", ["CamelCase", "with-dash", "1starts_digit", "", "has space", "_leading", "ü", None]
)
def test_bad_names_rejected(bad):
    with pytest.raises(RegistryError, match="snake_case"):
        register_selector(bad, config=_Cfg)


def test_unknown_name_lists_and_suggests():
    with pytest.raises(UnknownNameError) as exc:
        get_selector("statik")
    msg = str(exc.value)
    assert "Did you mean 'static'?" in msg
    for name in SELECTORS.names():
        assert name in msg
    assert isinstance(exc.value, KeyError)
    assert not msg.startswith("'")  # readable, not KeyError's quoted repr


def test_unknown_name_without_close_match():
    with pytest.raises(UnknownNameError) as exc:
        SELECTORS.entry("qqqqqqqqqqqq")
    msg = str(exc.value)
    assert "Did you mean" not in msg and "unknown selector 'qqqqqqqqqqqq'" in msg
    assert "Registered selectors: " in msg


def test_unknown_name_empty_registry():
    reg: Registry = Registry("widget")
    with pytest.raises(UnknownNameError, match=r"\(none\)"):
        reg.get("x")


def test_class_and_instance_pass_through():
    cls = _fresh_sel_class()
    inst = type("Inst", (_Sel,), {"Config": _Cfg})()
    assert get_selector(cls) is cls
    assert get_selector(inst) is inst


def test_names_glob(registered):
    reg: Registry = Registry("thing", LayerSelector)
    for name in ("clasp_dp", "clasp_greedy", "swift", "del_exit"):
        reg.register(name, config=_Cfg)(_fresh_sel_class())
    assert reg.names() == ["clasp_dp", "clasp_greedy", "del_exit", "swift"]
    assert reg.names("clasp_*") == ["clasp_dp", "clasp_greedy"]
    assert reg.names("*exit") == ["del_exit"]
    assert reg.names("nomatch*") == []
    assert [e.name for e in reg.entries()] == reg.names()
    assert len(reg) == 4


def test_unregister(registered):
    register_selector("zz_unreg", config=_Cfg)(_fresh_sel_class())
    SELECTORS.unregister("zz_unreg")
    assert "zz_unreg" not in SELECTORS
    SELECTORS.unregister("zz_unreg")  # idempotent
    register_selector("zz_unreg", config=_Cfg)(_fresh_sel_class())  # the name is free again
    registered.append((SELECTORS, "zz_unreg"))


def test_registries_bound_to_interfaces():
    from framework import interfaces

    assert REGISTRIES["selector"].base_cls is interfaces.LayerSelector
    assert REGISTRIES["length"].base_cls is interfaces.LengthController
    assert REGISTRIES["drafter"].base_cls is interfaces.Drafter
    assert REGISTRIES["verifier"].base_cls is interfaces.Verifier
    assert DRAFTERS is REGISTRIES["drafter"]


def test_builtins_registered():
    assert "static" in REGISTRIES["selector"]
    assert {"fixed", "confidence"} <= set(REGISTRIES["length"].names())
    assert "layer_skip" in REGISTRIES["drafter"]
    assert "greedy" in REGISTRIES["verifier"]
