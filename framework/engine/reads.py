"""The round's device-to-host reads, in one path (`RoundReads`): a strategy's ``state.read`` of
named tensors, the values the strategies' ``reads`` ask of each verified chain (joined to that
read, or read by the engine at the commit when nothing could carry them), and what the engine
already knows on the host (`framework.engine.host_values`), which is never read again."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from framework.engine.host_values import HostValues

#: The decode state (`framework.engine.state.DecodeState`; not imported: it imports this).
DecodeState = Any


class RoundReads:
    """One generation's reads.

    Args:
        readers: strategies whose ``reads(state, chain)`` ask for values of each verified chain
            (and of the prompt), served by `values_for`.
    """

    def __init__(self, readers: Sequence[Any] = ()) -> None:
        self.readers = tuple(readers)
        #: what this round's reads, uploads and draft steps brought to the host
        self.known = HostValues()
        self._values: dict[Any, dict[str, list[Any]]] = {}
        self._chain: torch.Tensor | None = None  # the verified chain's (or the prompt's) states
        self._served = False
        self._round = 0

    def verified(self, chain: torch.Tensor | None) -> None:
        """A verification (or the prefill) ran: ``chain`` (L+1, B, T, d) are the states the readers
        read of, ``None`` for a tree (its path is known at the commit)."""
        self._chain, self._served = chain, False

    def device_work(self, round_: int) -> None:
        """Before device work: at a round's first, forget what the last round knew on the host."""
        if round_ != self._round:
            self.known.clear()
            self._round = round_

    def read(self, state: DecodeState, values: Mapping[str, torch.Tensor]) -> dict[str, list[Any]]:
        """``values`` by name as Python numbers (`framework.engine.state.DecodeState.read`)."""
        asked = []
        if not self._served and self._chain is not None:
            asked = self._asked(state, self._chain)
            self._served = True
        known = {k: h for k, h in ((k, self.known.of(v)) for k, v in values.items()) if h is not None}
        out = read_named(
            {
                **{k: v for k, v in values.items() if k not in known},
                **{f"{i}.{k}": v for i, (_, vals) in enumerate(asked) for k, v in vals.items()},
            }
        )
        for i, (strategy, vals) in enumerate(asked):
            self._values[strategy] = {k: out.pop(f"{i}.{k}") for k in vals}
        for k, h in out.items():
            self.known.remember(values[k], h)
        return {k: known[k] if k in known else out[k] for k in values}

    def values_for(self, strategy: Any) -> Mapping[str, list[Any]]:
        """What ``strategy``'s ``reads`` asked for, read (empty when it asked for nothing)."""
        return self._values.get(strategy, {})

    def commit(self, state: DecodeState, chain: torch.Tensor | None) -> None:
        """At the commit: when nothing carried the readers' values, read them of ``chain`` (the
        committed path's states, or ``None``) in one transfer; then the next round's."""
        if not self._served and self.readers:
            asked = self._asked(state, chain)
            if asked:
                got = read_named(
                    {f"{i}.{k}": v for i, (_, vals) in enumerate(asked) for k, v in vals.items()}
                )
                for i, (strategy, vals) in enumerate(asked):
                    self._values[strategy] = {k: got[f"{i}.{k}"] for k in vals}
        self._chain, self._served = None, False

    def _asked(
        self, state: DecodeState, chain: torch.Tensor | None
    ) -> list[tuple[Any, dict[str, torch.Tensor]]]:
        """Each reading strategy's values of ``chain``; every reader starts empty."""
        out = []
        for strategy in self.readers:
            self._values[strategy] = {}
            vals = strategy.reads(state, chain) if chain is not None else None
            if vals:
                out.append((strategy, dict(vals)))
        return out


def read_named(values: Mapping[str, torch.Tensor]) -> dict[str, list[Any]]:
    """``values`` read to the host in one transfer, by name: each flattened into Python numbers,
    ints for an integer (or boolean) tensor. One tensor reads as it is; several are concatenated,
    in their dtype when they share an integer one, else in float64 (exact for token ids and
    counts)."""
    flat = {k: v.reshape(-1) for k, v in values.items()}
    if not flat:
        return {}
    if len(flat) == 1:
        ((name, v),) = flat.items()
        return {name: v.tolist()}
    device = next(iter(flat.values())).device
    dtypes = {v.dtype for v in flat.values()}
    common = (
        dtypes.pop()
        if len(dtypes) == 1 and not flat[next(iter(flat))].dtype.is_floating_point
        else torch.float64
    )
    host = torch.cat([v.to(device, common) for v in flat.values()]).tolist()
    out, at = {}, 0
    for name, v in flat.items():
        n = v.numel()
        part = host[at : at + n]
        out[name] = part if v.is_floating_point() else [int(x) for x in part]
        at += n
    return out
