"""Tutorial script: make your strategy fast on a GPU, checked on a CPU.

The page ``docs/tutorials/fast_strategy.md`` includes this file section by section, so the code on
the page is exactly the code that runs here:

    python docs/tutorials/fast_strategy.py
    PYTHONPATH=docs/tutorials python experiments/run.py --import fast_strategy --selector block_influence
    PYTHONPATH=docs/tutorials python experiments/run.py --import fast_strategy --drafter last_match

Nothing is downloaded: the models are random Llamas built in-process (``--model tiny-random`` on
the command line).
"""

# --8<-- [start:selector]
from __future__ import annotations

from dataclasses import dataclass

import torch

from framework import (
    DeviceOps,
    Draft,
    LayerPlan,
    LayerSelector,
    ModelInfo,
    RoundView,
    Verification,
    register_selector,
)
from framework.config_fields import check_range, param


def block_influence(ops: DeviceOps, chain: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each block's influence on the verified tokens: one minus the cosine between the residual
    stream before and after it (ShortGPT's Block Influence, Men et al., 2024), averaged over the
    positions. ``chain``: (L+1, B, T, d), every block's output of the verified chain."""
    h = chain[:, 0].float()  # (L+1, T, d)
    cos = torch.nn.functional.cosine_similarity(h[:-1], h[1:], dim=-1)  # (L, T)
    return {"influence": (1.0 - cos).mean(dim=-1)}  # (L,)


@dataclass(frozen=True)
class BlockInfluenceConfig:
    num_skip: int = param(2, help="blocks whose sub-layers the draft skips; in [1, L-2]")
    decay: float = param(0.9, help="weight of the running influence per round; in [0, 1)")

    def __post_init__(self) -> None:
        check_range("num_skip", self.num_skip, 1, None, integer=True)
        check_range("decay", self.decay, 0.0, 1.0, hi_open=True)


@register_selector("block_influence", config=BlockInfluenceConfig)
class BlockInfluenceSelector(LayerSelector):
    """Skip the blocks that changed the verified tokens' hidden states least (running Block
    Influence, ShortGPT's layer-importance metric, measured on each verified chain).

    A tutorial strategy, not a published self-speculative method.
    """

    needs_hidden_states = True  # the verify pass returns every block's output

    def setup(self, info: ModelInfo) -> None:
        if not 1 <= self.config.num_skip <= info.num_layers - 2:
            raise ValueError(f"num_skip must be in [1, {info.num_layers - 2}] for this model")
        self._layers = info.num_layers
        self._influence = [1.0] * info.num_layers  # nothing measured yet: every block matters

    def reads(self, state: RoundView, chain: torch.Tensor) -> dict[str, torch.Tensor]:
        # The device work: the engine keys it, runs it as one graph on a GPU and reads its
        # values with the round's one read.
        return state.compute(block_influence, chain)

    def plan(self, state: RoundView) -> LayerPlan:
        if state.round == 0:  # the prompt's influence came with the first token
            self._update(state.values_for(self).get("influence"))
        inner = range(1, self._layers - 1)  # keep the first and the last block
        skip = sorted(inner, key=self._influence.__getitem__)[: self.config.num_skip]
        return LayerPlan.from_indices(self._layers, attn=skip, mlp=skip)

    def observe(self, state: RoundView, draft: Draft, result: Verification) -> None:
        self._update(state.values_for(self).get("influence"))  # this round's, by name

    def _update(self, influence: list[float] | None) -> None:
        if influence is None:
            return
        w = self.config.decay
        self._influence = [
            w * old + (1 - w) * new for old, new in zip(self._influence, influence, strict=True)
        ]

    def summary(self) -> dict:
        return {"influence": [round(x, 4) for x in self._influence]}


# --8<-- [end:selector]


# --8<-- [start:drafter]
from framework import Drafter, DraftView, LengthController, register_drafter  # noqa: E402


@dataclass(frozen=True)
class LastMatchConfig:
    min_match: int = param(2, help="the context's last N tokens must occur earlier in it to copy; >= 1")

    def __post_init__(self) -> None:
        check_range("min_match", self.min_match, 1, None, integer=True)


@register_drafter("last_match", config=LastMatchConfig)
class LastMatchDrafter(Drafter):
    """Copy what followed the last earlier occurrence of the context's last ``min_match`` tokens
    (no forward); where there is none, draft with the selector's plan, one token a forward.

    A tutorial strategy (a small prompt-lookup with a layer-skip fallback; the registered
    ``hybrid`` drafter is the full one), not a published method.
    """

    def draft(self, state: DraftView, plan: LayerPlan, length: LengthController, max_tokens: int) -> Draft:
        ids, n = state.token_ids(), self.config.min_match  # committed tokens on the host: no read
        for start in range(len(ids) - n - 1, -1, -1):  # the latest earlier match first
            if ids[start : start + n] == ids[-n:]:
                return state.copied_draft(ids[start + n : start + n + max_tokens], plan, 1.0)
        x = state.pending  # (B, 1): the last committed token, the first draft input
        for step in range(max_tokens):
            token, confidence = state.draft_step(x, plan)  # the engine picks the token
            if step + 1 >= max_tokens or not length.should_continue(step + 1, confidence):
                break
            x = token[:, None]
        return state.drafted(plan)  # the tokens the steps chose, as the verifier wants them


# --8<-- [end:drafter]


# --8<-- [start:check]
def fast_and_lossless(selector, length: str, drafter="layer_skip", seed: int = 40) -> dict:
    """Within the host-work limits, and greedy speculative output equal to plain greedy output on
    3 random prompts; returns the strategies' summaries of the last decode."""
    import selfspec
    from framework.testing import measure_host_work, random_prompt, tiny_model, tiny_tokenizer

    report = measure_host_work(selector, length, drafter, "greedy")
    print(report.describe(top=3))
    assert report.within_limits, report.describe()
    dec = selfspec.Decoder.from_strategies(
        selector=selector,
        length=length,
        drafter=drafter,
        model=tiny_model("llama", 8, seed=0),
        tokenizer=tiny_tokenizer(),
        max_new_tokens=24,
        log=None,
    )
    for i in range(3):
        cmp = dec.compare(random_prompt(10, 128, seed + i)[0].tolist(), warmup=False)
        assert cmp.lossless, f"prompt {i}: speculative output differs from vanilla greedy"
    return {kind: s.summary() for kind, s in dec.strategies.items()}


def check_fast_and_lossless() -> None:
    summaries = fast_and_lossless(BlockInfluenceSelector(), "fixed")
    print("the selector: lossless on 3 prompts; running influence:", summaries["selector"]["influence"])
    fast_and_lossless(BlockInfluenceSelector(), "confidence", LastMatchDrafter(), seed=50)
    print("the drafter: within the limits and lossless on 3 prompts")


# --8<-- [end:check]


# --8<-- [start:slow]
class ClosureInfluenceSelector(BlockInfluenceSelector):
    """The same selector with its device work written as a closure over ``self``: the engine
    cannot key it (``self`` may change between calls), so it runs eagerly, with a warning."""

    def reads(self, state: RoundView, chain: torch.Tensor) -> dict[str, torch.Tensor]:
        scale = self.config.decay  # a value the function reads from its enclosing scope

        def influence(ops: DeviceOps, chain: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"influence": block_influence(ops, chain)["influence"] * (scale / scale)}

        return state.compute(influence, chain)


def show_what_stays_slow() -> None:
    from framework.testing import measure_host_work

    report = measure_host_work(ClosureInfluenceSelector(), "fixed", "layer_skip", "greedy")
    print(report.describe(top=3))
    assert not report.within_limits and report.eager


# --8<-- [end:slow]


# --8<-- [start:cli]
def run_from_the_command_line(out_dir: str) -> None:
    from framework.results.records import read_records
    from framework.runner.cli import main

    # what `python experiments/run.py --import fast_strategy --selector block_influence ...` runs
    code = main(
        [
            "--model", "tiny-random", "--selector", "block_influence", "--length", "fixed",
            "--limit", "1", "--categories", "qa,code", "--max-new-tokens", "16", "--warmup", "0",
            "--logger", "none", "--no-plots", "--output", f"{out_dir}/run",
        ]
    )  # fmt: skip
    assert code == 0
    records = [r for r in read_records(f"{out_dir}/run") if r["method"] != "vanilla"]  # the run's folder
    assert records and all(r["lossless"] for r in records), records


# --8<-- [end:cli]


# --8<-- [start:main]
if __name__ == "__main__":
    import tempfile

    check_fast_and_lossless()
    show_what_stays_slow()
    with tempfile.TemporaryDirectory() as tmp:
        run_from_the_command_line(tmp)
    print("ok")
# --8<-- [end:main]
