"""The reduced-vocabulary draft head, and compressed draft weights, as options of any drafter that
runs the LM head.

A drafter offers the option by deriving its config from `DraftVocabConfig` (the fields
``draft_vocab`` and ``vocab_file``) and mixing in `DraftVocab` (before `Drafter` in the bases),
which builds the head in ``prepare`` (`framework.engine.draft_head.draft_head_for`: once per
experiment, the token ranking once per model), returns it from ``draft_head()`` so that the decoder
hands it to the decode state and to the other strategies, and reports how many committed tokens the
head could have proposed (``summary()["vocab_coverage"]``). The drafter itself changes nothing:
the engine scores every draft step (``state.draft_step``) with the generation's head::

    @dataclass(frozen=True)
    class MyDrafterConfig(DraftVocabConfig):
        ...

    class MyDrafter(DraftVocab, Drafter):
        def draft(self, state: DraftView, plan, length, max_tokens):
            tok, conf = state.draft_step(state.pending, plan)
            ...

The same mixin offers ``draft_weights`` ("bfloat16", "int8", "int4", "fp8" or "auto"): draft passes run a
compressed copy of the model's weights (`framework.engine.adapter.ModelAdapter.draft_branches`: the
CPU kernels' fused branches, or the modules' low-bit linear layers elsewhere), returned by
``draft_weights()`` and handed on like the head. A self-speculative draft then saves bytes in every
sub-layer it runs, not only in those it skips (a quantised self-draft, as in QSpec or ML-SpecQD;
our own code): on a memory-bound CPU an int8 copy streams a quarter of the bytes. Verification
keeps the float32 model, so greedy output is unchanged and sampling stays exact (q is whatever
distribution the draft sampled from).

See `framework.engine.draft_head` for what the head is and why greedy and sampling stay exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework.config_fields import ConfigError, check_choice, check_range, check_types, param
from framework.engine.adapter import DRAFT_WEIGHT_FORMATS
from framework.engine.draft_head import DraftHead, HeadNotLinear, LiveDraftHead
from framework.interfaces import PrepareView
from framework.kernels.protocols import DraftWeights
from framework.view import RoundView

#: The smallest ``draft_vocab`` (K) accepted: tree verification keeps up to 10 candidates per step.
MIN_DRAFT_VOCAB = 16


@dataclass(frozen=True)
class DraftVocabConfig:
    """Config base of drafters that run the LM head: the reduced draft head's two fields."""

    draft_vocab: int = param(
        0,
        help=f"K: drafts score only the K most frequent tokens of the model's own output (a reduced "
        f"LM head, FR-Spec's frequency-ranked drafting; verification keeps the full head, output "
        f"unchanged); 0 (or K >= V) = the whole vocabulary; else >= {MIN_DRAFT_VOCAB}",
    )
    vocab_file: str = param(
        "",
        help="token ranking used instead of the one built from the model's own tokens: a saved ranking "
        "(JSON), a JSON list of token ids or one id per line, most frequent first; needs draft_vocab",
    )
    draft_weights: str = param(
        "float32",
        help="how draft passes store the model's weights: 'float32' (the model's own, whatever its "
        "dtype), 'bfloat16', 'int8', 'int4' or 'fp8' (a copy in bfloat16, int8 with one scale per "
        "output row, 4-bit with one scale per row and group of 64 inputs and int8 activations, or "
        "float8 e4m3 row-wise with per-token fp8 activations: fewer bytes for a memory-bound step to "
        "stream). The CPU kernels run bfloat16, int8 and int4 (fast with AVX-512 VNNI) in their fused "
        "branches; elsewhere (CUDA, fp8, a bfloat16 model) the blocks' linear layers run the copy "
        "through the model's modules (int4 there only as the slow float32 reference). "
        "'auto': int8 on the CPU kernels, else the fastest of fp8 and int8 that drafts faster than "
        "the model's own weights (measured once), else the model's own. The KV cache and "
        "verification keep the model's own weights, so the output is unchanged",
    )
    weights_check: bool = param(
        True,
        help="off the CPU kernels, draft once with the compressed copy and with the model's own "
        "weights (medians) and keep the copy only if it drafts faster; a copy without a fast "
        "kernel on this device (the float32 reference) is never kept. False keeps it regardless "
        "(acceptance studies); the run says what it drafted with",
    )
    compress_head: bool = param(
        True,
        help="with draft_weights compressed in the CPU kernels' fused branches, drafts also score the "
        "reduced head (draft_vocab) from a compressed copy of its rows (int8 for int8 and int4 "
        "weights, bfloat16 for bfloat16), so that a draft does not stream float32 head rows; False "
        "keeps the float32 rows (an ablation)",
    )
    vocab_context: bool = param(
        True,
        help="the reduced head also scores every token of the generation's context (prompt and answer "
        "so far), added as they appear (an extension beyond FR-Spec: names, numbers and identifiers "
        "recur); needs draft_vocab",
    )

    def __post_init__(self) -> None:
        check_types(self)
        check_range("draft_vocab", self.draft_vocab, 0, None, integer=True)
        check_choice("draft_weights", self.draft_weights, (*DRAFT_WEIGHT_FORMATS, "auto"))
        if 0 < self.draft_vocab < MIN_DRAFT_VOCAB:
            raise ConfigError(
                "draft_vocab", self.draft_vocab, f"0 (the whole vocabulary) or >= {MIN_DRAFT_VOCAB}"
            )
        if self.vocab_file and not self.draft_vocab:
            raise ConfigError("vocab_file", self.vocab_file, "empty unless draft_vocab is set (K > 0)")


class DraftVocab:
    """Mixin of a `Drafter` whose config derives from `DraftVocabConfig` (see the module docstring)."""

    config: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head: DraftHead | None = None
        self._prepared = False
        self._live: LiveDraftHead | None = None  # the last generation's head (its coverage counts)
        self._weights: DraftWeights | None = None
        self._weights_note = ""  # why draft_weights is not what the config asked for

    def prepare(self, ctx: PrepareView) -> None:
        """Build (or reuse) the head of ``draft_vocab`` tokens; none when K >= V (the whole
        vocabulary: a preset's K works on a model of any vocabulary). Choose the compressed
        weights ``draft_weights`` names (`PrepareView.compressed_weights`)."""
        c = self.config
        self._head = None
        self._prepared = True
        self._weights, self._weights_note = None, ""
        if c.draft_vocab and c.draft_vocab < ctx.info.vocab_size:
            try:
                self._head = ctx.reduced_head(c.draft_vocab, c.vocab_file, context=c.vocab_context)
            except HeadNotLinear as err:  # the architecture's, whatever the ranking
                raise ConfigError(
                    "--drafter.draft_vocab", c.draft_vocab, f"0 for this model ({err})"
                ) from None
            except ValueError as err:
                if c.vocab_file:
                    raise ConfigError("--drafter.vocab_file", c.vocab_file, f"usable: {err}") from None
                raise ConfigError("--drafter.draft_vocab", c.draft_vocab, f"usable: {err}") from None
        if c.draft_weights != "float32":
            self._weights, self._weights_note = ctx.compressed_weights(
                c.draft_weights, check=c.weights_check, compress_head=c.compress_head
            )
            if self._weights_note:
                ctx.log(f"note: {self._weights_note}")

    def use_head(self, head: DraftHead | None) -> None:
        """Draft with ``head`` (e.g. a search that must draft as the run's drafter does)."""
        self._head = head
        self._prepared = True

    def use_weights(self, weights: DraftWeights | None) -> None:
        """Draft with ``weights`` (e.g. a search that must draft as the run's drafter does)."""
        self._weights = weights

    def draft_weights(self) -> DraftWeights | None:
        """The compressed weights drafts run (built in ``prepare``); ``None``: the model's own."""
        return self._weights

    def draft_head(self) -> DraftHead | None:
        """The head drafts score tokens with; ``None``: the full vocabulary.

        Raises:
            RuntimeError: ``draft_vocab`` is set but ``prepare`` has not built the head.
        """
        if self._head is None and self.config.draft_vocab and not self._prepared:
            raise RuntimeError(
                f"{type(self).__name__} with draft_vocab={self.config.draft_vocab} builds its head in "
                "prepare(ctx): call SpeculativeDecoder.prepare (Session and selfspec.Decoder do)"
            )
        return self._head

    def follow_head(self, state: RoundView) -> None:
        """Remember the generation's head (``state.draft_head``) for `head_summary` (call from
        ``observe``)."""
        head = state.draft_head
        self._live = head if isinstance(head, LiveDraftHead) else None

    def head_summary(self) -> dict[str, Any]:
        """``draft_vocab`` (K), ``draft_vocab_now`` (K plus the context tokens added) and
        ``vocab_coverage`` (share of the committed tokens the head could propose when committed);
        ``draft_weights`` (the format drafts ran, when the config asks for a compressed one) and
        ``draft_head_weights`` (the format the head was scored in then)."""
        out: dict[str, Any] = {}
        if self.config.draft_weights != "float32":
            out["draft_weights"] = "float32" if self._weights is None else self._weights.weights
        if self._head is None:
            return out
        if self.config.draft_weights != "float32":
            out["draft_head_weights"] = getattr(self._weights, "head", None) or "float32"
        live = self._live
        out["draft_vocab"] = self._head.size
        if live is not None:
            out["draft_vocab_now"] = live.size
            out["vocab_coverage"] = round(live.covered / live.committed, 4) if live.committed else None
        return out
