"""A layer's stores seen together: the hot store where tokens arrive, and its cold tiers.

A tier is a ``PagedStore`` of its own (its own codec and device): an offload tier holds evicted pages in CPU memory
(or on disk) instead of dropping them, a compressed tier holds sealed pages in a compressed codec. Every token lives
in exactly one store, so attention over the layer is the exact log-sum-exp merge of one partial per store, and a
routed selection reads the shard statistics of all stores together (``StoreGroup.summary``): a shard is resident
when none of its tokens sits in an offloaded store. The key sums, squares and bounds of the layer's shards are kept
once, in the hot store, over the tokens of every store (``PagedStore.summed_with``: a tier receives its tokens from
the hot store, so a move changes no sum), and each store keeps its own counts.
"""

from __future__ import annotations

import torch

from pikv_hf.routing.base import ShardSummary
from pikv_hf.store.paged import PagedStore
from pikv_hf.store.summary import held_bounds, shard_moments


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
        """The shards of every store as a selector sees them: centroids, variances and bounds from the hot store's
        statistics (over every store's tokens), counts summed over the stores, resident where no token is
        offloaded."""
        hot = self.stores[0]
        if len(self.stores) == 1:
            return hot.summary(misses)
        st = hot.shard_stats(bounds=True)
        counts = self._counts()
        centroids, key_var = shard_moments(st.sum, st.sq, counts)
        away = sum(s.stats.count.to(self.device) for s in self.offloaded)
        key_min, key_max = held_bounds(st.min, st.max, counts)
        return ShardSummary(
            centroids=centroids,
            counts=counts,
            key_min=key_min,
            key_max=key_max,
            resident=(away == 0) if isinstance(away, torch.Tensor) else torch.ones_like(counts, dtype=torch.bool),
            misses=misses,
            key_var=key_var,
        )

    def key_stats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(sums, squares, counts)`` of every shard's keys over all stores, on the group's device (``[B, H, S, D]``
        float32 twice, ``[B, H, S]``): what the top-k centroid selection reads, without the key bounds
        :meth:`summary` keeps: the hot store's sums and squares (over every store's tokens) and the counts of all."""
        sums, squares, counts = self.stores[0].shard_stats().sums_and_counts()
        return sums, squares, counts if len(self.stores) == 1 else self._counts()

    def _counts(self) -> torch.Tensor:
        """``[B, H, S]`` valid tokens per shard over every store, on the group's device."""
        return sum(s.stats.count.to(self.device) for s in self.stores)

    def tokens_per_shard(self) -> torch.Tensor:
        """``[B, H, S]`` valid tokens per shard over every store (a copy)."""
        return self._counts() if len(self.stores) > 1 else self.stores[0].tokens_per_shard()
