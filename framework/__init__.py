"""selfspec's strategy-author API: the four interfaces, the typed objects of a round, the
registries and the config helpers.

Example:
    >>> from dataclasses import dataclass
    >>> import framework as fw
    >>> @dataclass(frozen=True)
    ... class EveryOtherConfig:
    ...     pass
    >>> @fw.register_selector("every_other_doc", config=EveryOtherConfig)   # doctest: +SKIP
    ... class EveryOther(fw.LayerSelector):
    ...     '''Skip the MLP of every other block.'''
    ...     def plan(self, state: fw.RoundView) -> fw.LayerPlan:
    ...         n = state.info.num_layers
    ...         return fw.LayerPlan.from_indices(n, mlp=range(1, n, 2))

Strategies see a round through `RoundView` (a drafter's ``draft`` through `DraftView`, a verifier's
``verify`` through `VerifyView`) and their one-time preparation through `PrepareView`
(typed, read-only: never the model adapter or the KV cache). Everything a strategy needs is
importable from here. The sub-packages, lowest first: the kernels (`framework.kernels`), the
engine (`framework.engine`), what strategies compose (`framework.drafting`: draft builder, reduced
head and compressed weights, draft gate; `framework.search`: Bayesian optimisation and the work
budget), then the tooling that is never imported by them: data, models, the testing helpers,
the session (`RunConfig`, presets, `Session`), results, the runner (`framework.runner`),
the benchmark and sweeps.
"""

from framework.config_fields import (
    ConfigError,
    build_config,
    check_choice,
    check_range,
    check_types,
    field_help,
    param,
)
from framework.interfaces import (
    DRAFTERS,
    LENGTH_CONTROLLERS,
    REGISTRIES,
    SELECTORS,
    VERIFIERS,
    Drafter,
    LayerSelector,
    LengthController,
    PrepareView,
    Strategy,
    Verifier,
    get_drafter,
    get_length,
    get_selector,
    get_verifier,
    list_drafters,
    list_lengths,
    list_selectors,
    list_verifiers,
    register_drafter,
    register_length,
    register_selector,
    register_verifier,
)
from framework.registry import RegistryError, UnknownNameError
from framework.types import (
    AcceptanceRule,
    DecodeStats,
    Draft,
    ForwardOutput,
    LayerPlan,
    LengthHint,
    ModelInfo,
    RandomStream,
    RoundRecord,
    Verification,
)
from framework.view import DeviceOps, DraftView, PlanEvaluation, RoundView, VerifyView

__all__ = [
    "AcceptanceRule",
    "DRAFTERS",
    "LENGTH_CONTROLLERS",
    "REGISTRIES",
    "SELECTORS",
    "VERIFIERS",
    "ConfigError",
    "DecodeStats",
    "Draft",
    "DeviceOps",
    "Drafter",
    "ForwardOutput",
    "LayerPlan",
    "LayerSelector",
    "LengthController",
    "LengthHint",
    "ModelInfo",
    "PlanEvaluation",
    "PrepareView",
    "RegistryError",
    "RandomStream",
    "RoundRecord",
    "RoundView",
    "DraftView",
    "VerifyView",
    "Strategy",
    "UnknownNameError",
    "Verification",
    "Verifier",
    "build_config",
    "check_choice",
    "check_types",
    "check_range",
    "field_help",
    "get_drafter",
    "get_length",
    "get_selector",
    "get_verifier",
    "list_drafters",
    "list_lengths",
    "list_selectors",
    "list_verifiers",
    "param",
    "register_drafter",
    "register_length",
    "register_selector",
    "register_verifier",
]
