"""Key-cluster placement: each token goes to the shard whose running key centroid is nearest."""

from __future__ import annotations

import torch

from pikv_hf.routing.base import Placement, PlacementContext


class KeyClusterPlacement(Placement):
    """Online k-means (MacQueen) over post-RoPE keys, per batch row and KV head.

    State: ``centroids [B, H, S, D]`` (float32) and ``counts [B, H, S]``. The first ``S`` tokens a layer sees seed
    the centroids (evenly spaced within the chunk that brings them); every token is then assigned to the nearest
    initialised centroid in squared L2 distance, and each centroid becomes the exact running mean of the keys
    assigned to it (``c <- c + (sum_new - n * c) / (count + n)``). Deterministic; no Python loop over tokens.
    Key clusters carry the most recall signal of the three placements (REFERENCE.md section 4).
    """

    name = "key_cluster"

    def __init__(self, num_shards: int) -> None:
        super().__init__(num_shards)
        self.reset()

    def reset(self) -> None:
        self.centroids: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        self.n_init = 0

    def index_batch(self, index: torch.Tensor) -> None:
        if self.centroids is not None:
            self.centroids = self.centroids.index_select(0, index.to(self.centroids.device))
            self.counts = self.counts.index_select(0, index.to(self.counts.device))

    def place(self, ctx: PlacementContext) -> torch.Tensor:
        keys = ctx.keys.float()
        b, h, q, d = keys.shape
        s = self.num_shards
        if self.centroids is None:
            self.centroids = keys.new_zeros(b, h, s, d)
            self.counts = torch.zeros(b, h, s, dtype=torch.int64, device=keys.device)
        if self.n_init < s:  # seed empty centroids with evenly spaced tokens of this chunk
            m = min(s - self.n_init, q)
            idx = torch.linspace(0, q - 1, m, device=keys.device).round().long()
            self.centroids[:, :, self.n_init : self.n_init + m] = keys[:, :, idx]
            self.n_init += m
        dist = torch.cdist(keys, self.centroids[:, :, : self.n_init])  # [B,H,q,n_init]
        shard = dist.argmin(-1)
        onehot = torch.nn.functional.one_hot(shard, s).to(keys.dtype)  # [B,H,q,S]
        n = onehot.sum(2)  # [B,H,S]
        sums = onehot.transpose(2, 3) @ keys  # [B,H,S,D]
        total = (self.counts + n).clamp(min=1).unsqueeze(-1).to(keys.dtype)
        self.centroids = self.centroids + (sums - n.unsqueeze(-1) * self.centroids) / total
        self.counts = self.counts + n.long()
        return shard
