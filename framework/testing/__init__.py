"""Testing helpers shipped with the package: tiny random models, stub strategies
(`framework.testing.stubs`) and the contract test mixins a researcher's own tests inherit
(`framework.testing.contracts`)."""

import re

from framework.testing.contracts import (
    CONTRACT_PARTNERS,
    DrafterContract,
    LayerSelectorContract,
    LengthControllerContract,
    VerifierContract,
)
from framework.testing.host_work import HostWorkReport, measure_host_work
from framework.testing.stubs import (
    DEFAULT_NAMES,
    FAST_OVERRIDES,
    AlwaysAcceptDrafter,
    FakeClock,
    NeverAcceptDrafter,
    RejectAllVerifier,
    ZeroLength,
    default_strategy_instance,
    device_ops,
    fast_overrides,
    prepare_context,
    random_prompt,
    synthetic_cost_model,
)
from framework.testing.tiny import (
    ARCHS,
    cached_tiny_model,
    char_regex_grammar,
    tiny_json_tokenizer,
    tiny_model,
    tiny_tokenizer,
)


def plain_table(text: str) -> str:
    """``text`` with the padding of its aligned markdown tables (`framework.utils.align_markdown`)
    removed: ``"| qa     |  2.000x |"`` -> ``"| qa | 2.000x |"``, for substring checks in tests."""
    return re.sub(r" {2,}", " ", text)


__all__ = [
    "char_regex_grammar",
    "plain_table",
    "ARCHS",
    "CONTRACT_PARTNERS",
    "DEFAULT_NAMES",
    "FAST_OVERRIDES",
    "AlwaysAcceptDrafter",
    "DrafterContract",
    "FakeClock",
    "HostWorkReport",
    "LayerSelectorContract",
    "LengthControllerContract",
    "NeverAcceptDrafter",
    "RejectAllVerifier",
    "VerifierContract",
    "ZeroLength",
    "cached_tiny_model",
    "default_strategy_instance",
    "device_ops",
    "fast_overrides",
    "prepare_context",
    "measure_host_work",
    "random_prompt",
    "synthetic_cost_model",
    "tiny_model",
    "tiny_json_tokenizer",
    "tiny_tokenizer",
]
