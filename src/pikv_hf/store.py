"""Paged, expert-sharded KV storage for one decoder layer.

Every ``(batch row, KV head)`` owns a run of fixed-size pages inside one slot array of capacity ``C = NP * P``
(``NP`` pages of ``P`` tokens). Each page belongs to exactly one shard; a shard's tokens are appended to that
shard's open page, and a new page is opened when it is full. Pages of different shards interleave in the slot
array, so a shard is the set of pages whose ``page_shard`` equals its id.

Every slot keeps its original sequence position (the layer's token ordinal, pads included, the frame in which
causal masking happens), a valid bit (False for empty slots and padding) and three per-token statistics that
schedulers use: accumulated attention mass, step of last access and hit count.

Tensors (``B`` batch, ``H`` KV heads):

============  ==================  ======================================
name          shape               dtype
============  ==================  ======================================
keys          ``[B, H, C, Dk]``   model dtype
values        ``[B, H, C, Dv]``   model dtype
pos           ``[B, H, C]``       int32, sequence position
valid         ``[B, H, C]``       bool
attn_mass     ``[B, H, C]``       float32
last_access   ``[B, H, C]``       int32
hits          ``[B, H, C]``       int32
page_shard    ``[B, H, NP]``      int64, shard of each page (-1 unused)
n_pages       ``[B, H]``          int64, pages in use
open_page     ``[B, H, S]``       int64, each shard's open page (-1 none)
open_fill     ``[B, H, S]``       int64, tokens in that page
shard_sum     ``[B, H, S, Dk]``   float32, sum of the shard's valid keys
shard_sq      ``[B, H, S, Dk]``   float32, sum of their squares (per-dimension key variance)
shard_count   ``[B, H, S]``       int64, valid tokens of the shard
shard_min     ``[B, H, S, Dk]``   float32, element-wise min of its keys
shard_max     ``[B, H, S, Dk]``   float32, element-wise max of its keys
page_min      ``[B, H, NP, Dk]``  float32, element-wise min of a page's valid keys (only with page bounds)
page_max      ``[B, H, NP, Dk]``  float32, element-wise max of a page's valid keys (only with page bounds)
============  ==================  ======================================

The shard summaries are maintained on every append and rebuilt after compaction or invalidation, so a
selector reads ``O(S * Dk)`` numbers per KV head instead of rescanning the keys. Per-page bounds (Quest's page
metadata) are kept the same way once :meth:`PagedShardStore.enable_page_bounds` was called.
"""

from __future__ import annotations

import torch

from pikv_hf.routing.base import ShardSummary

_SLOT_FIELDS = ("keys", "values", "pos", "valid", "attn_mass", "last_access", "hits")
_SUMMARY_FIELDS = ("shard_sum", "shard_sq", "shard_count", "shard_min", "shard_max")
_BATCH_FIELDS = (*_SLOT_FIELDS, "page_shard", "n_pages", "open_page", "open_fill", *_SUMMARY_FIELDS)
_STAT_FIELDS = ("attn_mass", "last_access", "hits")


class PagedShardStore:
    """Paged slot storage of one layer, grouped by shard. Allocation grows by whole pages with ~1.6% headroom."""

    def __init__(
        self,
        batch: int,
        heads: int,
        k_dim: int,
        v_dim: int,
        num_shards: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        workspace: dict | None = None,
    ) -> None:
        self.page_size = int(page_size)
        # gather scratch, keyed by (field, dtype, device); a cache passes one dict to all its layers' stores
        self._workspace: dict[tuple, torch.Tensor] = {} if workspace is None else workspace
        self.num_shards = int(num_shards)
        self.k_dim, self.v_dim = int(k_dim), int(v_dim)
        self.dtype, self.device = dtype, device
        self.page_min: torch.Tensor | None = None
        self.page_max: torch.Tensor | None = None
        self._allocate(batch, heads, pages=0)

    # ------------------------------------------------------------------ allocation
    def _allocate(self, batch: int, heads: int, pages: int) -> None:
        b, h, c, dev = batch, heads, pages * self.page_size, self.device
        self.keys = torch.zeros(b, h, c, self.k_dim, dtype=self.dtype, device=dev)
        self.values = torch.zeros(b, h, c, self.v_dim, dtype=self.dtype, device=dev)
        self.pos = torch.zeros(b, h, c, dtype=torch.int32, device=dev)
        self.valid = torch.zeros(b, h, c, dtype=torch.bool, device=dev)
        self.attn_mass = torch.zeros(b, h, c, dtype=torch.float32, device=dev)
        self.last_access = torch.zeros(b, h, c, dtype=torch.int32, device=dev)
        self.hits = torch.zeros(b, h, c, dtype=torch.int32, device=dev)
        self.page_shard = torch.full((b, h, pages), -1, dtype=torch.int64, device=dev)
        self.n_pages = torch.zeros(b, h, dtype=torch.int64, device=dev)
        self.open_page = torch.full((b, h, self.num_shards), -1, dtype=torch.int64, device=dev)
        self.open_fill = torch.zeros(b, h, self.num_shards, dtype=torch.int64, device=dev)
        self._reset_summaries()
        if self.page_min is not None:
            self.page_min, self.page_max = self._empty_bounds(pages)

    @property
    def batch(self) -> int:
        return self.keys.shape[0]

    @property
    def heads(self) -> int:
        return self.keys.shape[1]

    @property
    def capacity_pages(self) -> int:
        return self.page_shard.shape[-1]

    def _grow(self, pages: int) -> None:
        """Grow every per-slot and per-page tensor to ``pages`` pages, keeping contents."""
        extra_pages = pages - self.capacity_pages
        extra_slots = extra_pages * self.page_size
        for name in _SLOT_FIELDS:
            t = getattr(self, name)
            pad = t.new_zeros(*t.shape[:2], extra_slots, *t.shape[3:])
            setattr(self, name, torch.cat([t, pad], dim=2))
        self.page_shard = torch.cat(
            [self.page_shard, self.page_shard.new_full((self.batch, self.heads, extra_pages), -1)], 2
        )
        if self.page_min is not None:
            lo, hi = self._empty_bounds(extra_pages)
            self.page_min, self.page_max = torch.cat([self.page_min, lo], 2), torch.cat([self.page_max, hi], 2)

    # ------------------------------------------------------------------ writes
    def append(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        shard: torch.Tensor,
        pos: torch.Tensor,
        present: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store new tokens in their shards' pages.

        Parameters
        ----------
        keys, values : torch.Tensor
            ``[B, H, q, Dk]`` and ``[B, H, q, Dv]``.
        shard : torch.Tensor
            ``[B, H, q]`` int64 shard ids in ``[0, S)``.
        pos : torch.Tensor
            ``[B, H, q]`` or ``[q]`` sequence positions of the new tokens.
        present : torch.Tensor, optional
            ``[B, H, q]`` bool; tokens with False take no slot (used by compaction). Default: all present.

        Returns
        -------
        torch.Tensor
            ``[B, H, q]`` int64 slot index of every token (-1 where not present).
        """
        b, h, q = shard.shape
        p, s = self.page_size, self.num_shards
        onehot = torch.nn.functional.one_hot(shard, s)  # [B,H,q,S]
        if present is not None:
            onehot = onehot * present.unsqueeze(-1)
        rank = (onehot.cumsum(2) - 1).gather(-1, shard.unsqueeze(-1)).squeeze(-1)  # rank among new tokens of shard
        count = onehot.sum(2)  # [B,H,S]
        base = torch.where(self.open_page >= 0, self.open_fill, p)  # fill of each shard's open page (P: none open)
        n_new = (base + count - p).clamp(min=0).add(p - 1).div(p, rounding_mode="floor")  # new pages per shard
        first_new = self.n_pages.unsqueeze(-1) + n_new.cumsum(-1) - n_new
        t = base.gather(-1, shard) + rank  # offset of the token in its shard's stream, from the open page start
        in_open = t < p
        page = torch.where(in_open, self.open_page.gather(-1, shard), first_new.gather(-1, shard) + (t - p) // p)
        slot = page * p + torch.where(in_open, t, (t - p) % p)

        needed = int((self.n_pages + n_new.sum(-1)).max())
        if needed > self.capacity_pages:
            self._grow(needed + needed // 64)

        self.open_page = torch.where(n_new > 0, first_new + n_new - 1, self.open_page)
        self.open_fill = torch.where(n_new > 0, base + count - p * n_new, base + count)
        self.n_pages = self.n_pages + n_new.sum(-1)

        flat, sel = self._flat_index(slot, present)
        self._write(self.keys, keys.to(self.dtype), flat, sel)
        self._write(self.values, values.to(self.dtype), flat, sel)
        self._write(self.pos, pos.to(torch.int32).expand(b, h, q), flat, sel)
        self._write(self.valid, torch.ones(b, h, q, dtype=torch.bool, device=shard.device), flat, sel)
        for name in _STAT_FIELDS:
            dst = getattr(self, name)
            self._write(dst, torch.zeros(b, h, q, dtype=dst.dtype, device=shard.device), flat, sel)
        page_flat = (torch.arange(b * h, device=shard.device).view(b, h, 1) * self.capacity_pages + page).reshape(-1)
        shard_flat = shard.reshape(-1)
        if sel is not None:
            page_flat, shard_flat = page_flat[sel], shard_flat[sel]
        self.page_shard.view(-1).index_copy_(0, page_flat, shard_flat)
        self._add_to_summaries(keys, shard, count, present)
        if self.page_min is not None:
            self._fold_bounds(self.page_min, self.page_max, keys, page.clamp(min=0), present)
        return slot if present is None else torch.where(present, slot, -1)

    def _add_to_summaries(
        self, keys: torch.Tensor, shard: torch.Tensor, count: torch.Tensor, present: torch.Tensor | None
    ) -> None:
        """Fold ``[B, H, q, Dk]`` keys into their shards' sum / sum of squares / count / min / max."""
        k = keys.float()
        if present is not None:
            k = k * present.unsqueeze(-1)
        idx = shard.unsqueeze(-1).expand_as(k)
        self.shard_sum.scatter_add_(2, idx, k)
        self.shard_sq.scatter_add_(2, idx, k * k)
        self.shard_count += count
        self._fold_bounds(self.shard_min, self.shard_max, keys, shard, present)

    @staticmethod
    def _fold_bounds(
        lo: torch.Tensor, hi: torch.Tensor, keys: torch.Tensor, index: torch.Tensor, present: torch.Tensor | None
    ) -> None:
        """Fold ``[B, H, q, Dk]`` keys into the element-wise min ``lo`` / max ``hi`` (``[B, H, N, Dk]``) of the sets
        ``index`` (``[B, H, q]``) names; tokens with ``present`` False are skipped."""
        k = keys.float()
        k_lo = k_hi = k
        if present is not None:
            keep = present.unsqueeze(-1)
            k_lo, k_hi = k.masked_fill(~keep, float("inf")), k.masked_fill(~keep, float("-inf"))
        idx = index.unsqueeze(-1).expand_as(k)
        lo.scatter_reduce_(2, idx, k_lo, "amin")
        hi.scatter_reduce_(2, idx, k_hi, "amax")

    def _empty_bounds(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, H, n, Dk]`` float32 min / max of ``n`` empty key sets (+inf / -inf)."""
        shape = (self.batch, self.heads, n, self.k_dim)
        return (
            torch.full(shape, float("inf"), device=self.device),
            torch.full(shape, float("-inf"), device=self.device),
        )

    def enable_page_bounds(self) -> None:
        """Keep per-page key min / max from now on (computed once here from the stored keys)."""
        if self.page_min is None:
            self._rebuild_page_bounds()

    def _rebuild_page_bounds(self) -> None:
        b, h, np_, p = self.batch, self.heads, self.capacity_pages, self.page_size
        k = self.keys.float().view(b, h, np_, p, self.k_dim)
        valid = self.valid.view(b, h, np_, p, 1)
        self.page_min = k.masked_fill(~valid, float("inf")).amin(3)
        self.page_max = k.masked_fill(~valid, float("-inf")).amax(3)

    def page_bounds(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Quest's page metadata: ``(key_min, key_max)`` ``[B, H, NP, Dk]`` and valid tokens per page ``[B, H, NP]``."""
        if self.page_min is None:
            raise RuntimeError("page bounds are not kept: call enable_page_bounds() first")
        count = self.valid.view(self.batch, self.heads, self.capacity_pages, self.page_size).sum(-1)
        return self.page_min, self.page_max, count

    def _reset_summaries(self) -> None:
        """Empty shard summaries for the current batch and heads."""
        shape = (self.batch, self.heads, self.num_shards)
        self.shard_sum = torch.zeros(*shape, self.k_dim, device=self.device)
        self.shard_sq = torch.zeros_like(self.shard_sum)
        self.shard_count = torch.zeros(shape, dtype=torch.int64, device=self.device)
        self.shard_min, self.shard_max = self._empty_bounds(self.num_shards)

    def rebuild_summaries(self) -> None:
        """Recompute the shard summaries from the valid slots (after slots were invalidated)."""
        self._reset_summaries()
        shard = self.slot_shard().clamp(min=0)
        count = torch.zeros_like(self.shard_count).scatter_add_(2, shard, self.valid.long())
        self._add_to_summaries(self.keys, shard, count, self.valid)
        if self.page_min is not None:
            self._rebuild_page_bounds()

    def _flat_index(self, slot: torch.Tensor, present: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Flattened ``[B*H*C]`` index of each (present) token's slot, and the selection of present tokens."""
        b, h, _ = slot.shape
        flat = (torch.arange(b * h, device=slot.device).view(b, h, 1) * self.keys.shape[2] + slot).reshape(-1)
        if present is None:
            return flat, None
        sel = present.reshape(-1).nonzero().squeeze(-1)
        return flat[sel], sel

    @staticmethod
    def _write(dst: torch.Tensor, src: torch.Tensor, flat: torch.Tensor, sel: torch.Tensor | None) -> None:
        """Copy per-token ``src`` (``[B, H, q, ...]``) into ``dst`` (``[B, H, C, ...]``) at ``flat`` slots."""
        src = src.reshape(-1, *dst.shape[3:])
        dst.view(-1, *dst.shape[3:]).index_copy_(0, flat, src if sel is None else src[sel])

    def invalidate(self, slot: torch.Tensor, keep: torch.Tensor) -> None:
        """Clear the valid bit of appended ``slot`` entries (``[B, H, q]``) where ``keep`` (``[B, q]``) is False."""
        if bool(keep.all()):
            return
        self.valid.scatter_(2, slot, self.valid.gather(2, slot) & keep.unsqueeze(1))
        self.rebuild_summaries()

    # ------------------------------------------------------------------ batch ops
    def index_batch(self, index: torch.Tensor) -> None:
        """Keep / reorder batch rows along ``index`` (int64 ``[B']``) in every per-row tensor."""
        index = index.to(self.device)
        for name in _BATCH_FIELDS:
            setattr(self, name, getattr(self, name).index_select(0, index))
        if self.page_min is not None:
            self.page_min, self.page_max = self.page_min.index_select(0, index), self.page_max.index_select(0, index)

    def compact(self, keep: torch.Tensor) -> None:
        """Rebuild the store with only the slots where ``keep`` (``[B, H, C]`` bool) is True.

        Kept tokens stay in their shard, in position order, with their statistics; pages are re-packed, so the
        freed slots are really released.
        """
        keep = keep & self.valid
        n_keep = keep.sum(-1)  # [B,H]
        length = int(n_keep.max()) if n_keep.numel() else 0
        big = torch.iinfo(torch.int32).max
        order = torch.where(keep, self.pos, big).argsort(dim=-1, stable=True)[..., :length]  # [B,H,L]
        present = keep.gather(2, order)
        gathered = {
            name: getattr(self, name).gather(
                2,
                order.view(*order.shape, *([1] * (getattr(self, name).dim() - 3))).expand(
                    *order.shape, *getattr(self, name).shape[3:]
                ),
            )
            for name in _SLOT_FIELDS
        }
        shard = self.page_shard.gather(2, order // self.page_size).clamp(min=0)
        b, h = self.batch, self.heads
        self._allocate(b, h, pages=0)
        if length == 0:
            return
        slot = self.append(gathered["keys"], gathered["values"], shard, gathered["pos"], present)
        flat, sel = self._flat_index(slot, present)
        for name in _STAT_FIELDS:
            self._write(getattr(self, name), gathered[name], flat, sel)

    # ------------------------------------------------------------------ reads
    def slot_shard(self) -> torch.Tensor:
        """``[B, H, C]`` shard id of every slot (-1 for slots of unused pages)."""
        return self.page_shard.repeat_interleave(self.page_size, dim=-1)

    def tokens_per_shard(self) -> torch.Tensor:
        """``[B, H, S]`` number of valid tokens held by each shard."""
        shard = self.slot_shard().clamp(min=0)
        out = torch.zeros(self.batch, self.heads, self.num_shards, dtype=torch.int64, device=self.device)
        return out.scatter_add_(2, shard, self.valid.to(torch.int64))

    def summary(self, misses: torch.Tensor) -> ShardSummary:
        """The shards as a selector sees them (every shard is resident: no offload tier yet)."""
        count = self.shard_count
        n = count.clamp(min=1).unsqueeze(-1)
        centroids = self.shard_sum / n
        return ShardSummary(
            centroids=centroids,
            counts=count,
            key_min=self.shard_min,
            key_max=self.shard_max,
            resident=torch.ones_like(count, dtype=torch.bool),
            misses=misses,
            key_var=(self.shard_sq / n - centroids.square()).clamp(min=0),
        )

    def gather_pages(self, pages: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copy the listed pages (``[B, H, n]`` page ids) of every slot field into ``[B, H, n * P, ...]`` tensors.

        The copies are views of a workspace kept between calls and grown when a gather needs more (shared by every
        layer of a ``PiKVCache``, which attend one after the other): a fresh multi-megabyte tensor per decode step
        costs more in page faults than the copy itself on CPU. The returned tensors are valid only until the next
        ``gather_pages`` call on a store sharing the workspace.
        """
        b, h, n = pages.shape
        p, np_ = self.page_size, self.capacity_pages
        flat = (torch.arange(b * h, device=pages.device).view(b, h, 1) * np_ + pages).reshape(-1)
        out = {}
        for name in ("keys", "values", "pos", "valid"):
            t = getattr(self, name)
            tail = t.shape[3:]
            width = p * max(1, tail.numel())
            rows = t.reshape(b * h * np_, width)  # one row per page, contiguous
            key = (name, t.dtype, t.device)
            buf = self._workspace.get(key)
            if buf is None or buf.numel() < flat.numel() * width:
                buf = self._workspace[key] = t.new_empty(flat.numel() * width)
            dest = buf[: flat.numel() * width].view(flat.numel(), width)
            out[name] = torch.index_select(rows, 0, flat, out=dest).view(b, h, n * p, *tail)
        out["shard"] = self.page_shard.gather(2, pages).repeat_interleave(p, dim=-1)
        return out

    def workspace_nbytes(self) -> int:
        """Bytes held by the gather workspace (the largest routed read so far, shared with the other layers of the
        cache; not part of the stored KV)."""
        return sum(t.numel() * t.element_size() for t in self._workspace.values())

    def kv_nbytes(self) -> int:
        """Bytes held by the key and value tensors."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def meta_nbytes(self) -> int:
        """Bytes held by positions, valid bits, statistics and page tables."""
        names = ("pos", "valid", *_STAT_FIELDS, "page_shard", "n_pages", "open_page", "open_fill", *_SUMMARY_FIELDS)
        if self.page_min is not None:
            names = (*names, "page_min", "page_max")
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in names)
