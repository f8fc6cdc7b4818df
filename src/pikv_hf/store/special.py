"""``SpecialSlots``: where each (row, KV head)'s sink and recent-window tokens sit in a store's pool.

Sparse reads (routed, Quest) always read a row's first ``n_sink`` real tokens and its ``window`` newest ones. The
store finds their slots once by scanning its frame (after a prefill, or after its pages moved), then keeps the recent
ones as tokens arrive, so a decode step never scans the frame.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_NONE = torch.iinfo(torch.int64).max


@dataclass
class SpecialSlots:
    """Flat pool slots (``-1``: none) of the sinks ``[B, H, n_sink]`` and of the newest tokens ``[B, H, window]``
    (oldest first); ``short``: a row had fewer than ``n_sink`` real tokens (scan again when asked next)."""

    n_sink: int
    window: int
    sinks: torch.Tensor
    recent: torch.Tensor
    short: bool

    @classmethod
    def scan(
        cls, pos: torch.Tensor, valid: torch.Tensor, slots: torch.Tensor, n_sink: int, window: int,
        row_start: torch.Tensor,
    ) -> SpecialSlots:  # fmt: skip
        """From a frame's ``pos`` (int64), ``valid`` and flat ``slots`` (all ``[B, H, C]``); sinks count positions
        from ``row_start`` (``[B]``)."""

        def ranked(key: torch.Tensor, k: int, largest: bool) -> torch.Tensor:
            k_in = min(k, key.shape[-1])
            at = key.topk(k_in, dim=-1, largest=largest).indices
            found = torch.where(key.gather(2, at).abs() != _NONE, slots.gather(2, at), -1)
            return torch.nn.functional.pad(found, (0, k - k_in), value=-1)

        rel = pos - row_start.view(-1, 1, 1)
        sinks = ranked(torch.where(valid & (rel < n_sink), rel, _NONE), n_sink, largest=False)
        recent = ranked(torch.where(valid, pos, -_NONE), window, largest=True).flip(-1)  # oldest first
        short = bool((sinks < 0).any()) if n_sink else False
        return cls(n_sink, window, sinks, recent, short)

    def fits(self, n_sink: int, window: int) -> bool:
        """Whether these slots answer a request for ``n_sink`` sinks and ``window`` recent tokens."""
        return (self.n_sink, self.window) == (n_sink, window) and not self.short

    def push(self, slot: torch.Tensor) -> None:
        """The newest tokens (``[B, H, q]`` slots, ``-1`` for absent ones) enter the recent window."""
        self.recent = torch.cat([self.recent, slot], -1)[..., -self.window :]

    def all(self) -> torch.Tensor:
        """``[B, H, n_sink + window]``: sinks, then the recent tokens."""
        return torch.cat([self.sinks, self.recent], -1)
