"""Read policies: turn a decode query into one ``ReadPlan`` per store of a layer.

``ExactRead`` reads everything. Sparse policies register themselves by mode name (``@register("routed")`` in
``routed.py``, ``@register("quest")`` in ``quest.py``); ``make_policy`` looks the mode up, so this module imports
none of them. Sparse policies always read the pages that hold the row's sink tokens and recent window.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pikv_hf.config import ReadConfig
from pikv_hf.read.plan import ReadPlan
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

    def prepare(self, group: StoreGroup, row_start: torch.Tensor) -> None:
        """After a prefill chunk (outside decode steps): build what plans keep up to date as tokens arrive."""

    def learns(self) -> bool:
        return False

    def measures_recall(self) -> str | None:
        """Why a decode step of this policy measures recall against exact attention (``measure_recall``, a learning
        selector's reward), or None. Recall is measured over the hot store alone: a layer that does cannot hold
        tiers."""
        if not self.sparse:
            return None
        if self.config.measure_recall:
            return "measure_recall=True"
        return f"selector {self.config.selector!r} (it learns from recall)" if self.learns() else None

    def feedback(self, qg: torch.Tensor, recall: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Reward a learning selector with the recall of the last plan (``[B, H]``), of the batch ``rows`` (``[B']``
        int64) when given: the rows that read their selection."""

    def note_evicted(self, per_shard: torch.Tensor) -> None:
        """Tokens evicted per (row, head, shard) (``[B, H, S]``), for miss counting."""

    def index_batch(self, index: torch.Tensor) -> None:
        """Keep / reorder per-row state along ``index``."""

    def reset(self) -> None:
        """Forget per-sequence state."""


class SparseRead(ExactRead):
    """Base of the policies that always read sinks and the recent window: their slots are kept by the stores
    (``PagedStore.special_slots``), found once after a prefill so that decode steps never scan the frame."""

    sparse = True

    def prepare(self, group: StoreGroup, row_start: torch.Tensor) -> None:
        for store in group.stores:
            store.special_slots(self.config.n_sink, self.config.window, row_start.to(store.device))


def make_policy(config: ReadConfig, layer_idx: int) -> ExactRead:
    """The read policy of layer ``layer_idx`` under ``config`` (exact for the first ``dense_layers``)."""
    if config.attention == "exact" or layer_idx < config.dense_layers:
        return ExactRead(config)
    return POLICIES[config.attention](config)
