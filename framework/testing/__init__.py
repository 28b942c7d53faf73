"""Testing helpers shipped with the package: tiny random models, stub strategies and the contract
test mixins a researcher's own tests inherit (see `framework.testing.contracts`)."""

from framework.experiment.tiny import ARCHS, cached_tiny_model, tiny_model, tiny_tokenizer
from framework.testing.contracts import (
    CONTRACT_PARTNERS,
    DEFAULT_NAMES,
    FAST_OVERRIDES,
    AlwaysAcceptDrafter,
    DrafterContract,
    FakeClock,
    LayerSelectorContract,
    LengthControllerContract,
    NeverAcceptDrafter,
    RejectAllVerifier,
    VerifierContract,
    ZeroLength,
    default_strategy_instance,
    prepare_context,
    random_prompt,
    synthetic_cost_model,
)

__all__ = [
    "ARCHS",
    "CONTRACT_PARTNERS",
    "DEFAULT_NAMES",
    "FAST_OVERRIDES",
    "AlwaysAcceptDrafter",
    "DrafterContract",
    "FakeClock",
    "LayerSelectorContract",
    "LengthControllerContract",
    "NeverAcceptDrafter",
    "RejectAllVerifier",
    "VerifierContract",
    "ZeroLength",
    "cached_tiny_model",
    "default_strategy_instance",
    "prepare_context",
    "random_prompt",
    "synthetic_cost_model",
    "tiny_model",
    "tiny_tokenizer",
]
