"""Read policies: turn a decode query into a ``ReadPlan`` over a layer's store.

``ExactRead`` reads everything. ``RoutedRead`` (``routed.py``) selects shards from the shard summaries,
``QuestRead`` (``quest.py``) selects pages from per-page key bounds; both always read the pages that hold the row's
sink tokens and the recent window. ``make_policy`` picks one from a ``ReadConfig`` and a layer index.
"""

from __future__ import annotations

import torch

from pikv_hf.config import ReadConfig
from pikv_hf.read.plan import ReadPlan, sink_or_recent
from pikv_hf.store import PagedStore
from pikv_hf.store.group import StoreGroup


class ExactRead:
    """Every page (exact attention); also the policy of ``dense_layers`` under a sparse mode."""

    def __init__(self, config: ReadConfig) -> None:
        self.config = config

    def plan(
        self, store: PagedStore, qg: torch.Tensor, scale: float, qpos_last: int, row_start: torch.Tensor
    ) -> ReadPlan:
        return ReadPlan()

    def plans(
        self,
        group: StoreGroup,
        qg: torch.Tensor,
        scale: float,
        qpos_last: int,
        row_start: torch.Tensor,
    ) -> list[ReadPlan]:
        """One plan per store of ``group`` (the hot store first, then its tiers)."""
        return [self.plan(s, qg.to(s.device), scale, qpos_last, row_start.to(s.device)) for s in group.stores]

    def learns(self) -> bool:
        return False

    def feedback(self, qg: torch.Tensor, recall: torch.Tensor) -> None:
        """Reward a learning selector with the recall of the last plan (``[B, H]``)."""

    def note_evicted(self, per_shard: torch.Tensor) -> None:
        """Tokens evicted per (row, head, shard) (``[B, H, S]``), for miss counting."""

    def index_batch(self, index: torch.Tensor) -> None:
        """Keep / reorder per-row state along ``index``."""

    def reset(self) -> None:
        """Forget per-sequence state."""


def special_pages(store: PagedStore, qpos_last: int, n_sink: int, window: int, row_start: torch.Tensor) -> torch.Tensor:
    """``[B, H, W]`` bool: frame pages holding a valid sink or recent-window token (always read)."""
    b, h, w, p = store.batch, store.heads, store.table.width(), store.page_size
    hot = store.frame("valid") & sink_or_recent(store.frame("pos"), qpos_last, n_sink, window, row_start)
    return hot.view(b, h, w, p).any(-1)


def pages_from_mask(need: torch.Tensor) -> torch.Tensor:
    """``[B, H, n]`` local page indices of the True entries of ``need`` (``[B, H, W]``), ``-1`` padded to the
    largest count."""
    n_read = need.sum(-1, keepdim=True)
    pages = torch.argsort((~need).to(torch.uint8), dim=-1, stable=True)[..., : int(n_read.max())]
    return torch.where(torch.arange(pages.shape[-1], device=need.device) < n_read, pages, -1)


def make_policy(config: ReadConfig, layer_idx: int) -> ExactRead:
    """The read policy of layer ``layer_idx`` under ``config`` (exact for the first ``dense_layers``)."""
    from pikv_hf.read.quest import QuestRead
    from pikv_hf.read.routed import RoutedRead

    if config.attention == "exact" or layer_idx < config.dense_layers:
        return ExactRead(config)
    return RoutedRead(config) if config.attention == "routed" else QuestRead(config)
