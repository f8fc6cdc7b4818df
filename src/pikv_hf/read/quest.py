"""Quest reads (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024):
each (row, KV head) reads ``ceil(read_fraction * pages)`` pages, sink / window pages first, then the pages with
the largest upper bound of ``q . k`` from per-page key min / max; every token of a page read is attended."""

from __future__ import annotations

import math

import torch

from pikv_hf.read.plan import ReadPlan, arange
from pikv_hf.read.policy import SparseRead, register, special_pages
from pikv_hf.routing.scores import upper_bounds
from pikv_hf.store import PagedStore
from pikv_hf.store.group import StoreGroup


@register("quest")
class QuestRead(SparseRead):
    """Per-page selection from incrementally kept page key bounds; the plan is ``ceil(read_fraction * W)`` pages wide
    for a frame of ``W`` pages (each (row, head) fills its own budget of ``ceil(read_fraction * n_pages)``)."""

    def plans(
        self, group: StoreGroup, qg: torch.Tensor, scale: float, qpos: torch.Tensor, row_start: torch.Tensor
    ) -> list[ReadPlan]:
        return [self.plan(s, qg.to(s.device), qpos.to(s.device), row_start.to(s.device)) for s in group.stores]

    def plan(self, store: PagedStore, qg: torch.Tensor, qpos: torch.Tensor, row_start: torch.Tensor) -> ReadPlan:
        cfg = self.config
        store.enable_page_bounds()
        key_min, key_max, count = store.page_bounds()
        special = special_pages(store, qpos, cfg.n_sink, cfg.window, row_start)
        score = upper_bounds(qg, key_min, key_max, count).masked_fill_(special, float("inf"))
        width = min(store.table.width(), math.ceil(cfg.read_fraction * store.table.width()))
        top, order = score.sort(dim=-1, descending=True, stable=True)  # ties to the earlier page
        # past the (row, head)'s budget of ceil(read_fraction * n_pages) pages (i < ceil(x) iff i < x), or empty
        over = arange(width, store.device) >= (store.table.n_pages * cfg.read_fraction).unsqueeze(-1)
        return ReadPlan(order[..., :width].masked_fill(over | torch.isneginf(top[..., :width]), -1))
