"""Round-robin (hash) placement: consecutive pages of a sequence go to consecutive shards."""

from __future__ import annotations

import torch

from pikv_hf.kernels.append import round_robin_shard
from pikv_hf.routing.base import Placement, PlacementContext


class RoundRobinPlacement(Placement):
    """Page-granular round robin, the PiKV paper's hash router.

    Token ``t`` (its ordinal in its row, counted from the row's first real token) goes to shard ``(t // P) % S``:
    every shard receives whole pages in turn, so at most one page per sequence is partially filled and shards stay
    balanced to one page; a row of a left-padded batch is placed as it would be alone.
    A decode step's append computes the same shard itself (``pikv_hf.kernels.append``). Carries no content signal;
    it is the baseline every content-aware router is measured against.
    """

    name = "round_robin"
    placed_by_append = True

    def place(self, ctx: PlacementContext) -> torch.Tensor:
        b, h, q, _ = ctx.keys.shape
        shard = round_robin_shard(ctx.row_index(), ctx.page_size, self.num_shards)
        return shard.to(device=ctx.keys.device, dtype=torch.int64).unsqueeze(1).expand(b, h, q)
