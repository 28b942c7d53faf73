"""Logits processors and stopping criteria under speculation (issue 47, item 1).

A researcher's generation controls (``repetition_penalty``, ``no_repeat_ngram_size``,
``min_new_tokens``, bad and suppressed words, a `transformers.LogitsProcessorList` of their own)
are transformers' own processor classes, applied where plain decoding applies them: to the scores
of the next token, given every token before it. Under speculation one verify forward scores K + 1
next tokens at once, so each row is processed with *its own* prefix: the committed tokens, then
the block's tokens before that row (a token tree: the row's ancestors). Draft rows are processed
the same way, with the tokens drafted before them, so that a draft proposes what the processed
target would choose and acceptance holds.

Why this is lossless: the greedy verifier accepts ``d_j`` when it equals the argmax of row
``j - 1``'s processed scores, which are exactly the scores plain decoding with the processors
computes after the prefix ``committed + d_1..d_{j-1}``; the committed tokens are therefore plain
decoding's, token for token (the processors see the same ``input_ids`` and the same float32
scores). Speculative sampling warps the processed scores, as ``generate`` warps them after its
processors.

Processors run on the host, row by row, in float32 (as ``generate`` runs them): they are not part
of any CUDA graph, so a generation with processors runs its verification's rule and its draft
picks right after the forwards, and its host work per round grows with the rows processed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from framework.engine.grammar import GrammarProcessor
from framework.types import ForwardOutput

#: The settings `GenerationControls` builds transformers processors for, and their neutral values.
NEUTRAL = {
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "min_new_tokens": 0,
    "bad_words_ids": (),
    "suppress_tokens": (),
    "begin_suppress_tokens": (),
}


@dataclass(frozen=True)
class GenerationControls:
    """What a generation applies to each next token's scores, beyond the method's own choice.

    Attributes:
        repetition_penalty: transformers' ``RepetitionPenaltyLogitsProcessor`` (1.0: off).
        no_repeat_ngram_size: ``NoRepeatNGramLogitsProcessor`` (0: off).
        min_new_tokens: ``MinNewTokensLengthLogitsProcessor``: no end-of-sequence token before
            this many new tokens (0: off).
        bad_words_ids: ``NoBadWordsLogitsProcessor``: token sequences never generated.
        suppress_tokens: ``SuppressTokensLogitsProcessor``: tokens never generated.
        begin_suppress_tokens: ``SuppressTokensAtBeginLogitsProcessor``: tokens not generated first.
        processors: further processors (a `transformers.LogitsProcessor` each, e.g. a
            `transformers.LogitsProcessorList`'s), applied after those, in order.
        eos_token_ids: the end-of-sequence tokens ``min_new_tokens`` holds back.
        grammar: a `framework.engine.grammar.CompiledGrammar` the output must match: its mask is
            the last processor (`framework.engine.grammar.GrammarProcessor`), one matcher per
            generation.
    """

    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    min_new_tokens: int = 0
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    processors: tuple[Any, ...] = field(default=(), compare=False)
    eos_token_ids: tuple[int, ...] = ()
    grammar: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.repetition_penalty, (int, float)) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}")
        for name in ("no_repeat_ngram_size", "min_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.min_new_tokens and not self.eos_token_ids:
            raise ValueError("min_new_tokens needs the end-of-sequence token ids it holds back")
        for words in self.bad_words_ids:
            if not words:
                raise ValueError("bad_words_ids: every entry is a non-empty sequence of token ids")

    @property
    def active(self) -> bool:
        """Whether anything changes the scores."""
        return (
            bool(self.processors)
            or self.grammar is not None
            or any(getattr(self, k) != v for k, v in NEUTRAL.items())
        )

    def processors_for(self, prompt_len: int) -> Any:
        """The `transformers.LogitsProcessorList` of one generation whose prompt has
        ``prompt_len`` tokens, in `generate`'s order."""
        from transformers import (
            LogitsProcessorList,
            MinNewTokensLengthLogitsProcessor,
            NoBadWordsLogitsProcessor,
            NoRepeatNGramLogitsProcessor,
            RepetitionPenaltyLogitsProcessor,
            SuppressTokensAtBeginLogitsProcessor,
            SuppressTokensLogitsProcessor,
        )

        out = LogitsProcessorList()
        if self.no_repeat_ngram_size:
            out.append(NoRepeatNGramLogitsProcessor(self.no_repeat_ngram_size))
        if self.bad_words_ids:
            out.append(
                NoBadWordsLogitsProcessor([list(w) for w in self.bad_words_ids], list(self.eos_token_ids))
            )
        if self.repetition_penalty != 1.0:
            out.append(RepetitionPenaltyLogitsProcessor(float(self.repetition_penalty)))
        if self.min_new_tokens:
            out.append(
                MinNewTokensLengthLogitsProcessor(prompt_len, self.min_new_tokens, list(self.eos_token_ids))
            )
        if self.suppress_tokens:
            out.append(SuppressTokensLogitsProcessor(list(self.suppress_tokens)))
        if self.begin_suppress_tokens:
            out.append(SuppressTokensAtBeginLogitsProcessor(list(self.begin_suppress_tokens), prompt_len))
        out.extend(self.processors)
        if self.grammar is not None:
            out.append(GrammarProcessor(self.grammar.start(prompt_len)))
        return out


class LogitsProcessing:
    """One generation's processors, applied row by row with each row's own prefix.

    Args:
        processors: a `transformers.LogitsProcessorList` (or any callable
            ``(input_ids (B, N), scores (B, V)) -> scores``).
    """

    def __init__(self, processors: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.processors = processors
        self.rows_processed = 0
        #: the generation's `framework.engine.grammar.GrammarState` (its grammar processor's), or None
        self.grammar = (
            next(
                (p.state for p in processors if isinstance(p, GrammarProcessor)),  # type: ignore[attr-defined]
                None,
            )
            if isinstance(processors, (list, tuple))
            else None
        )

    def draft(
        self,
        committed: torch.Tensor,
        input_ids: torch.Tensor,
        out: ForwardOutput,
        logits_at: str | torch.Tensor | None,
        first: bool,
    ) -> ForwardOutput:
        """A draft forward's rows processed, each with its own prefix (the ``committed`` tokens,
        then this round's draft inputs after the pending token; ``first``: the round's first
        step), over the whole vocabulary (a reduced head's scores expanded, ``-inf`` outside it);
        the caller then chooses the token (nothing is picked inside such a forward)."""
        if first:
            self._fed: list[torch.Tensor] = []
        self._fed.append(input_ids)
        if out.logits is None:
            return out
        fed = torch.cat(self._fed, dim=1)  # [pending, drafted inputs ...]
        t, n = input_ids.shape[1], fed.shape[1]
        rows = list(range(n - t, n)) if not isinstance(logits_at, str) or logits_at == "all" else [n - 1]
        if isinstance(logits_at, torch.Tensor):
            rows = [n - t + int(r) for r in logits_at.tolist()]
        logits = out.logits if out.head is None else out.head.expand(out.logits)
        return replace(out, logits=self.rows(committed, fed, logits, rows=rows), head=None, picked=None)

    def verification(
        self,
        committed: torch.Tensor,
        input_ids: torch.Tensor,
        logits: torch.Tensor,
        logits_at: str | torch.Tensor | None,
        tree_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """A verify forward's ``logits`` processed, each row with its own prefix (the
        ``committed`` tokens, then the block's tokens before the row: a tree row's ancestors)."""
        t = input_ids.shape[1]
        rows: list[int] = list(range(t))
        if isinstance(logits_at, torch.Tensor):
            rows = [int(r) for r in logits_at.tolist()]
        elif logits_at == "last":
            rows = [t - 1]
        return self.rows(committed, input_ids, logits, tree_mask=tree_mask, rows=rows)

    def next(self, prefix: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The scores (B, V) of the token after ``prefix`` (B, N), processed, in float32."""
        self.rows_processed += 1
        return self.processors(prefix, logits.to(dtype=torch.float32, copy=True))

    def rows(
        self,
        committed: torch.Tensor,
        block: torch.Tensor,
        logits: torch.Tensor,
        *,
        tree_mask: torch.Tensor | None = None,
        rows: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """A block's scores, each row processed with its own prefix.

        Args:
            committed: LongTensor (B, N), the committed tokens, the block's first token (the
                pending one) last among them.
            block: LongTensor (B, T), the block whose rows were scored; ``block[:, 0]`` is
                ``committed[:, -1]``.
            logits: FloatTensor (B, T', V): the scores of rows ``rows`` (default: all T).
            tree_mask: BoolTensor (T, T) of a token tree: row j's prefix is its ancestors (the
                columns before j it sees), not every row before it.
            rows: which rows of the block ``logits`` holds (e.g. ``[T - 1]`` for the last only).

        Returns:
            FloatTensor (B, T', V) in float32.
        """
        t = block.shape[1]
        which = list(range(t)) if rows is None else list(rows)
        out = []
        for i, j in enumerate(which):
            if tree_mask is None:
                ahead = block[:, 1 : j + 1]
            else:
                seen = [c for c in range(1, j + 1) if bool(tree_mask[j, c])]
                ahead = block[:, seen]
            out.append(self.next(torch.cat([committed, ahead], dim=1), logits[:, i]))
        return torch.stack(out, dim=1)


def stop_cut(criteria: Any, prompt: torch.Tensor, new_tokens: Sequence[int], start: int) -> int | None:
    """Where a `transformers.StoppingCriteriaList` ends a generation: the number of new tokens to
    keep (the first position from ``start`` at which a criterion answers True, that token kept),
    or ``None``. Each position is checked with the tokens up to it, as ``generate`` checks them
    one token at a time (scores: ``None``)."""
    ids = torch.tensor([list(new_tokens)], dtype=torch.long)
    for i in range(start, len(new_tokens)):
        done = criteria(torch.cat([prompt.cpu(), ids[:, : i + 1]], dim=1), None)
        if bool(torch.as_tensor(done).any()):
            return i + 1
    return None
