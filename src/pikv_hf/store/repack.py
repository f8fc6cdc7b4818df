"""Where the kept tokens of an eviction or crop go: shard by shard, in position order, into exactly the pages they
need (at most one partly filled page per (row, KV head, shard)). Pure index arithmetic over a store's frame; the
store moves the slots (``PagedStore.retain``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_POS_BITS = 32  # kept tokens sort by shard * 2**32 + position


@dataclass
class Repack:
    """The new layout of the kept tokens, ``n`` = most kept tokens of any (row, head), entries in sorted order.

    Attributes
    ----------
    src : torch.Tensor
        ``[M]`` flat pool slot of each kept token (``M`` kept tokens in all), in the order of ``ok``'s True entries.
    ok : torch.Tensor
        ``[B, H, n]`` bool: entry ``j`` of a (row, head) is one of its kept tokens.
    shard, rank : torch.Tensor
        ``[B, H, n]`` shard of each entry (0 where not ``ok``) and its rank among the kept tokens of its shard.
    count, n_pages, page_base : torch.Tensor
        ``[B, H, S]`` kept tokens per shard, pages they fill and the local index of each shard's first page.
    local : torch.Tensor
        ``[B, H, n]`` local page (in the run of its (row, head)) each entry goes to; its slot is ``rank % P``.
    """

    src: torch.Tensor
    ok: torch.Tensor
    shard: torch.Tensor
    rank: torch.Tensor
    count: torch.Tensor
    n_pages: torch.Tensor
    page_base: torch.Tensor
    local: torch.Tensor


def repack(
    kept: torch.Tensor, slots: torch.Tensor, shard: torch.Tensor, pos: torch.Tensor, page_size: int, num_shards: int
) -> Repack:
    """The layout of the ``kept`` frame slots (all ``[B, H, C]``: kept flags, flat slot ids, shard ids and
    positions of a store's frame) in pages of ``page_size`` over ``num_shards`` shards."""
    b, h, _ = kept.shape
    p, device = page_size, kept.device
    key = torch.where(kept, (shard << _POS_BITS) + pos.to(torch.int64), torch.iinfo(torch.int64).max)
    order = key.argsort(dim=-1, stable=True)
    m = kept.sum(-1)
    length = int(m.max()) if m.numel() else 0
    order = order[..., :length]
    ok = torch.arange(length, device=device) < m.unsqueeze(-1)
    src = slots.gather(2, order)[ok]
    sh = shard.gather(2, order).masked_fill(~ok, 0)
    count = torch.zeros(b, h, num_shards, dtype=torch.int64, device=device)
    count.scatter_add_(2, sh, ok.long())
    npg = count.add(p - 1).div(p, rounding_mode="floor")
    page_base = npg.cumsum(-1) - npg
    rank = torch.arange(length, device=device) - (count.cumsum(-1) - count).gather(2, sh)
    local = page_base.gather(2, sh) + rank.div(p, rounding_mode="floor")
    return Repack(src, ok, sh, rank, count, npg, page_base, local)
