"""Stub strategies and helpers for tests: strategies with a known outcome (drafts that are always
or never accepted, a verifier that rejects everything, a controller that never drafts), a fake
clock, random prompts, a synthetic cost model, a test `PrepareContext` and the engine's ops to call
a device function directly (`device_ops`).

Everything here runs on CPU in seconds and never downloads anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from framework.config_fields import build_config
from framework.data.prompts import calibration_texts
from framework.engine.context import PrepareContext, PreparedCache
from framework.engine.cost_model import CostModel
from framework.engine.execution.work import EagerOps
from framework.interfaces import REGISTRIES, Drafter, LengthController, Strategy, Verifier
from framework.types import Draft, LayerPlan, LengthHint, RandomStream, Verification
from framework.view import DeviceOps, DraftView, RoundView, VerifyView

#: The strategy `default_strategy_instance` picks for a kind when no name is given.
DEFAULT_NAMES: dict[str, str] = {
    "selector": "static",
    "length": "fixed",
    "drafter": "layer_skip",
    "verifier": "greedy",
}


# --------------------------------------------------------------------------------------------
# Clocks and prompts
# --------------------------------------------------------------------------------------------


class FakeClock:
    """A clock for tests of time budgets (`framework.search.budget.WorkBudget`): seconds move only when
    the test says so (`advance`, or by setting ``t``); ``reads`` counts how often it was read."""

    def __init__(self) -> None:
        self.t = 0.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def random_prompt(length: int = 6, vocab_size: int = 128, seed: int = 0) -> torch.Tensor:
    """LongTensor (1, length) of random token ids (reproducible, independent of the global RNG)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, length), generator=g)


# --------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------


#: Config overrides that shrink a strategy's offline search for tests (``fast=True``). The lossless
#: invariant holds for whatever skip set a search returns; these only make it cheaper to find one.
FAST_OVERRIDES: dict[tuple[str, str], dict[str, Any]] = {
    # cache off: a test searches (and never writes into the user's cache).
    ("selector", "selfsd_bo"): {"iterations": 3, "calib_limit": 2, "calib_max_new_tokens": 8, "cache": False},
}


def fast_overrides(preset: dict[str, Any]) -> dict[str, Any]:
    """`FAST_OVERRIDES` for the strategies a preset (its loaded mapping) names, as the dotted keys
    ``RunConfig.from_preset`` takes (``{"selector.iterations": 3, ...}``)."""
    return {
        f"{kind}.{field}": value
        for (kind, strategy), fields in FAST_OVERRIDES.items()
        if preset.get(kind, {}).get("name") == strategy
        for field, value in fields.items()
    }


def synthetic_cost_model(num_layers: int, max_tokens: int = 16) -> CostModel:
    """A deterministic `CostModel` in units of one step: the LM head and embedding 0.1 (of which
    the final norm and LM head 0.08), attention 0.5 / L and MLP 0.4 / L per sub-layer, a
    verification of T tokens 1 + 0.1 (T - 1)."""
    return CostModel(
        num_layers=num_layers,
        base=0.1,
        attn=0.5 / num_layers,
        mlp=0.4 / num_layers,
        verify_costs=tuple(1.0 + 0.1 * (t - 1) for t in range(1, max_tokens + 1)),
        head=0.08,
        full_head=0.08,
    )


def prepare_context(
    adapter: Any,
    *,
    prepared: PreparedCache | None = None,
    cost_model: CostModel | None = None,
    measure: bool = False,
) -> PrepareContext:
    """A `PrepareContext` for tests: a deterministic byte-level ``encode`` (no tokenizer), no files,
    no log output, and (unless ``measure``) ``cost_model`` (default: a `synthetic_cost_model`)
    instead of timing the model, put in ``prepared`` unless it holds one already."""
    info = adapter.arch.info()
    vocab = info.vocab_size

    def encode(text: str) -> list[int]:
        return [1 + b % (vocab - 1) for b in text.encode()[:16]] or [1]

    ctx = PrepareContext(
        adapter=adapter,
        encode=encode,
        log=lambda msg: None,
        progress=False,
        prepared=PreparedCache() if prepared is None else prepared,
        load_prompts=calibration_texts,
    )
    if not measure and ctx.prepared.cost_model() is None:
        costs = synthetic_cost_model(info.num_layers) if cost_model is None else cost_model
        ctx.prepared.set_cost_model(costs)
    return ctx


def default_strategy_instance(kind: str, name: str | None = None, *, fast: bool = False) -> Strategy:
    """Construct the registered strategy ``name`` of ``kind`` with its default config.

    Args:
        kind: ``"selector"``, ``"length"``, ``"drafter"`` or ``"verifier"``.
        name: registered name; ``None`` takes :data:`DEFAULT_NAMES` (or the first registered).
        fast: apply :data:`FAST_OVERRIDES` (a cheaper offline search) when there are any.
    """
    if kind not in REGISTRIES:
        raise ValueError(f"unknown strategy kind {kind!r}; choose from {', '.join(REGISTRIES)}")
    reg = REGISTRIES[kind]
    if name is None:
        name = DEFAULT_NAMES.get(kind)
        if name not in reg:
            name = reg.names()[0]
    entry = reg.entry(name)
    if fast and (kind, name) in FAST_OVERRIDES:
        return entry.cls(build_config(entry.config, FAST_OVERRIDES[kind, name]))
    return entry.cls(entry.config())


@dataclass(frozen=True)
class NoConfig:
    """The config of an unregistered stub strategy (no fields)."""


class AlwaysAcceptDrafter(Drafter):
    """Stub drafter (unregistered) that drafts with the full model, ignoring the plan.

    Its tokens are the target's own greedy continuation, so a greedy verifier accepts all of them
    (litgpt's "always accepts" stub).
    """

    Config = NoConfig
    rank = 0  # the token drafted: the full model's most likely (0) or its runner-up (1)

    def draft(self, state: DraftView, plan: LayerPlan, length: LengthController, max_tokens: int) -> Draft:
        full = LayerPlan.full(state.info.num_layers)
        x, toks = state.pending, []
        for _ in range(max_tokens):
            logits = state.forward_draft(x, full).logits[:, -1]
            tok = logits.argmax(-1) if not self.rank else logits.topk(2, dim=-1).indices[:, 1]
            toks.append(tok)
            x = tok[:, None]
        return Draft(torch.stack(toks, dim=1), full)


class NeverAcceptDrafter(AlwaysAcceptDrafter):
    """Stub drafter (unregistered) whose first token is never the target's greedy choice.

    It runs the full model and proposes the runner-up token, so a greedy verifier accepts nothing
    (litgpt's "never accepts" stub).
    """

    rank = 1  # the runner-up: never the argmax


class RejectAllVerifier(Verifier):
    """Stub verifier (unregistered) that accepts nothing and commits the target's own next token.

    Still lossless for greedy decoding: every round commits exactly one target token.
    """

    Config = NoConfig

    def verify(self, state: VerifyView, draft: Draft) -> Verification:
        block = torch.cat([state.pending, draft.tokens], dim=1)
        target = state.forward_verify(block, logits_at="all").logits.argmax(-1)
        return Verification(
            num_accepted=torch.zeros(block.shape[0], dtype=torch.long, device=block.device),
            new_tokens=target[:, :1],
            target_tokens=target,
        )


class ZeroLength(LengthController):
    """Stub length controller (unregistered) that always declines to draft."""

    Config = NoConfig

    def max_length(self, state: RoundView, hint: LengthHint | None = None) -> int:
        return 0


__all__ = [
    "DEFAULT_NAMES",
    "FAST_OVERRIDES",
    "AlwaysAcceptDrafter",
    "FakeClock",
    "NeverAcceptDrafter",
    "NoConfig",
    "RejectAllVerifier",
    "ZeroLength",
    "default_strategy_instance",
    "prepare_context",
    "random_prompt",
    "synthetic_cost_model",
]


def device_ops(
    random: RandomStream | None = None,
    *,
    top1: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    block: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    device: torch.device | str = "cpu",
) -> DeviceOps:
    """The engine's ops as an eager run gives them (`framework.engine.execution.work.EagerOps`), to call a
    device function directly in a test: ``fn(device_ops(verifier.random), *inputs, **params)``.

    Args:
        random: the stream ``ops.uniform`` / ``ops.exponential`` draw from.
        top1: what ``ops.top1(hidden, draft_head=...)`` runs (e.g. ``state.top1_from_hidden``).
        block: what ``ops.block(b, states)`` runs (e.g. ``partial(state.forward_block, position=p)``).
        device: where the draws are made.
    """

    def no_head(hidden: torch.Tensor, *, draft_head: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("device_ops was given no top1")

    return EagerOps(top1 or no_head, block, random, torch.device(device))
