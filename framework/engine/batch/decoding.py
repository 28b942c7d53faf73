"""Decoding B sequences at once: each row its own generation, the rows' forwards merged.

`BatchDecoder` runs a one-sequence decoder (`SpeculativeDecoder` or `VanillaDecoder`) for each row
of a batch, each row with its own strategy instances (`Strategy.for_row`: row 0 the decoder's own,
the others copies with their own random streams), its own decode state and its own row of one KV
buffer (`framework.engine.batch.rows`). The rows run in lockstep (`framework.engine.batch.lockstep`):
the draft steps of the rows still drafting are one forward, a round's verification is one forward
for every row, and a row that finished leaves the forwards. Each row's tokens are what the same
decoder gives that prompt alone (the tests check it token for token), because each row runs exactly
the one-sequence code and only the forwards are shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from framework.engine.batch.lockstep import Lockstep, RowAdapter
from framework.engine.batch.rows import BatchCache
from framework.engine.decoding import GenerationResult, StopCondition, capacity_for
from framework.utils import synced_clock


@dataclass
class BatchResult:
    """One batch's generations.

    Attributes:
        rows: each row's `GenerationResult`, in the prompts' order (a row's ``wall_time`` runs
            from its prefill to its last round, while the other rows ran too).
        wall_time: seconds from the first prefill to the last row's end.
        forwards: forwards the model ran (a merged forward counts once).
        row_forwards: the rows those forwards held (``row_forwards / forwards``: rows per forward).
        verifications: the forwards among them that verified (one per round for the batch).
        prefill_seconds: spent in the rows' prefills (each row's alone, first).
    """

    rows: list[GenerationResult]
    wall_time: float
    forwards: int = 0
    row_forwards: int = 0
    verifications: int = 0
    prefill_seconds: float = 0.0
    #: what a finished row costs: nothing, it leaves the forwards
    finished_rows: str = field(default="leave")

    @property
    def new_tokens(self) -> int:
        return sum(r.new_tokens for r in self.rows)

    @property
    def tokens_per_second(self) -> float:
        """New tokens of every row over the batch's wall time."""
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0


class BatchDecoder:
    """Generations of up to ``batch_size`` prompts at a time through ``decoder``'s method.

    Args:
        decoder: a one-sequence decoder with ``for_row(row, adapter)`` (`SpeculativeDecoder`,
            `VanillaDecoder`).
        batch_size: B >= 1, the most rows decoded together.

    Raises:
        ValueError: ``batch_size`` < 1, or a model split across devices (one KV buffer serves
            the batch).
    """

    def __init__(self, decoder: Any, batch_size: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if decoder.adapter.placement.split:
            raise ValueError("batched decoding needs the model on one device (it is split: --device-map)")
        self.decoder, self.batch_size = decoder, batch_size
        self._rows: dict[int, Any] = {}  # row -> its decoder's strategies, kept across batches

    @property
    def adapter(self) -> Any:
        return self.decoder.adapter

    def generate(self, prompts: Sequence[torch.Tensor], stops: Sequence[StopCondition]) -> BatchResult:
        """Decode ``prompts`` (each LongTensor (1, P_r)) together, row r stopping by ``stops[r]``.

        Raises:
            ValueError: more prompts than ``batch_size``, or not one stop condition per prompt.
        """
        b = len(prompts)
        if not 1 <= b <= self.batch_size:
            raise ValueError(f"a batch holds 1 to {self.batch_size} prompts, got {b}")
        if len(stops) != b:
            raise ValueError(f"one stop condition per prompt: {b} prompts, {len(stops)} stop conditions")
        a = self.adapter.arch
        draft = getattr(self.decoder, "max_draft", 0)
        capacity = max(
            capacity_for(p.shape[1], s.max_new_tokens, draft) for p, s in zip(prompts, stops, strict=False)
        )
        cache = BatchCache(
            a.num_layers, b, a.num_kv_heads, a.head_dim, capacity + draft + 1, self.adapter.kv_dtype, a.device
        )
        lockstep = Lockstep(self.adapter.executor, cache)
        decoders = [self._row_decoder(r, RowAdapter(self.adapter, r, lockstep)) for r in range(b)]
        clock = synced_clock(a.device)
        t0 = clock()
        rows = lockstep.run(
            [
                lambda d=d, p=p, s=s: d.generate(p, s)
                for d, p, s in zip(decoders, prompts, stops, strict=False)
            ]
        )
        return BatchResult(
            rows,
            clock() - t0,
            lockstep.forwards,
            lockstep.row_forwards,
            lockstep.verifications,
            lockstep.prefill_seconds,
        )

    def _row_decoder(self, row: int, adapter: RowAdapter) -> Any:
        """Row ``row``'s decoder on ``adapter``; its strategies are made once and kept, so that a
        row's random stream continues from one batch to the next as a decoder's does."""
        if row not in self._rows:
            self._rows[row] = self.decoder.for_row(row, self.adapter)
        return self._rows[row].on(adapter)
