"""``SpecialSlots``: where each (row, KV head)'s sink and recent-window tokens sit in a store's pool.

Sparse reads (routed, Quest) always read a row's first ``n_sink`` real tokens and its tokens of the last ``window``
positions. The store finds their slots once by scanning its frame (after a prefill, or after its pages moved), then
keeps the recent ones as tokens arrive, so a decode step never scans the frame. The recent ones are a ring over the
positions: entry ``n_sink + pos % window`` holds the newest stored token at a position ``pos`` of that residue, so a
new token overwrites the one ``window`` positions before it, which no query reads any more (each residue occurs once
among the last ``window`` positions): a decode step writes its token there in place, inside the append operator
(``pikv_hf.kernels.append``), instead of shifting the window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_NONE = torch.iinfo(torch.int64).max
EMPTY = -(2**62)  # the position kept for "no slot": below every reach
_SINK_REACH = 2**61  # a sink is read at any distance from the query


@dataclass
class SpecialSlots:
    """Flat pool slots (``-1``: none) of the sinks, then the ring of recent tokens (module docstring), ``[B, H, n_sink +
    window]``, with their positions ``pos`` (``EMPTY`` where there is no slot); ``short``: a row that may still
    receive sinks had fewer than ``n_sink`` (scan again when asked next). ``reach`` (``[n_sink + window]``) is how
    far before the query each entry may lie and still be read: any distance for a sink, less than ``window`` for a
    recent token. Both tensors are contiguous and written in place as tokens arrive."""

    n_sink: int
    window: int
    slots: torch.Tensor
    pos: torch.Tensor
    short: bool
    reach: torch.Tensor

    @classmethod
    def scan(
        cls, pos: torch.Tensor, valid: torch.Tensor, slots: torch.Tensor, n_sink: int, window: int,
        row_start: torch.Tensor,
    ) -> SpecialSlots:  # fmt: skip
        """From a frame's ``pos`` (int64), ``valid`` and flat ``slots`` (all ``[B, H, C]``); sinks count positions
        from ``row_start`` (``[B]``)."""

        def ranked(key: torch.Tensor, k: int, largest: bool) -> tuple[torch.Tensor, torch.Tensor]:
            k_in = min(k, key.shape[-1])
            at = key.topk(k_in, dim=-1, largest=largest).indices
            found = key.gather(2, at).abs() != _NONE
            pad = (0, k - k_in)
            return (
                torch.nn.functional.pad(torch.where(found, slots.gather(2, at), -1), pad, value=-1),
                torch.nn.functional.pad(torch.where(found, pos.gather(2, at), EMPTY), pad, value=EMPTY),
            )

        rel = pos - row_start.view(-1, 1, 1)
        sinks, sink_pos = ranked(torch.where(valid & (rel < n_sink), rel, _NONE), n_sink, largest=False)
        recent, recent_pos = _ring(pos, valid, slots, window)
        # a sink can still arrive by a decode step only in a row whose newest token here is one of its first n_sink
        # (a store that holds none of a row's sinks and later tokens, such as the hot store beside a tier, is not
        # short); a chunk appended resets the slots (PagedStore.append)
        newest = torch.nn.functional.pad(torch.where(valid, rel, -1), (0, 1), value=-1).amax(-1, keepdim=True)
        short = bool(((sinks < 0) & (newest < n_sink - 1)).any()) if n_sink else False
        reach = torch.tensor([_SINK_REACH] * n_sink + [window] * window, dtype=torch.int64, device=pos.device)
        return cls(n_sink, window, torch.cat([sinks, recent], -1), torch.cat([sink_pos, recent_pos], -1), short, reach)

    def fits(self, n_sink: int, window: int) -> bool:
        """Whether these slots answer a request for ``n_sink`` sinks and ``window`` recent tokens."""
        return (self.n_sink, self.window) == (n_sink, window) and not self.short

    def push(self, slot: torch.Tensor, pos: torch.Tensor, masked: bool) -> None:
        """The newest tokens (``[B, H, q]`` slots, ``-1`` for absent ones where ``masked``, which leave their entry as
        it was) at positions ``pos`` (``[q]`` or ``[B, H, q]``) enter the ring of recent tokens, in place."""
        if not self.window:
            return
        slot = slot[..., -self.window :]
        pos = pos.to(torch.int64).expand(*slot.shape[:2], -1)[..., -slot.shape[-1] :]
        at = self.n_sink + pos.remainder(self.window)
        if masked:
            pos = torch.where(slot >= 0, pos, self.pos.gather(2, at))
            slot = torch.where(slot >= 0, slot, self.slots.gather(2, at))
        self.slots.scatter_(2, at, slot)
        self.pos.scatter_(2, at, pos)

    def unread(self, qpos: torch.Tensor) -> torch.Tensor:
        """``[B, H, n_sink + window]`` bool: entries a query at ``qpos`` (one element) does not read (no slot; a recent
        token ``window`` or more positions before the query)."""
        return unread(self.pos, self.reach, qpos)


def _ring(
    pos: torch.Tensor, valid: torch.Tensor, slots: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, window]`` slots (``-1``: none) and positions (``EMPTY``) of the ring of recent tokens of a frame
    (``pos`` int64, ``valid``, flat ``slots``, all ``[B, H, C]``): entry ``r`` holds the newest valid token at a
    position ``r`` modulo ``window`` (a row's positions are distinct)."""
    b, h, _ = pos.shape
    newest = torch.full((b, h, window), EMPTY, dtype=torch.int64, device=pos.device)
    ring = torch.full((b, h, window + 1), -1, dtype=torch.int64, device=pos.device)  # others go to column `window`
    if window and pos.shape[-1]:
        at = pos.remainder(window)  # in [0, window) for any position, empty slots' -1 included
        newest.scatter_reduce_(2, at, torch.where(valid, pos, EMPTY), "amax")
        hit = valid & (pos == newest.gather(2, at))  # the newest token of its residue
        ring.scatter_(2, torch.where(hit, at, window), slots)
    return ring[..., :window], newest


def unread(pos: torch.Tensor, reach: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
    """``SpecialSlots.unread`` of entries at positions ``pos`` (``[B, H, S]``) with their ``reach`` (``[S]``)."""
    return pos <= qpos.reshape(()) - reach


def special_page_mask(
    slots: torch.Tensor, pos: torch.Tensor, reach: torch.Tensor, qpos: torch.Tensor, start: torch.Tensor, width: int,
    page_size: int,
) -> torch.Tensor:  # fmt: skip
    """``[B, H, width]`` bool: the frame pages of runs starting at pool page ``start`` (``[B, H]``) that hold a special
    entry (flat pool ``slots``, ``[B, H, S]``, at positions ``pos``) a query at ``qpos`` reads."""
    local = slots if page_size == 1 else slots.div(page_size, rounding_mode="floor")
    at = (local - start.unsqueeze(-1)).masked_fill_(unread(pos, reach, qpos), width)  # an extra column, cut below
    out = torch.zeros(*slots.shape[:2], width + 1, dtype=torch.bool, device=at.device)
    return out.scatter_(2, at, True)[..., :width]
