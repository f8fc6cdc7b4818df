"""``ReadPlan``: what one attention call reads from a layer's store, per batch row and KV head.

A plan is produced by a read policy (``exact``, ``routed``, ``quest``) and consumed by an attention backend. It
names pages by their local index in each (row, head)'s page-table run; the backend maps them to pool pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ReadPlan:
    """Pages to read and which of their tokens may be attended.

    Attributes
    ----------
    pages : torch.Tensor or None
        ``[B, H, n]`` int64 local page indices (``-1``: padding); None reads the whole frame (exact attention).
    page_full : torch.Tensor or None
        ``[B, H, n]`` bool. True: every valid token of the page may be attended (a selected shard's page, a Quest
        page). False: only its sink tokens (``pos - row_start < n_sink``) and recent ones (``qpos - pos < window``).
        None: every page is full.
    n_sink, window : int
        The sink count and recent window of partial pages.
    row_start : torch.Tensor or None
        ``[B]`` int64 position of each row's first real token (left padding), the frame in which sinks count.
    """

    pages: torch.Tensor | None = None
    page_full: torch.Tensor | None = None
    n_sink: int = 0
    window: int = 0
    row_start: torch.Tensor | None = None

    @property
    def exact(self) -> bool:
        return self.pages is None


def sink_or_recent(
    pos: torch.Tensor, qpos_last: int, n_sink: int, window: int, row_start: torch.Tensor
) -> torch.Tensor:
    """``[B, H, C]`` bool: slots at positions ``pos`` (``[B, H, C]``) that are one of their row's first ``n_sink`` real
    tokens or among the last ``window`` positions before ``qpos_last``."""
    rel_start = pos.to(torch.int64) - row_start.view(-1, 1, 1)
    return ((rel_start >= 0) & (rel_start < n_sink)) | (pos > qpos_last - window)
