"""A generation's committed tokens: one device buffer, row 0 mirrored on the host, positions.

`framework.engine.state.DecodeState` holds one. The buffer grows when a commit would overflow it;
the host mirror (`CommittedTokens.ids`) is a prefix of row 0 that commits extend with what they
already brought to the host, so a strategy's `framework.view.RoundView.token_ids` costs no read
for them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class CommittedTokens:
    """The prompt and every committed new token, (B, N) on ``device``, in a buffer of ``capacity``.

    Args:
        prompt_ids: LongTensor (B, P), P >= 1.
        capacity: token slots to preallocate (more are added when needed).
        device: where the buffer lives.
    """

    def __init__(self, prompt_ids: torch.Tensor, capacity: int, device: torch.device) -> None:
        self.device, self.count = device, int(prompt_ids.shape[1])
        with torch.inference_mode(False):  # writable outside inference mode too
            size = max(capacity, self.count) + 1
            self.buffer = torch.zeros(prompt_ids.shape[0], size, dtype=torch.long, device=device)
            self._arange = torch.arange(size + 64, device=device)
        self.buffer[:, : self.count] = prompt_ids.to(device)
        #: row 0's tokens known on the host, a prefix of ``buffer[0]``
        self._host: list[int] = prompt_ids[0].tolist() if prompt_ids.device.type == "cpu" else []

    def span(self, start: int, end: int | None = None) -> torch.Tensor:
        """LongTensor (B, end - start): tokens ``[start, end)`` (``end``: all committed), a view."""
        return self.buffer[:, start : self.count if end is None else end]

    def positions(self, start: int, n: int) -> torch.Tensor:
        """Positions ``start .. start + n - 1`` (B, n): a view of one arange."""
        if start + n > self._arange.shape[0]:
            with torch.inference_mode(False):
                self._arange = torch.arange(2 * (start + n), device=self.device)
        return self._arange[start : start + n][None].expand(self.buffer.shape[0], n)

    def append(self, tokens: torch.Tensor, host: Sequence[int] | None = None) -> None:
        """Append (B, n) tokens; ``host``: row 0's as ints when the caller has them (no read later)."""
        n, buf = tokens.shape[1], self.buffer
        if self.count + n > buf.shape[1]:
            with torch.inference_mode(False):
                grow = torch.zeros(buf.shape[0], 2 * buf.shape[1] + n, dtype=torch.long, device=self.device)
            grow[:, : self.count] = buf[:, : self.count]
            self.buffer = grow
        self.buffer[:, self.count : self.count + n] = tokens
        if host is not None and len(self._host) == self.count:
            self._host.extend(host)
        self.count += n

    def known_on_host(self, tokens: Sequence[int]) -> None:
        """Row 0's last ``len(tokens)`` tokens, appended without ``host``, as the host read them."""
        if len(self._host) + len(tokens) == self.count:
            self._host.extend(tokens)

    def ids(self) -> list[int]:
        """Row 0's tokens as Python ints; what commits did not bring to the host is read once. The
        mirror itself: do not modify it."""
        del self._host[self.count :]
        if len(self._host) < self.count:
            self._host.extend(self.buffer[0, len(self._host) : self.count].tolist())
        return self._host
