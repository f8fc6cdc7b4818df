"""Where the kept tokens of an eviction or crop go: shard by shard, in position order, into exactly the pages they
need, with at most one partly filled page per (row, KV head). Pure index arithmetic over a store's frame; the store
moves the slots (``PagedStore.retain``).

Pages hold the tokens of one shard. Kept tokens spread over every shard would leave one partly filled page per
(row, head, shard): with 8 shards and pages of 64, an eviction of half of 700 tokens freed no page at all. So the
*tail* of each shard (its kept tokens past its last whole page, the newest ones) is pooled with the other shards'
tails of the same (row, head) and cut into pages of ``P``; each such page goes to the shard most of its tokens came
from, and the others change shard (at most ``P - 1`` tokens per shard). Exact and Quest reads do not depend on the
shard of a token; a routed read sees those tokens in their new shard, whose statistics are recounted from the pages
(``Repack.moved``). The bytes held are then those of ``ceil(kept / P)`` pages per (row, head), as with one shard.

Evictions and moves to the offload tier pool tails. Crops (``LayerStores.crop``) and moves to a compressor's tier do not
(``LayerStores.move(pool_tails=False)``): a layer split over its hot store and such a tier reads, routed included,
exactly as the single store would; the hot store there keeps at most one partly filled page per (row, head, shard) of
the compressor's window.
"""

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
    moved : bool
        Some kept token changed shard (its old shard's partly filled page was pooled with others).
    """

    src: torch.Tensor
    ok: torch.Tensor
    shard: torch.Tensor
    rank: torch.Tensor
    count: torch.Tensor
    n_pages: torch.Tensor
    page_base: torch.Tensor
    local: torch.Tensor
    moved: bool


def _sorted(kept: torch.Tensor, shard: torch.Tensor, pos: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``order`` (``[B, H, n]``) of the kept entries by shard then position, ``ok`` and the shard of each entry."""
    key = torch.where(kept, (shard << _POS_BITS) + pos.to(torch.int64), torch.iinfo(torch.int64).max)
    length = int(m.max()) if m.numel() else 0
    order = key.argsort(dim=-1, stable=True)[..., :length]
    ok = torch.arange(length, device=kept.device) < m.unsqueeze(-1)
    return order, ok, shard.gather(2, order).masked_fill(~ok, 0)


def _ranks(sh: torch.Tensor, ok: torch.Tensor, num_shards: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept tokens per shard ``[B, H, S]`` and each sorted entry's rank in its shard ``[B, H, n]``."""
    count = torch.zeros(*sh.shape[:2], num_shards, dtype=torch.int64, device=sh.device)
    count.scatter_add_(2, sh, ok.long())
    return count, torch.arange(sh.shape[-1], device=sh.device) - (count.cumsum(-1) - count).gather(2, sh)


def pool_tails(
    kept: torch.Tensor, shard: torch.Tensor, pos: torch.Tensor, page_size: int, num_shards: int
) -> torch.Tensor:
    """``shard`` (``[B, H, C]`` int64 over a frame) with the tails of the shards pooled (module docstring): the kept
    tokens past each shard's last whole page, cut into pages of ``page_size`` in shard order, each page given to the
    shard most of its tokens come from (ties to the lower id)."""
    p, m = page_size, kept.sum(-1)
    order, ok, sh = _sorted(kept, shard, pos, m)
    count, rank = _ranks(sh, ok, num_shards)
    tail = ok & (rank >= (count // p * p).gather(2, sh))
    chunk = ((tail.cumsum(-1) - 1) // p).clamp(min=0)  # tails are < S * P tokens: chunk < S
    votes = torch.zeros(*sh.shape[:2], num_shards, num_shards, dtype=torch.int64, device=sh.device)
    votes.view(*sh.shape[:2], -1).scatter_add_(2, chunk * num_shards + sh, tail.long())
    new = torch.where(tail, votes.argmax(-1).gather(2, chunk), sh)
    return shard.scatter(2, order, torch.where(ok, new, shard.gather(2, order)))


def repack(
    kept: torch.Tensor,
    slots: torch.Tensor,
    shard: torch.Tensor,
    pos: torch.Tensor,
    page_size: int,
    num_shards: int,
    pool: bool = True,
) -> Repack:
    """The layout of the ``kept`` frame slots (all ``[B, H, C]``: kept flags, flat slot ids, shard ids and
    positions of a store's frame) in pages of ``page_size`` over ``num_shards`` shards, the shards' tails pooled
    (:func:`pool_tails`) unless ``pool`` is False."""
    p, m = page_size, kept.sum(-1)
    pooled = pool_tails(kept, shard, pos, p, num_shards) if pool and num_shards > 1 and p > 1 else shard
    moved = pooled is not shard and bool((kept & (pooled != shard)).any())
    order, ok, sh = _sorted(kept, pooled, pos, m)
    src = slots.gather(2, order)[ok]
    count, rank = _ranks(sh, ok, num_shards)
    npg = count.add(p - 1).div(p, rounding_mode="floor")
    page_base = npg.cumsum(-1) - npg
    local = page_base.gather(2, sh) + rank.div(p, rounding_mode="floor")
    return Repack(src, ok, sh, rank, count, npg, page_base, local, moved)
