"""Incremental per-shard key statistics of one layer: what a selector reads instead of the keys.

Per batch row, KV head and shard: the sum and sum of squares of the valid keys (mean and per-dimension variance),
their count and their element-wise min / max. Appends add; padding subtracts; eviction sets the counts and leaves the
sums to be recounted from the re-packed pages when a selector next reads them.
Min / max are not recomputed on removal: a bound over a superset of the keys is still a valid bound (Quest's
``q . k`` upper bound stays an upper bound).
"""

from __future__ import annotations

import torch

from pikv_hf.routing.base import ShardSummary


class ShardStats:
    """``[B, H, S, Dk]`` float32 sums / squares / min / max and ``[B, H, S]`` int64 counts of the valid keys.

    The sums and squares are allocated when first kept (:meth:`add` with keys, :meth:`key_stats`, :meth:`recount`),
    the bounds (min / max) only when asked for (:meth:`keep_bounds`, ``recount(bounds=True)``): a store nobody selects
    shards of keeps only counts, and the top-k centroid selector reads no bound. Each of the four is ``S x Dk``
    floats per (row, head): a sixteenth of a 4k-token fp16 KV at 256 shards.
    """

    _KEY_STATS = ("sum", "sq", "min", "max")

    def __init__(self, batch: int, heads: int, num_shards: int, k_dim: int, device: torch.device) -> None:
        self.k_dim = k_dim
        self.count = torch.zeros(batch, heads, num_shards, dtype=torch.int64, device=device)
        self.sum = self.sq = self.min = self.max = None
        self._resident: torch.Tensor | None = None  # every shard resident (a store holds its own pages)

    def _keep_keys(self) -> None:
        """Allocate the key sums and squares (empty: zeros) unless kept already."""
        if self.sum is None:
            self.sum = self.count.new_zeros(*self.count.shape, self.k_dim, dtype=torch.float32)
            self.sq = torch.zeros_like(self.sum)

    def keep_bounds(self) -> None:
        """Allocate the key bounds (empty: +inf / -inf) unless kept already; keys folded in from now on update them
        (a caller with keys already counted recomputes them: ``recount(bounds=True)``)."""
        self._keep_keys()
        if self.min is None:
            self.min = torch.full_like(self.sum, float("inf"))
            self.max = torch.full_like(self.sum, float("-inf"))

    @property
    def bounds_kept(self) -> bool:
        return self.min is not None

    def key_stats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The key sums and squares (allocated if not kept yet) and the min and max (None unless kept), for an
        operator that folds keys in."""
        self._keep_keys()
        return self.sum, self.sq, self.min, self.max

    def sums_and_counts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The key sums and squares (allocated if not kept yet) and the counts: what the top-k centroid selection
        reads (``StoreGroup.key_stats``)."""
        self._keep_keys()
        return self.sum, self.sq, self.count

    def add(self, bhs: torch.Tensor, keys: torch.Tensor, sign: int = 1, counts_only: bool = False) -> None:
        """Fold ``[M, Dk]`` keys of flat ``(row, head, shard)`` ids ``bhs`` (``[M]``) in (``sign=1``) or out
        (``sign=-1``); ``counts_only`` leaves the key statistics alone (a store whose summaries nobody reads yet)."""
        if counts_only:
            self.count.view(-1).index_add_(0, bhs, torch.ones_like(bhs), alpha=sign)
            return
        self._keep_keys()
        k = keys.float()
        d = k.shape[-1]
        self.sum.view(-1, d).index_add_(0, bhs, k, alpha=sign)
        self.sq.view(-1, d).index_add_(0, bhs, k * k, alpha=sign)
        self.count.view(-1).index_add_(0, bhs, torch.ones_like(bhs), alpha=sign)
        if sign > 0 and self.bounds_kept:
            idx = bhs.unsqueeze(-1).expand_as(k)
            self.min.view(-1, d).scatter_reduce_(0, idx, k, "amin")
            self.max.view(-1, d).scatter_reduce_(0, idx, k, "amax")

    def recount(self, pages: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], bounds: bool = False) -> None:
        """Recompute sums and squares from the pages of one or more stores, each ``(bhs, keys, valid)``: the flat
        ``(row, head, shard)`` id of each page ``[N]``, its keys ``[N, P, Dk]`` and valid slots ``[N, P]``, on any
        device (each store's part is taken there, then added here). Counts are the caller's; min / max are kept
        (after a removal they still bound the keys) unless ``bounds`` asks for them anew (allocating them if not
        kept)."""
        self._keep_keys()
        self.sum.zero_()
        self.sq.zero_()
        if bounds:
            self.keep_bounds()
            self.min.fill_(float("inf"))
            self.max.fill_(float("-inf"))
        d, dev = self.k_dim, self.sum.device
        for bhs, keys, valid in pages:
            k = keys.float() * valid.unsqueeze(-1)
            at = bhs.to(dev)
            self.sum.view(-1, d).index_add_(0, at, k.sum(1).to(dev))
            self.sq.view(-1, d).index_add_(0, at, (k * k).sum(1).to(dev))
            if bounds:
                idx = at.unsqueeze(-1).expand(-1, d)
                lo = k.masked_fill(~valid.unsqueeze(-1), float("inf")).amin(1).to(dev)
                hi = k.masked_fill(~valid.unsqueeze(-1), float("-inf")).amax(1).to(dev)
                self.min.view(-1, d).scatter_reduce_(0, idx, lo, "amin")
                self.max.view(-1, d).scatter_reduce_(0, idx, hi, "amax")

    def index_batch(self, index: torch.Tensor) -> None:
        for name in ("count", *self._KEY_STATS):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).index_select(0, index))

    def summary(self, misses: torch.Tensor) -> ShardSummary:
        """The shards as a selector sees them (every shard is resident: no offload tier yet); the bounds must be kept
        (:meth:`keep_bounds`)."""
        if not self.bounds_kept:
            raise RuntimeError("ShardStats.summary: key bounds are not kept (call keep_bounds() before adding keys)")
        centroids, key_var = shard_moments(self.sum, self.sq, self.count)
        if torch.compiler.is_compiling():  # a compiled step changes no attribute dynamo guards on
            resident = torch.ones_like(self.count, dtype=torch.bool)
        else:
            if self._resident is None or self._resident.shape != self.count.shape:
                self._resident = torch.ones_like(self.count, dtype=torch.bool)
            resident = self._resident
        key_min, key_max = held_bounds(self.min, self.max, self.count)
        return ShardSummary(
            centroids=centroids,
            counts=self.count,
            key_min=key_min,
            key_max=key_max,
            resident=resident,
            misses=misses,
            key_var=key_var,
        )

    def nbytes(self) -> int:
        held = (self.count, *(getattr(self, name) for name in self._KEY_STATS))
        return sum(t.numel() * t.element_size() for t in held if t is not None)


def shard_moments(
    sums: torch.Tensor, squares: torch.Tensor | None, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mean key (``[B, H, S, D]``, zeros for an empty shard) and per-dimension variance (clamped at 0; None without
    ``squares``) of shards with key ``sums`` / ``squares`` (``[B, H, S, D]`` float32) and ``counts`` (``[B, H, S]``)."""
    n = counts.clamp(min=1).unsqueeze(-1)
    centroids = sums / n
    if squares is None:
        return centroids, None
    return centroids, torch.addcmul(squares / n, centroids, centroids, value=-1).clamp_(min=0)


def held_bounds(
    key_min: torch.Tensor, key_max: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key bounds (``[B, H, S, D]``) with every shard that holds no token (``counts`` ``[B, H, S]`` 0) at +inf /
    -inf: bounds are not recomputed on removal, so a shard emptied by eviction or a crop still carries its old keys'
    bounds, which a bound score would rank as if those keys were there."""
    empty = (counts == 0).unsqueeze(-1)
    return key_min.masked_fill(empty, float("inf")), key_max.masked_fill(empty, float("-inf"))
