"""Quest reads (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024):
each (row, KV head) reads ``ceil(read_fraction * pages)`` pages, sink / window pages first, then the pages with
the largest upper bound of ``q . k`` from per-page key min / max; every token of a page read is attended."""

from __future__ import annotations

import torch

from pikv_hf.read.plan import ReadPlan
from pikv_hf.read.policy import ExactRead, pages_from_mask, special_pages
from pikv_hf.routing.scores import descending_rank, upper_bounds
from pikv_hf.store import PagedStore


class QuestRead(ExactRead):
    """Per-page selection from incrementally kept page key bounds."""

    def plan(
        self, store: PagedStore, qg: torch.Tensor, scale: float, qpos_last: int, row_start: torch.Tensor
    ) -> ReadPlan:
        cfg = self.config
        store.enable_page_bounds()
        key_min, key_max, count = store.page_bounds()
        special = special_pages(store, qpos_last, cfg.n_sink, cfg.window, row_start)
        score = upper_bounds(qg, key_min, key_max, count).masked_fill(special, float("inf"))
        budget = torch.ceil(store.table.n_pages * cfg.read_fraction).long()  # [B, H]
        return ReadPlan(pages_from_mask((descending_rank(score) < budget.unsqueeze(-1)) & (count > 0)))
