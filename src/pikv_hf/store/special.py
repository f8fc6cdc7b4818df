"""``SpecialSlots``: where each (row, KV head)'s sink and recent-window tokens sit in a store's pool.

Sparse reads (routed, Quest) always read a row's first ``n_sink`` real tokens and its tokens of the last ``window``
positions. The store finds their slots once by scanning its frame (after a prefill, or after its pages moved), then
keeps the recent ones as tokens arrive, so a decode step never scans the frame. The recent ones are a ring over the
positions: entry ``n_sink + pos % window`` holds the newest stored token at a position ``pos`` of that residue, so a
new token overwrites the one ``window`` positions before it, which no query reads any more (each residue occurs once
among the last ``window`` positions): a decode step writes its token there in place, inside the append operator
(``pikv_hf.kernels.append``), instead of shifting the window. A row that holds fewer than ``n_sink`` tokens gets its
later ones as sinks the same way (entry ``t`` for its ``t``-th real token), so the slots stay found, and a compiled
step's guards stay true, while it fills.
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
    window]``, with their positions ``pos`` (``EMPTY`` where there is no slot). ``reach`` (``[n_sink + window]``) is
    how far before the query each entry may lie and still be read: any distance for a sink, less than ``window`` for
    a recent token. Both tensors are contiguous and written in place as tokens arrive."""

    n_sink: int
    window: int
    slots: torch.Tensor
    pos: torch.Tensor
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
        # a sink arriving later (a row held fewer than n_sink tokens) is written by push / the append operator into
        # its entry, which no token found here holds: an entry's rank among the row's sinks is at most its ordinal;
        # a chunk appended resets the slots (PagedStore.append)
        reach = torch.tensor([_SINK_REACH] * n_sink + [window] * window, dtype=torch.int64, device=pos.device)
        return cls(n_sink, window, torch.cat([sinks, recent], -1), torch.cat([sink_pos, recent_pos], -1), reach)

    def fits(self, n_sink: int, window: int) -> bool:
        """Whether these slots answer a request for ``n_sink`` sinks and ``window`` recent tokens."""
        return (self.n_sink, self.window) == (n_sink, window)

    def push(self, slot: torch.Tensor, pos: torch.Tensor, row_start: torch.Tensor | None) -> None:
        """One decode token per (row, head) (``[B, H, 1]`` slots, ``-1`` for an absent one, which leaves the entries
        as they were) at position ``pos`` (``[1]`` or ``[B, H, 1]``) enters the ring of recent tokens and, when it is
        one of its row's first ``n_sink`` real tokens (counted from ``row_start``, ``[B]``; None: 0), the sinks; in
        place."""
        pos = pos.to(torch.int64).expand_as(slot)
        present = slot >= 0
        if self.window:
            at = self.n_sink + pos.remainder(self.window)
            self.slots.scatter_(2, at, torch.where(present, slot, self.slots.gather(2, at)))
            self.pos.scatter_(2, at, torch.where(present, pos, self.pos.gather(2, at)))
        if self.n_sink:
            write_sinks(self.slots, self.pos, slot, pos, row_start, self.n_sink)

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


def write_sinks(
    slots: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor, at: torch.Tensor, row_start: torch.Tensor | None,
    n_sink: int,
) -> None:  # fmt: skip
    """Enter tokens at flat ``slot`` (``[B, H, 1]``, ``-1``: absent) and position ``at`` (``[B, H, 1]``) as sinks of
    special ``slots`` / ``pos`` (``[B, H, n_sink + window]``, in place) where a token is its row's ``t``-th real one,
    ``t < n_sink`` (entry ``t``; positions counted from ``row_start``, ``[B]``, None: 0)."""
    rel = at if row_start is None else at - row_start.view(-1, 1, 1)
    sink = (rel >= 0) & (rel < n_sink) & (slot >= 0)
    entry = rel.clamp(0, n_sink - 1)
    slots.scatter_(2, entry, torch.where(sink, slot, slots.gather(2, entry)))
    pos.scatter_(2, entry, torch.where(sink, at, pos.gather(2, entry)))


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
