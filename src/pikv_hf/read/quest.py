"""Quest reads (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024):
each (row, KV head) reads its sink / window pages (always, even past the budget: they hold the query's own token)
and the pages with the largest upper bound of ``q . k`` from per-page key min / max, ``ceil(read_fraction * pages)``
pages in all; every token of a page read is attended.

A layer whose tokens are spread over several stores (the hot store and a compressed or offload tier) has one budget
over all of them, in token slots: ``read_fraction`` of the slots of every page stored, filled with every store's
sink and window pages first (always read, even past the budget: the hot store holds the query's own token), then with
the pages of any store with the largest bound. A budget per store would round a small store's share down: the hot
store of a compressed layer holds only the compressor's window (two or three pages), of which ``1/8`` reads one page
and loses the recent tokens.
"""

from __future__ import annotations

import math

import torch

from pikv_hf.kernels import quest as kquest  # the pikv.quest_* operators
from pikv_hf.read.plan import ReadPlan
from pikv_hf.read.policy import SparseRead, register
from pikv_hf.store import PagedStore
from pikv_hf.store.group import StoreGroup


@register("quest")
class QuestRead(SparseRead):
    """Per-page selection from incrementally kept page key bounds; a single store's plan is
    ``ceil(read_fraction * W)`` pages wide for a frame of ``W`` pages (each (row, head) fills its own budget of
    ``ceil(read_fraction * n_pages)``); a store of a group of several gets a plan as wide as its frame."""

    def plans(
        self, group: StoreGroup, qg: torch.Tensor, scale: float, qpos: torch.Tensor, row_start: torch.Tensor
    ) -> list[ReadPlan]:
        if len(group.stores) == 1:
            return [self.plan(group.stores[0], qg, qpos, row_start)]
        return self.group_plans(group, qg, qpos, row_start)

    def prepare(self, group: StoreGroup, row_start: torch.Tensor) -> None:
        super().prepare(group, row_start)
        for store in group.stores:  # the page bounds exist before a compiled step reads them
            store.enable_page_bounds()

    def scores(self, store: PagedStore, qg: torch.Tensor, qpos: torch.Tensor, row_start: torch.Tensor) -> torch.Tensor:
        """``[B, H, W]`` Quest bound of every frame page of ``store`` (on its device): ``inf`` for sink / window
        pages, ``-inf`` for empty ones (one operator, ``torch.ops.pikv.quest_scores``)."""
        cfg, d = self.config, store.device
        store.enable_page_bounds()
        marks = store.special_slots(cfg.n_sink, cfg.window, row_start.to(d))
        return kquest.scores(
            qg.to(d), store.frame("key_min"), store.frame("key_max"), store.frame("valid"), marks.slots, marks.pos,
            marks.reach, qpos.to(d), store.table.start, store.page_size,
        )  # fmt: skip

    def plan(self, store: PagedStore, qg: torch.Tensor, qpos: torch.Tensor, row_start: torch.Tensor) -> ReadPlan:
        """The plan of a layer held in one store: per (row, head) its sink / window pages, always, and the pages of
        largest score up to ``ceil(read_fraction * n_pages)`` pages in all (``torch.ops.pikv.quest_select``)."""
        f = self.config.read_fraction
        score = self.scores(store, qg, qpos, row_start)
        w = store.table.width()
        if store.reserved and store.device.type == "cpu" and not torch.compiler.is_compiling():
            # a reserved frame (max_cache_len) is far wider than the pages in use, and the CPU gathers the whole
            # plan: sized by the pages in use instead (a host read, no synchronisation on the CPU)
            w = min(w, int(store.table.n_pages.max()) if store.table.n_pages.numel() else 0)
        special = self.config.n_sink + self.config.window  # the most pages sink / window tokens can lie in
        width = min(w, max(math.ceil(f * w), special))  # a row keeps its budget or its special pages, the more
        pages, lengths = kquest.select(score, store.table.n_pages, f, width)
        return ReadPlan(pages, lengths=lengths)

    def group_plans(
        self, group: StoreGroup, qg: torch.Tensor, qpos: torch.Tensor, row_start: torch.Tensor
    ) -> list[ReadPlan]:
        """One plan per store of ``group`` from one budget of ``read_fraction`` of the slots of every stored page
        (module docstring): pages are taken in the order of their bounds over all stores while the slots taken
        before them stay under the budget; sink and window pages always."""
        d, stores = group.device, group.stores
        scores = [self.scores(s, qg, qpos, row_start).to(d) for s in stores]
        flat, lengths = kquest.group_select(
            scores, [s.table.n_pages.to(d) for s in stores], [s.page_size for s in stores], self.config.read_fraction
        )
        plans, start = [], 0
        for i, (s, x) in enumerate(zip(stores, scores, strict=True)):  # each plan: a [B, H, W] view of the output
            n = x.numel()
            pages = flat[start : start + n].view(x.shape).to(s.device)
            # each row's count: the read of a 4-bit tier takes the pages Quest took from it, not the whole frame
            plans.append(ReadPlan(pages, lengths=lengths[i].to(s.device)))
            start += n
        return plans
