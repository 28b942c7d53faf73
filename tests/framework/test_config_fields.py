"""framework.config_fields: range checks, string parsing, flag-prefixed errors, every registered Config."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, Optional

import pytest

from framework import REGISTRIES
from framework.config_fields import (
    ConfigError,
    build_config,
    check_choice,
    check_range,
    check_types,
    field_defaults,
    field_help,
    param,
    parse_value,
)

# --------------------------------------------------------------------------------- check_range


@pytest.mark.parametrize(
    "value, kwargs, message",
    [
        (1.5, dict(lo=0, hi=1, hi_open=True), "x must be in [0, 1), got 1.5"),
        (1.0, dict(lo=0, hi=1, hi_open=True), "x must be in [0, 1), got 1.0"),
        (0.0, dict(lo=0, hi=1, lo_open=True), "x must be in (0, 1], got 0.0"),
        (-1, dict(lo=0, hi=1), "x must be in [0, 1], got -1"),
        (0.0, dict(lo=0, hi=1, lo_open=True, hi_open=True), "x must be in (0, 1), got 0.0"),
        (0, dict(lo=1), "x must be >= 1, got 0"),
        (1, dict(lo=1, lo_open=True), "x must be > 1, got 1"),
        (3, dict(hi=2), "x must be <= 2, got 3"),
        (2, dict(hi=2, hi_open=True), "x must be < 2, got 2"),
        (0.25, dict(lo=0.5, hi=0.75), "x must be in [0.5, 0.75], got 0.25"),
    ],
)
def test_check_range_messages(value, kwargs, message):
    with pytest.raises(ConfigError) as exc:
        check_range("x", value, **kwargs)
    assert str(exc.value) == message
    assert exc.value.field == "x" and exc.value.value == value


@pytest.mark.parametrize(
    "value, kwargs",
    [
        (0, dict(lo=0, hi=1)),
        (1, dict(lo=0, hi=1)),
        (0.999, dict(lo=0, hi=1, hi_open=True)),
        (1e-9, dict(lo=0, hi=1, lo_open=True)),
        (10**6, dict(lo=1)),
        (-5.0, dict(hi=0)),
    ],
)
def test_check_range_accepts(value, kwargs):
    check_range("x", value, **kwargs)  # no exception


def test_check_range_nan():
    with pytest.raises(ConfigError, match=r"x must be in \[0, 1\], got nan"):
        check_range("x", float("nan"), 0, 1)


@pytest.mark.parametrize("value", [True, False])
def test_check_range_rejects_bool(value):
    with pytest.raises(ConfigError, match=rf"x must be >= 0, got {value}"):
        check_range("x", value, 0)


@pytest.mark.parametrize("value", ["0.5", None, [1]])
def test_check_range_rejects_non_numbers(value):
    with pytest.raises(ConfigError):
        check_range("x", value, 0, 1)


def test_check_range_no_bounds_bad_value():
    with pytest.raises(ConfigError):
        check_range("x", float("nan"))


def test_check_choice():
    check_choice("mode", "a", ("a", "b"))
    with pytest.raises(ConfigError, match=r"mode must be one of 'a', 'b', got 'c'"):
        check_choice("mode", "c", ("a", "b"))


def test_config_error_is_value_error_and_with_flag():
    err = ConfigError("k", 0, ">= 1")
    assert isinstance(err, ValueError)
    flagged = err.with_flag("--length.k")
    assert str(flagged) == "--length.k must be >= 1, got 0"
    assert (flagged.field, flagged.value, flagged.allowed) == ("--length.k", 0, ">= 1")


def test_param_rejects_mutable_default_and_keeps_help():
    with pytest.raises(TypeError):
        param([1, 2])

    @dataclass(frozen=True)
    class C:
        a: int = param(3, help="the a")
        b: tuple[int, ...] = param((1,), help="the b")

    assert field_help(C) == {"a": "the a", "b": "the b"}
    assert field_defaults(C) == {"a": 3, "b": (1,)}


def test_param_keeps_command_line_metadata_only_when_given():
    @dataclass(frozen=True)
    class C:
        plain: int = param(1, help="p")
        stops: tuple[str, ...] = param(
            (), help="s", flag="--stop", aliases=("-s",), metavar="STR", repeat=True
        )

    plain, stops = dataclasses.fields(C)
    assert dict(plain.metadata) == {"help": "p"}
    assert dict(stops.metadata) == {
        "help": "s",
        "flag": "--stop",
        "aliases": ("-s",),
        "metavar": "STR",
        "repeat": True,
    }


def test_parse_value_is_the_public_parser():
    assert parse_value("3,5", tuple[int, ...], "--x") == (3, 5)
    assert parse_value("none", int | None, "--x") is None
    assert parse_value("bf16", Literal["float32", "bfloat16"], "--x") == "bfloat16"
    assert parse_value("2", Literal[1, 2], "--x") == 2
    # a choice the Literal lacks is the config's to refuse (check_types), not the parser's
    assert parse_value("c", Literal["a", "b"], "--x") == "c"


# --------------------------------------------------------------------------------- build_config


@dataclass(frozen=True)
class _Cfg:
    n: int = 1
    ratio: float = 0.5
    flag: bool = False
    idx: tuple[int, ...] = ()
    names: tuple[str, ...] = ()
    mode: Literal["fast", "slow"] = "fast"
    level: Literal[1, 2, 3] = 1
    cap: Optional[int] = None  # noqa: UP045 - the typing.Optional spelling is part of what is tested
    limit: float | None = None
    label: str = "x"

    def __post_init__(self) -> None:
        check_types(self)
        check_range("ratio", self.ratio, 0.0, 1.0, hi_open=True)
        check_range("n", self.n, 1)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"flag": 1}, "flag must be a boolean (true/false), got 1"),
        ({"flag": "yes"}, "flag must be a boolean (true/false), got 'yes'"),
        ({"mode": "medium"}, "mode must be one of fast, slow, got 'medium'"),
        ({"level": True}, "level must be one of 1, 2, 3, got True"),  # True == 1, but not a choice
        ({"level": 1.0}, "level must be one of 1, 2, 3, got 1.0"),
        ({"names": ("a", 2)}, "names must be a tuple of strings, got ('a', 2)"),
        ({"names": ["a"]}, "names must be a tuple of strings, got ['a']"),
        ({"label": None}, "label must be a string, got None"),
    ],
)
def test_check_types_refuses_a_value_of_another_type(values, message):
    with pytest.raises(ConfigError) as exc:
        _Cfg(**values)
    assert str(exc.value) == message


def test_check_types_takes_optional_and_leaves_numbers_to_the_ranges():
    assert _Cfg(cap=None, limit=None).cap is None
    assert _Cfg(cap=3, limit=2).limit == 2

    @dataclass(frozen=True)
    class Flags:
        cuda_graphs: bool = False
        dtype: Literal["a"] | None = param(None, flag="--d")

        def __post_init__(self) -> None:
            check_types(self, flags=True)

    with pytest.raises(ConfigError, match=r"^--cuda-graphs must be a boolean"):
        Flags(cuda_graphs="no")
    with pytest.raises(ConfigError, match=r"^--d must be one of a, got 'b'$"):
        Flags(dtype="b")


def test_build_config_parses_strings():
    cfg = build_config(
        _Cfg,
        {
            "n": "7",
            "ratio": "0.25",
            "flag": "yes",
            "idx": "3, 1,2",
            "names": "a,b",
            "mode": "slow",
            "level": "3",
            "cap": "12",
            "limit": "2.5",
            "label": "hello",
        },
    )
    assert cfg == _Cfg(7, 0.25, True, (3, 1, 2), ("a", "b"), "slow", 3, 12, 2.5, "hello")
    assert type(cfg.n) is int and type(cfg.ratio) is float and type(cfg.level) is int


@pytest.mark.parametrize(
    "text, expected", [("1", True), ("true", True), ("ON", True), ("0", False), ("no", False)]
)
def test_build_config_bools(text, expected):
    assert build_config(_Cfg, {"flag": text}).flag is expected


@pytest.mark.parametrize("text", ["none", "None", "null", ""])
def test_build_config_optional_none(text):
    cfg = build_config(_Cfg, {"cap": text, "limit": text})
    assert cfg.cap is None and cfg.limit is None


def test_build_config_empty_tuple_and_non_strings():
    assert build_config(_Cfg, {"idx": ""}).idx == ()
    cfg = build_config(_Cfg, {"n": 3, "idx": [4, 5], "ratio": 0.1})  # YAML-typed values pass through
    assert cfg.n == 3 and cfg.idx == (4, 5) and cfg.ratio == 0.1


def test_build_config_defaults():
    assert build_config(_Cfg, {}) == _Cfg()


def test_unknown_field_names_flag():
    with pytest.raises(ConfigError) as exc:
        build_config(_Cfg, {"nn": "3"}, flag_prefix="--selector.")
    msg = str(exc.value)
    assert msg.startswith("--selector.nn must be a field of _Cfg")
    assert "ratio" in msg and "got 'nn'" in msg, "the message quotes the unknown name, not its value"


@pytest.mark.parametrize(
    "values, message",
    [
        ({"n": "abc"}, "--x.n must be a number (int), got 'abc'"),
        ({"n": "1.5"}, "--x.n must be a number (int), got '1.5'"),
        ({"ratio": "lots"}, "--x.ratio must be a number (float), got 'lots'"),
        ({"flag": "maybe"}, "--x.flag must be a boolean (true/false), got 'maybe'"),
        ({"mode": "medium"}, "--x.mode must be one of fast, slow, got 'medium'"),
        ({"idx": "1,b"}, "--x.idx must be a number (int), got 'b'"),
    ],
)
def test_parse_errors_name_flag(values, message):
    with pytest.raises(ConfigError) as exc:
        build_config(_Cfg, values, flag_prefix="--x.")
    assert str(exc.value) == message


def test_validation_error_reraised_with_flag():
    with pytest.raises(ConfigError) as exc:
        build_config(_Cfg, {"ratio": "1.5"}, flag_prefix="--selector.")
    assert str(exc.value) == "--selector.ratio must be in [0, 1), got 1.5"
    with pytest.raises(ConfigError, match=r"^--selector\.ratio must be in \[0, 1\), got nan$"):
        build_config(_Cfg, {"ratio": "nan"}, flag_prefix="--selector.")


def test_validation_error_of_real_strategies():
    sel = REGISTRIES["selector"].entry("static").config
    with pytest.raises(ConfigError) as exc:
        build_config(sel, {"skip_ratio": "1.5"}, flag_prefix="--selector.")
    assert str(exc.value) == "--selector.skip_ratio must be in [0, 1), got 1.5"
    fixed = REGISTRIES["length"].entry("fixed").config
    with pytest.raises(ConfigError, match=r"^--length\.k must be an integer in \[1, 64\], got 0$"):
        build_config(fixed, {"k": "0"}, flag_prefix="--length.")
    conf = REGISTRIES["length"].entry("confidence").config
    with pytest.raises(ConfigError, match=r"^--length\.threshold must be in \(0, 1\), got 1\.0$"):
        build_config(conf, {"threshold": "1.0"}, flag_prefix="--length.")
    cfg = build_config(sel, {"skip_attn": "1,2", "skip_mlp": "3"}, flag_prefix="--selector.")
    assert cfg.skip_attn == (1, 2) and cfg.skip_mlp == (3,)


# ------------------------------------------------------------------ every registered Config


def _all_entries():
    return [(kind, e) for kind, reg in REGISTRIES.items() for e in reg.entries()]


@pytest.mark.parametrize("kind, entry", _all_entries(), ids=lambda v: getattr(v, "name", v))
def test_registered_config_defaults_and_frozen(kind, entry):
    cfg_cls = entry.config
    assert dataclasses.is_dataclass(cfg_cls) and cfg_cls.__dataclass_params__.frozen
    cfg = cfg_cls()  # every field has a valid default
    assert build_config(cfg_cls, {}) == cfg
    for f in dataclasses.fields(cfg_cls):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(cfg, f.name, getattr(cfg, f.name))
        default = getattr(cfg, f.name)
        assert not isinstance(default, (list, dict, set)), f"{entry.name}.{f.name} has a mutable default"
        if isinstance(default, float):
            assert math.isfinite(default)
    inst = entry.cls(cfg)
    assert inst.config is cfg and entry.cls.name == entry.name


@pytest.mark.parametrize("kind, entry", _all_entries(), ids=lambda v: getattr(v, "name", v))
def test_registered_configs_check_their_types(kind, entry):
    """Every registered config refuses, by construction in Python, a value its annotation does not
    allow: a string for a boolean, an unknown choice for a ``Literal``."""
    import typing

    hints = typing.get_type_hints(entry.config)
    for f in dataclasses.fields(entry.config):
        tp = hints[f.name]
        bad = "maybe" if tp is bool else "no-such-choice" if typing.get_origin(tp) is Literal else None
        if bad is not None:
            with pytest.raises(ConfigError, match=rf"^{f.name} must be (a boolean|one of)"):
                entry.config(**{f.name: bad})
