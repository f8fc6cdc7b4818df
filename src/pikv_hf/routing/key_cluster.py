"""Key-cluster placement: each token goes to the shard whose key centroid is nearest."""

from __future__ import annotations

import torch

from pikv_hf.checks import check_int_at_least
from pikv_hf.routing.base import Placement, PlacementContext


class KeyClusterPlacement(Placement):
    """k-means over post-RoPE keys, per batch row and KV head: Lloyd iterations within a chunk, running means across.

    State: ``centroids [B, H, S, D]`` (float32) and ``counts [B, H, S]``. The first ``S`` tokens a layer sees seed
    the centroids (evenly spaced within the chunk that brings them). Tokens stored by earlier chunks keep their
    shard (their KV is already paged there); the tokens of a new chunk go through up to ``iters`` Lloyd steps:
    assign each to the nearest initialised centroid in squared L2 distance, then set every centroid to the exact
    mean of all keys assigned to it so far (earlier chunks' and this chunk's), until no assignment changes. Each
    step can only lower the k-means objective, so a prefill gets real clusters, while a one-token decode step is a
    single assignment and running-mean update (MacQueen). Deterministic; no Python loop over tokens.
    Key clusters carry the most recall signal of the three placements (REFERENCE.md section 4).

    Parameters
    ----------
    num_shards : int
        Shards ``S`` per batch row and KV head.
    iters : int
        Most Lloyd steps per chunk (default 8; 1 gives online k-means, one assignment per token).
    """

    name = "key_cluster"

    def __init__(self, num_shards: int, iters: int = 8) -> None:
        super().__init__(num_shards)
        check_int_at_least("iters", iters, 1)
        self.iters = iters
        self.reset()

    def reset(self) -> None:
        self.centroids: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        self.n_init = 0

    def index_batch(self, index: torch.Tensor) -> None:
        if self.centroids is not None:
            self.centroids = self.centroids.index_select(0, index.to(self.centroids.device))
            self.counts = self.counts.index_select(0, index.to(self.counts.device))

    @staticmethod
    def _nearest(keys: torch.Tensor, centroids: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
        """``[B, H, q]`` nearest centroid of every key, ``chunk`` keys at a time (bounds the ``[B, H, q, S]``
        distance matrix of a long prefill)."""
        parts = [torch.cdist(keys[:, :, i : i + chunk], centroids).argmin(-1) for i in range(0, keys.shape[2], chunk)]
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]

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
        prior_n = self.counts.unsqueeze(-1).to(keys.dtype)  # [B,H,S,1]: earlier chunks' tokens stay put
        prior_sum = self.centroids * prior_n
        centroids, shard = self.centroids, None
        for _ in range(self.iters if q > 1 else 1):
            new = self._nearest(keys, centroids[:, :, : self.n_init])
            if shard is not None and torch.equal(new, shard):
                break
            shard = new
            n = torch.zeros(b, h, s, 1, dtype=keys.dtype, device=keys.device)
            n.scatter_add_(2, shard.unsqueeze(-1), torch.ones_like(keys[..., :1]))  # tokens per shard
            sums = torch.zeros_like(prior_sum).scatter_add_(2, shard.unsqueeze(-1).expand_as(keys), keys)
            total = prior_n + n
            mean = (prior_sum + sums) / total.clamp(min=1)
            centroids = torch.where(total > 0, mean, self.centroids)  # a seed nothing joined keeps its key
        self.centroids = centroids
        self.counts = self.counts + n.squeeze(-1).long()
        return shard
