"""A layer's stores seen together: the hot store where tokens arrive, and its cold tiers.

A tier is a ``PagedStore`` of its own (its own codec and device): an offload tier holds evicted pages in CPU memory
(or on disk) instead of dropping them, a compressed tier holds sealed pages in a compressed codec. Every token lives
in exactly one store, so attention over the layer is the exact log-sum-exp merge of one partial per store, and a
routed selection reads the shard statistics of all stores together (``StoreGroup.summary``): a shard is resident
when none of its tokens sits in an offloaded store.
"""

from __future__ import annotations

import torch

from pikv_hf.routing.base import ShardSummary
from pikv_hf.store.paged import PagedStore


class StoreGroup:
    """The hot store and its tiers, with the shard summary of all of them (what a selector reads).

    A partitioned layer hands the reads a ``pikv_hf.distributed.PartitionedStore`` in its place, with the same public
    members (``tests/test_distributed.py`` checks that it has every one)."""

    holds_newest = True  # the first store (the hot one) holds the token being decoded

    def __init__(self, stores: list[PagedStore], offloaded: tuple[PagedStore, ...] = ()) -> None:
        self.stores, self.offloaded = stores, offloaded
        hot = stores[0]
        self.batch, self.heads, self.num_shards, self.device = hot.batch, hot.heads, hot.num_shards, hot.device

    def summary(self, misses: torch.Tensor) -> ShardSummary:
        parts = [s.summary(misses.to(s.device)) for s in self.stores]
        if len(parts) == 1:
            return parts[0]
        d = self.device
        counts = sum(p.counts.to(d) for p in parts)
        n = counts.clamp(min=1).unsqueeze(-1)
        total = sum(p.centroids.to(d) * p.counts.to(d).unsqueeze(-1) for p in parts)
        square = sum((p.key_var.to(d) + p.centroids.to(d).square()) * p.counts.to(d).unsqueeze(-1) for p in parts)
        centroids = total / n
        away = sum(s.stats.count.to(d) for s in self.offloaded)
        return ShardSummary(
            centroids=centroids,
            counts=counts,
            key_min=torch.stack([p.key_min.to(d) for p in parts]).amin(0),
            key_max=torch.stack([p.key_max.to(d) for p in parts]).amax(0),
            resident=(away == 0) if isinstance(away, torch.Tensor) else torch.ones_like(counts, dtype=torch.bool),
            misses=misses,
            key_var=(square / n - centroids.square()).clamp(min=0),
        )

    def key_stats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(sums, squares, counts)`` of every shard's keys over all stores, on the group's device (``[B, H, S, D]``
        float32 twice, ``[B, H, S]``; one store: its own tensors): what the top-k centroid selection reads, without
        the key bounds :meth:`summary` computes and keeps in every store."""
        parts = [s.shard_stats().sums_and_counts() for s in self.stores]
        if len(parts) == 1:
            return parts[0]
        sums, squares, counts = (sum(p[i].to(self.device) for p in parts) for i in range(3))
        return sums, squares, counts

    def tokens_per_shard(self) -> torch.Tensor:
        """``[B, H, S]`` valid tokens per shard over every store."""
        return sum(s.tokens_per_shard().to(self.device) for s in self.stores)
