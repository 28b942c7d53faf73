"""Which tokens a reduced draft head scores: a ranking of the vocabulary by the model's own output.

`TokenRanking` holds every token id of one vocabulary in rank order. `build_ranking` counts the
model's tokens on a corpus it generates itself (the calibration prompts and its greedy answers to
them, decoded with the plain decoder) and ranks by count, ties by token id (byte-pair vocabularies
number earlier, more frequent merges lower, so id order is a sensible prior for the tokens the small
corpus never saw), the end-of-sequence tokens always first. `model_ranking` caches it per model in
``<cache>/rankings/`` under the model's weight fingerprint (`ModelAdapter.fingerprint`); a file
(``vocab_file``) overrides it. `draft_head_for` turns the top K into the
`framework.engine.draft_head.DraftHead` of a `PrepareContext`, once per experiment.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from framework.engine.decoding import StopCondition, VanillaDecoder
from framework.engine.draft_head import MIN_SIZE, DraftHead
from framework.utils import cache_dir

#: Version tag of the saved-ranking format.
FORMAT = "selfspec-token-ranking/1"
#: What the built ranking is counted on; part of the cache key (change it when the corpus changes).
CORPUS = "calibration-prompts+greedy-answers/v1"
#: Tokens of greedy answer generated per calibration prompt for the counts.
CORPUS_NEW_TOKENS = 128


@dataclass(frozen=True)
class TokenRanking:
    """Every token id of one vocabulary, most frequent first.

    Attributes:
        order: all V token ids in rank order.
        counts: occurrences of each counted token in the corpus (tokens not in it: 0).
        source: what the counts come from (the corpus description or a file path).
        fingerprint: the model's weight fingerprint (`ModelAdapter.fingerprint`) or ``""``.
        always: token ids ranked first whatever their count (end-of-sequence tokens).
    """

    order: tuple[int, ...]
    counts: dict[int, int]
    source: str = ""
    fingerprint: str = ""
    always: tuple[int, ...] = ()

    @classmethod
    def from_counts(
        cls, counts: dict[int, int], vocab_size: int, *, always: Iterable[int] = (), **meta: Any
    ) -> TokenRanking:
        """Rank ``always`` first, then counted tokens by count (descending), then the rest; ties
        by token id (ascending: byte-pair vocabularies number earlier, more frequent merges lower).

        Raises:
            ValueError: a token id outside ``[0, vocab_size)``.
        """
        pinned = [int(t) for t in dict.fromkeys(always)]
        for t in (*pinned, *counts):
            if not 0 <= int(t) < vocab_size:
                raise ValueError(f"token id {t} outside the vocabulary [0, {vocab_size})")
        first = set(pinned)
        rest = sorted((t for t in range(vocab_size) if t not in first), key=lambda t: (-counts.get(t, 0), t))
        return cls(
            order=tuple(pinned + rest),
            counts={int(t): int(c) for t, c in counts.items() if c},
            always=tuple(pinned),
            **meta,
        )

    @property
    def vocab_size(self) -> int:
        return len(self.order)

    def top(self, k: int) -> list[int]:
        """The first ``k`` token ids (``k`` clamped to V)."""
        return list(self.order[: max(0, k)])

    def coverage(self, tokens: Iterable[int], k: int) -> float:
        """Share of ``tokens`` among the top ``k`` (0.0 for no tokens)."""
        top = set(self.top(k))
        toks = list(tokens)
        return sum(t in top for t in toks) / len(toks) if toks else 0.0

    # ---- files --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "source": self.source,
            "fingerprint": self.fingerprint,
            "vocab_size": self.vocab_size,
            "always": list(self.always),
            "counted_tokens": sum(self.counts.values()),
            "order": list(self.order),
            "counts": {str(t): c for t, c in sorted(self.counts.items(), key=lambda kv: -kv[1])},
        }

    def save(self, path: str | Path) -> Path:
        """Write atomically (a temporary file, then a rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict()))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | Path, vocab_size: int) -> TokenRanking:
        """Read a saved ranking, or a JSON list of token ids (most frequent first; the ids not
        listed follow in id order), or a text file with one token id per line.

        Raises:
            ValueError: unreadable file, ids out of range, or a saved ranking of another
                vocabulary size (the message names the file).
        """
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as err:
            raise ValueError(f"token ranking {str(p)!r} cannot be read: {err.strerror or err}") from None
        try:
            data: Any = json.loads(text)
        except json.JSONDecodeError:
            try:
                data = [int(line) for line in text.split() if line.strip()]
            except ValueError:
                raise ValueError(
                    f"token ranking {str(p)!r} is neither JSON nor one token id per line"
                ) from None
        if isinstance(data, dict):
            if data.get("format") != FORMAT or "order" not in data:
                raise ValueError(f"token ranking {str(p)!r} is not a {FORMAT} file")
            if int(data.get("vocab_size", -1)) != vocab_size:
                raise ValueError(
                    f"token ranking {str(p)!r} is for a vocabulary of {data.get('vocab_size')} tokens, "
                    f"the model has {vocab_size}"
                )
            order = [int(t) for t in data["order"]]
            if sorted(order) != list(range(vocab_size)):
                raise ValueError(f"token ranking {str(p)!r}: 'order' is not a permutation of the vocabulary")
            return cls(
                order=tuple(order),
                counts={int(t): int(c) for t, c in data.get("counts", {}).items()},
                source=str(data.get("source", str(p))),
                fingerprint=str(data.get("fingerprint", "")),
                always=tuple(int(t) for t in data.get("always", ())),
            )
        if not isinstance(data, list) or not all(isinstance(t, int) for t in data):
            raise ValueError(f"token ranking {str(p)!r} must hold a list of token ids")
        listed = list(dict.fromkeys(data))
        counts = {t: len(listed) - i for i, t in enumerate(listed)}  # listed order, then id order
        try:
            return cls.from_counts(counts, vocab_size, source=str(p))
        except ValueError as err:
            raise ValueError(f"token ranking {str(p)!r}: {err}") from None


def count_tokens(sequences: Iterable[Sequence[int]]) -> Counter[int]:
    """Occurrences of every token id in ``sequences``."""
    c: Counter[int] = Counter()
    for seq in sequences:
        c.update(int(t) for t in seq)
    return c


def corpus_sequences(ctx: Any, new_tokens: int = CORPUS_NEW_TOKENS) -> list[list[int]]:
    """The counting corpus: each calibration prompt (chat-formatted) and the model's greedy answer
    to it (at most ``new_tokens`` tokens, stopped at end of sequence), decoded with the plain
    autoregressive decoder.

    Raises:
        ValueError: the context has no calibration prompts (the message says why).
    """
    texts = ctx.calibration_prompts()
    dec = VanillaDecoder(ctx.adapter)
    stop = StopCondition(new_tokens, ctx.eos_token_ids)
    out = []
    for text in texts:
        ids = ctx.encode(text)
        res = dec.generate(torch.tensor([ids], device=ctx.adapter.arch.device), stop)
        out.append(list(ids) + list(res.tokens))
    return out


def build_ranking(ctx: Any, *, new_tokens: int = CORPUS_NEW_TOKENS) -> TokenRanking:
    """Count the model's tokens on `corpus_sequences` and rank the vocabulary (`TokenRanking.from_counts`)."""
    adapter = ctx.adapter
    seqs = corpus_sequences(ctx, new_tokens)
    return TokenRanking.from_counts(
        count_tokens(seqs),
        adapter.arch.info().vocab_size,
        always=sorted(ctx.eos_token_ids),
        source=f"{CORPUS} ({len(seqs)} prompts, {sum(map(len, seqs))} tokens)",
        fingerprint=adapter.arch.fingerprint(),
    )


def ranking_path(adapter: Any) -> Path:
    """Where the built ranking of this model is cached."""
    tag = CORPUS.replace("/", "-").replace("+", "-")
    return cache_dir() / "rankings" / f"{adapter.arch.fingerprint()}-{tag}.json"


def model_ranking(ctx: Any) -> TokenRanking:
    """The built ranking of ``ctx``'s model: from ``ctx.prepared``, else the cache file (if its
    fingerprint matches), else `build_ranking` (then saved to the cache)."""
    return ctx.once(TokenRanking, CORPUS, lambda: _load_or_build_ranking(ctx))


def _load_or_build_ranking(ctx: Any) -> TokenRanking:
    adapter = ctx.adapter
    path = ranking_path(adapter)
    ranking = None
    if path.exists():
        try:
            ranking = TokenRanking.load(path, adapter.arch.info().vocab_size)
        except ValueError:
            ranking = None  # unreadable or another vocabulary: build again
        if ranking is not None and ranking.fingerprint != adapter.arch.fingerprint():
            ranking = None
    if ranking is None:
        t0 = time.perf_counter()
        ctx.log(f"[draft_vocab] ranking the vocabulary by the model's own tokens ({CORPUS}), once per model")
        ranking = build_ranking(ctx)
        try:
            ranking.save(path)
        except OSError as err:  # a read-only cache is not fatal: the ranking is rebuilt next time
            ctx.log(f"[draft_vocab] could not cache the ranking in {path}: {err}")
        ctx.log(
            f"[draft_vocab] ranked in {time.perf_counter() - t0:.1f} s: {ranking.source}; cached in {path}"
        )
    return ranking


def draft_head_for(ctx: Any, size: int, vocab_file: str = "", *, context: bool = True) -> DraftHead:
    """The draft head of the ``size`` top-ranked tokens of ``ctx``'s model, built once per context.

    Args:
        ctx: a `PrepareContext`.
        size: K, in ``[MIN_SIZE, V]`` (`framework.engine.draft_head.MIN_SIZE`).
        vocab_file: a ranking file (`TokenRanking.load`) used instead of the built ranking.
        context: each generation's head also scores its context's tokens (`DraftHead`).

    Raises:
        ValueError: a bad size or ranking file (the message says what is allowed).
    """
    return ctx.once(
        DraftHead, (size, vocab_file, context), lambda: _build_head(ctx, size, vocab_file, context)
    )


def _build_head(ctx: Any, size: int, vocab_file: str, context: bool) -> DraftHead:
    vocab = ctx.adapter.arch.info().vocab_size
    if not MIN_SIZE <= size <= vocab:
        raise ValueError(f"a draft head needs between {MIN_SIZE} and V = {vocab} tokens, got {size}")
    if vocab_file:
        ranking = TokenRanking.load(vocab_file, vocab)
        ranking = TokenRanking.from_counts(
            {t: vocab - i for i, t in enumerate(ranking.order)},
            vocab,
            always=sorted(ctx.eos_token_ids),
            source=ranking.source,
        )
    else:
        ranking = model_ranking(ctx)
    name = f"top-{size} of {ranking.source}" + (" + context" if context else "")
    return DraftHead(ctx.adapter, ranking.top(size), name=name, context=context)
