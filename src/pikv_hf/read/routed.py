"""Routed reads (PiKV Routing): each decode query reads, per row and KV head, the pages of its selected shards,
plus the pages holding its row's sinks and recent window (of those, only the sink / recent tokens count).

A plan is as wide as the store's frame (any page may belong to a selected shard), its pages compacted to the front
and ``-1`` padded: a step's shapes never depend on what it selects. The fused kernel reads only the entries in use.
Eager code on the CPU, where nothing needs to stay on the device, builds the plan no wider than its longest row.
"""

from __future__ import annotations

import torch

from pikv_hf.config import ReadConfig
from pikv_hf.kernels._triton import runs_eagerly
from pikv_hf.kernels.route_select import route_select
from pikv_hf.kernels.routed_plan import routed_plan, routed_plan_trimmed
from pikv_hf.read.plan import ReadPlan
from pikv_hf.read.policy import SparseRead, register
from pikv_hf.routing import Selector, make_selector
from pikv_hf.routing.base import ShardSummary
from pikv_hf.routing.scores import estimated_mass
from pikv_hf.routing.topk import TopKSelector
from pikv_hf.store import PagedStore
from pikv_hf.store.group import StoreGroup


@register("routed")
class RoutedRead(SparseRead):
    """Shard selection by the configured selector, optionally cut to a mass target (top-p)."""

    reads_summaries = True

    def __init__(self, config: ReadConfig) -> None:
        super().__init__(config)
        self.selector = make_selector(config.selector, **config.selector_kwargs)
        self.misses: torch.Tensor | None = None  # [B, H, S] selected shards that had lost tokens to eviction
        self.shard_evicted: torch.Tensor | None = None  # [B, H, S]
        self._last: tuple[ShardSummary, torch.Tensor] | None = None  # (summary, selected) of the last plan

    def plans(
        self, group: StoreGroup, qg: torch.Tensor, scale: float, qpos: torch.Tensor, row_start: torch.Tensor
    ) -> list[ReadPlan]:
        """Shards chosen once from the statistics of every store, then read from each store that holds them."""
        chosen = self.chosen(group, qg, scale)
        return [
            self.read_shards(s, chosen.to(s.device), qpos.to(s.device), row_start.to(s.device)) for s in group.stores
        ]

    def prepare(self, group: StoreGroup, row_start: torch.Tensor) -> None:
        super().prepare(group, row_start)
        if self.misses is None or self.misses.shape[:2] != (group.batch, group.heads):  # before a compiled step
            shape = (group.batch, group.heads, group.num_shards)
            self.misses = torch.zeros(shape, dtype=torch.int64, device=group.device)
        hot = group.stores[0]
        if hot.summaries_kept:  # sums an eviction left stale (kept in the hot store): recounted here, not in a step
            if self._plain():
                hot.shard_stats()
            else:
                group.summary(self.misses)

    def _plain(self) -> bool:
        """Whether the selection is one operator over the kept key sums (:meth:`chosen`): the top-k centroid
        selector, which neither counts misses nor learns nor reads the shard bounds."""
        return type(self.selector) is TopKSelector and self.selector.score == "centroid" and not self.learns()

    def chosen(self, group: StoreGroup, qg: torch.Tensor, scale: float) -> torch.Tensor:
        """``[B, H, S]`` bool: the shards the query rows ``qg`` (``[B, H, G, D]``) read, as :meth:`choose` selects
        them. The top-k centroid selector, which neither counts misses nor learns, selects in one operator
        (``pikv_hf.kernels.route_select``) from the key sums of the layer's stores (summed over its tiers: no
        store keeps shard key bounds for it)."""
        if not self._plain():
            selected, keep = self.choose(group, qg, scale)
            b, h, s = group.batch, group.heads, group.num_shards
            return torch.zeros(b, h, s, dtype=torch.bool, device=selected.device).scatter_(2, selected, keep)
        sums, squares, counts = group.key_stats()
        return route_select(qg, sums, squares, counts, scale, self.config.top_k_shards, self.config.mass_target)

    def _summary(self, store: PagedStore | StoreGroup) -> ShardSummary:
        b, h, s = store.batch, store.heads, store.num_shards
        if self.misses is None or self.misses.shape[:2] != (b, h):
            self.misses = torch.zeros(b, h, s, dtype=torch.int64, device=store.device)
        return store.summary(self.misses)

    def choose(
        self, store: PagedStore | StoreGroup, qg: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The shards the query rows ``qg`` (``[B, H, G, D]``) select from ``store.summary``: ``[B, H, k]`` shard ids,
        best first, and ``[B, H, k]`` bool, False past the shortest prefix reaching the mass target.

        ``store`` may be any object with ``batch``, ``heads``, ``num_shards``, ``device`` and ``summary(misses)``:
        a distributed layer chooses once from the statistics of all its shards (``pikv_hf.distributed``).
        """
        cfg = self.config
        b, h, s = store.batch, store.heads, store.num_shards
        summary = self._summary(store)
        selected = self.selector.select(qg, summary, cfg.top_k_shards)
        if cfg.mass_target is None:
            keep = torch.ones_like(selected, dtype=torch.bool)
        else:  # the shortest ranked prefix reaching the target (always >= 1 shard)
            covered = estimated_mass(qg, summary, scale).gather(2, selected).cumsum(-1)
            keep = torch.nn.functional.pad(covered[..., :-1] < cfg.mass_target, (1, 0), value=True)
        if self.selector.reads_misses:  # selected shards that lost tokens to eviction or sit off-device
            chosen = torch.zeros(b, h, s, dtype=torch.bool, device=store.device).scatter_(2, selected, keep)
            lost = ~summary.resident if self.shard_evicted is None else (self.shard_evicted > 0) | ~summary.resident
            self.misses += (chosen & lost).long()
        if self.learns():  # kept for feedback() alone (a learning selector reads recall back on the host)
            self._last = (summary, selected)
        return selected, keep

    def read_shards(
        self, store: PagedStore, chosen: torch.Tensor, qpos: torch.Tensor, row_start: torch.Tensor
    ) -> ReadPlan:
        """The plan reading, from ``store``, the pages of the shards ``chosen`` (``[B, H, S]`` bool) and the pages
        holding the row's sink and recent-window tokens (of those, only the sink / recent tokens count), compacted in
        one operator (``pikv_hf.kernels.routed_plan``; eager code on the CPU builds it no wider than it is used,
        ``routed_plan_trimmed``)."""
        cfg = self.config
        marks = store.special_slots(cfg.n_sink, cfg.window, row_start)
        args = (chosen, store.frame("shard"), marks.slots, marks.pos, marks.reach, qpos, store.table.start)
        lengths = None
        if chosen.device.type == "cpu" and runs_eagerly(chosen):
            pages, page_full = routed_plan_trimmed(*args, store.page_size)
        else:
            pages, page_full, lengths = routed_plan(*args, store.page_size)
        if store.page_size == 1:  # a sink or window page holds just that token: every planned page is read whole
            return ReadPlan(pages, lengths=lengths)
        return ReadPlan(pages, page_full, cfg.n_sink, cfg.window, row_start, lengths)

    def learns(self) -> bool:
        return type(self.selector).update is not Selector.update

    def feedback(self, qg: torch.Tensor, recall: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        summary, selected = self._last
        if rows is not None:
            summary, selected, qg, recall = summary.rows(rows), selected[rows], qg[rows], recall[rows]
        self.selector.update(qg, summary, selected, recall)

    def note_evicted(self, per_shard: torch.Tensor) -> None:
        self.shard_evicted = per_shard if self.shard_evicted is None else self.shard_evicted + per_shard

    def index_batch(self, index: torch.Tensor) -> None:
        self.misses = None if self.misses is None else self.misses.index_select(0, index)
        self.shard_evicted = None if self.shard_evicted is None else self.shard_evicted.index_select(0, index)

    def reset(self) -> None:
        self.misses = self.shard_evicted = self._last = None
        self.selector.reset()
