"""Read policies: turn a decode query into one ``ReadPlan`` per store of a layer.

``ExactRead`` reads everything. Sparse policies register themselves by mode name (``@register("routed")`` in
``routed.py``, ``@register("quest")`` in ``quest.py``); ``make_policy`` looks the mode up, so this module imports
none of them. Sparse policies always read the pages that hold the row's sink tokens and recent window.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pikv_hf.config import ReadConfig
from pikv_hf.read.plan import ReadPlan, sink_or_recent
from pikv_hf.store import PagedStore
from pikv_hf.store.group import StoreGroup

POLICIES: dict[str, type[ExactRead]] = {}


def register(mode: str) -> Callable[[type[ExactRead]], type[ExactRead]]:
    """Class decorator: the policy of ``ReadConfig.attention == mode``."""

    def add(cls: type[ExactRead]) -> type[ExactRead]:
        POLICIES[mode] = cls
        return cls

    return add


class ExactRead:
    """Every page (exact attention); also the policy of ``dense_layers`` under a sparse mode."""

    sparse = False
    reads_summaries = False  # selects from the stores' shard summaries (they must be kept as tokens arrive)

    def __init__(self, config: ReadConfig) -> None:
        self.config = config

    def plans(
        self, group: StoreGroup, qg: torch.Tensor, scale: float, qpos: torch.Tensor, row_start: torch.Tensor
    ) -> list[ReadPlan]:
        """One plan per store of ``group`` (the hot store first, then its tiers) for the query rows ``qg``
        (``[B, H, G, D]``) of the token at position ``qpos`` (one-element tensor)."""
        return [ReadPlan() for _ in group.stores]

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


def special_pages(
    store: PagedStore, qpos: torch.Tensor, n_sink: int, window: int, row_start: torch.Tensor
) -> torch.Tensor:
    """``[B, H, W]`` bool: frame pages holding a valid sink or recent-window token (always read)."""
    b, h, w, p = store.batch, store.heads, store.table.width(), store.page_size
    hot = store.frame("valid") & sink_or_recent(store.frame("pos"), qpos, n_sink, window, row_start)
    return hot.view(b, h, w, p).any(-1)


def make_policy(config: ReadConfig, layer_idx: int) -> ExactRead:
    """The read policy of layer ``layer_idx`` under ``config`` (exact for the first ``dense_layers``)."""
    if config.attention == "exact" or layer_idx < config.dense_layers:
        return ExactRead(config)
    return POLICIES[config.attention](config)
