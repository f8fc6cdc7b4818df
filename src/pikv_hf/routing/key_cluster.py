"""Key-cluster placement: each token goes to the shard whose key centroid is nearest."""

from __future__ import annotations

import torch

from pikv_hf.checks import check_int_at_least
from pikv_hf.kernels.place_key import place_key
from pikv_hf.routing.base import Placement, PlacementContext


class KeyClusterPlacement(Placement):
    """k-means over post-RoPE keys, per batch row and KV head: Lloyd iterations within a chunk, running means across.

    State: ``centroids [B, H, S, D]`` (float32), ``counts [B, H, S]`` and ``seeded [B]`` (centroids initialised per
    row). The first ``S`` real tokens of a row seed its centroids (evenly spaced within the chunk that brings them;
    left padding takes no part, so a row of a padded batch clusters as it would alone). Tokens stored by earlier
    chunks keep their shard (their KV is already paged there); the tokens of a new chunk go through up to ``iters``
    Lloyd steps: assign each to the nearest initialised centroid in squared L2 distance, then set every centroid to
    the exact mean of all keys assigned to it so far (earlier chunks' and this chunk's), until no assignment changes.
    Each step can only lower the k-means objective, so a prefill gets real clusters. A decode token (one per row) is
    a lookup: the centroid maximising ``k . c - |c|^2 / 2`` (one small matmul against the kept ``|c|^2``), whose
    running mean then moves towards it (MacQueen). Deterministic; no Python loop over tokens.
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
        self.norms: torch.Tensor | None = None  # [B, H, S] |c|^2 / 2 (+inf for centroids not seeded yet)
        self.seeded: torch.Tensor | None = None  # [B] centroids initialised per row
        self._all_seeded = False  # every row has S seeds (a host flag: decode steps then read nothing back)

    def index_batch(self, index: torch.Tensor) -> None:
        if self.centroids is not None:
            index = index.to(self.centroids.device)
            for name in ("centroids", "counts", "norms", "seeded"):
                setattr(self, name, getattr(self, name).index_select(0, index))

    @staticmethod
    def _nearest(keys: torch.Tensor, centroids: torch.Tensor, ready: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
        """``[B, H, q]`` nearest initialised centroid (``ready``: ``[B, 1, 1, S]``) of every key in squared L2
        distance, as the largest ``k . c - |c|^2 / 2`` (one matmul, no square root), ``chunk`` keys at a time (bounds
        the ``[B, H, q, S]`` score matrix of a long prefill)."""
        b, h, q, d = keys.shape
        neg_half = (centroids.square().sum(-1) / -2).unsqueeze(2).masked_fill(~ready, float("-inf"))  # [B, H, 1, S]
        neg_half, centroids_t = neg_half.flatten(0, 1), centroids.flatten(0, 1).transpose(-1, -2)
        parts = []
        for i in range(0, q, chunk):  # score = k . c - |c|^2 / 2 in one operator
            score = torch.baddbmm(neg_half, keys[:, :, i : i + chunk].flatten(0, 1), centroids_t)
            parts.append(score.argmax(-1).view(b, h, -1))
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]

    def _init_state(self, b: int, h: int, d: int, device: torch.device) -> None:
        s = self.num_shards
        self.centroids = torch.zeros(b, h, s, d, device=device)
        self.counts = torch.zeros(b, h, s, dtype=torch.int64, device=device)
        self.norms = torch.full((b, h, s), float("inf"), device=device)
        self.seeded = torch.zeros(b, dtype=torch.int64, device=device)

    def _seed(self, keys: torch.Tensor, present: torch.Tensor) -> None:
        """Seed each row's empty centroids with evenly spaced real tokens of this chunk."""
        b, h, q, d = keys.shape
        s = self.num_shards
        real = present.sum(-1)  # [B]
        m = (s - self.seeded).clamp(min=0).minimum(real)  # [B] seeds this chunk gives each row
        first = present.to(torch.int8).argmax(-1)  # left padding: a row's real tokens are its last `real`
        j = torch.arange(s, device=keys.device)
        step = (real - 1).clamp(min=0).double() / (m - 1).clamp(min=1).double()
        at = (first.unsqueeze(-1) + (j * step.unsqueeze(-1)).round().long()).clamp(max=q - 1)  # [B, S]
        slot = self.seeded.unsqueeze(-1) + j  # [B, S] centroid each seed fills
        use = j < m.unsqueeze(-1)
        slot = torch.where(use, slot, s)  # unused seeds land in an extra slot, cut below
        seeds = keys.gather(2, at.view(b, 1, s, 1).expand(b, h, s, d))
        grown = torch.cat([self.centroids, self.centroids[:, :, :1]], 2)
        grown.scatter_(2, slot.view(b, 1, s, 1).expand(b, h, s, d), seeds)
        self.centroids = grown[:, :, :s].contiguous()
        self.seeded = self.seeded + m
        if not torch.compiler.is_compiling():  # a host read: traced steps seed (a no-op once seeded) every time
            self._all_seeded = bool((self.seeded >= s).all())

    def _ready(self) -> torch.Tensor:
        """``[B, 1, 1, S]`` bool: centroids seeded."""
        return (torch.arange(self.num_shards, device=self.seeded.device) < self.seeded.view(-1, 1)).view(
            -1, 1, 1, self.num_shards
        )

    def place(self, ctx: PlacementContext) -> torch.Tensor:
        keys = ctx.keys.float()
        b, h, q, d = keys.shape
        if self.centroids is None:
            self._init_state(b, h, d, keys.device)
        if q == 1 and self._all_seeded and ctx.present is None:
            return self._place_one(keys)
        present = ctx.present if ctx.present is not None else torch.ones(b, q, dtype=torch.bool, device=keys.device)
        if not self._all_seeded:
            self._seed(keys, present)
        ready = self._ready()
        weight = present.to(keys.dtype).view(b, 1, q, 1)  # padding joins no centroid
        prior_n = self.counts.unsqueeze(-1).to(keys.dtype)  # [B,H,S,1]: earlier chunks' tokens stay put
        prior_sum = self.centroids * prior_n
        weighted = (keys * weight).reshape(b * h * q, d)
        offset = (torch.arange(b * h, device=keys.device) * self.num_shards).view(b, h, 1)  # (row, head)'s shards
        centroids, shard = self.centroids, None
        for _ in range(self.iters if q > 1 else 1):
            new = self._nearest(keys, centroids, ready)
            if shard is not None and torch.equal(new, shard):
                break
            shard = new
            n = torch.zeros(b, h, self.num_shards, 1, dtype=keys.dtype, device=keys.device)
            n.scatter_add_(2, shard.unsqueeze(-1), weight.expand(b, h, q, 1))  # real tokens per shard
            sums = prior_sum.new_zeros(b * h * self.num_shards, d).index_add_(0, (shard + offset).view(-1), weighted)
            sums = sums.view_as(prior_sum)
            total = prior_n + n
            mean = (prior_sum + sums) / total.clamp(min=1)
            centroids = torch.where(total > 0, mean, self.centroids)  # a seed nothing joined keeps its key
        self.centroids = centroids
        self.counts = self.counts + n.squeeze(-1).long()
        self.norms = (centroids.square().sum(-1) / 2).masked_fill(~ready.view(b, 1, -1), float("inf"))
        return shard

    def _place_one(self, keys: torch.Tensor) -> torch.Tensor:
        """One decode token per row: nearest centroid by ``k . c - |c|^2 / 2``, then its running mean moves (one
        operator, ``pikv_hf.kernels.place_key``)."""
        return place_key(keys, self.centroids, self.counts, self.norms)
