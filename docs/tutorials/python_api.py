"""The Python API of the docs' first page, run on the tiny random model (no download, seconds):

    python docs/tutorials/python_api.py

The page uses the embedded default model (``model=`` left out) and English prompts; the tiny
model's word-level tokenizer knows only words ``w0`` ... ``w122``, so the prompt here is made of
those. The numbers it prints mean nothing (a random model has no redundant layers); the test suite
runs it (``tests/test_docs.py``) to keep the page's calls working.
"""

from __future__ import annotations

import selfspec
from framework import LayerPlan, LayerSelector, RoundView

MODEL = "tiny-random"
PROMPT = "w5 w9 w13 w2 w7"


class EveryOtherMlp(LayerSelector):
    """A researcher's own selector, not registered: skip the MLP of every other block."""

    def __init__(self) -> None:
        super().__init__(config=object())

    def plan(self, state: RoundView) -> LayerPlan:
        n = state.info.num_layers
        return LayerPlan.from_indices(n, mlp=range(1, n, 2))


def main() -> None:
    dec = selfspec.Decoder.from_preset("swift", model=MODEL, max_new_tokens=32, log=None)
    out = dec.generate(PROMPT)
    print(repr(dec))
    print(
        f"{len(out.tokens)} tokens, M {out.stats.mean_accepted_length:.2f}, alpha {out.stats.acceptance_rate:.3f}"
    )
    print("phases (s):", {k: round(v, 4) for k, v in out.stats.phase_times.items()})
    print("plans per drafting round:", len(out.stats.plans))
    cmp = dec.compare(PROMPT)
    print(cmp)
    assert cmp.lossless, cmp.first_mismatch

    # the same model object, already loaded, with a researcher's own strategy instance
    mine = selfspec.Decoder.from_strategies(
        selector=EveryOtherMlp(), length="confidence", model=dec.model, tokenizer=dec.tokenizer, log=None
    )
    cmp = mine.compare(PROMPT, max_new_tokens=16)
    print(cmp)
    assert cmp.lossless, cmp.first_mismatch
    print("ok")


if __name__ == "__main__":
    main()
