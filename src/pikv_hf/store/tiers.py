"""A layer's stores: the hot store where new tokens arrive and its named cold tiers, and what moves between them.

A tier is a ``PagedStore`` of its own (its own codec, device and page size): the offload tier holds evicted tokens
in CPU memory or in memory-mapped files instead of dropping them; a compressor's tier holds older tokens in a
compressed codec. Every token sits in exactly one store; attention reads one partial per store and merges them
exactly. Byte counts: ``kv_nbytes`` counts the stores attention reads on the layer's device (every store but the
offload tier), ``offloaded_nbytes`` the offload tier.
"""

from __future__ import annotations

import torch

from pikv_hf.codecs import Codec
from pikv_hf.store.group import StoreGroup
from pikv_hf.store.paged import PagedStore

OFFLOAD = "offload"  # the tier evicted tokens move to instead of being dropped (not resident)
OFFLOAD_TARGETS = ("cpu", "disk")  # where the offload tier keeps its pages: CPU memory or memory-mapped files


class LayerStores:
    """The hot store of one layer and its tiers, by name (in creation order)."""

    def __init__(self, hot: PagedStore) -> None:
        self.hot = hot
        self.tiers: dict[str, PagedStore] = {}

    def keep_summaries(self) -> None:
        """Keep shard summaries from now on: in the hot store, over the tokens of every store (its tiers, the ones
        made later included, count their own tokens only: ``StoreGroup``)."""
        self.hot.keep_summaries()

    def all(self) -> list[PagedStore]:
        """The hot store, then the tiers."""
        return [self.hot, *self.tiers.values()]

    def named(self) -> list[tuple[str, PagedStore]]:
        return [("hot", self.hot), *self.tiers.items()]

    def group(self) -> StoreGroup:
        """Every store seen together (what a read policy plans over); the offload tier is not resident."""
        return StoreGroup(self.all(), (self.tiers[OFFLOAD],) if OFFLOAD in self.tiers else ())

    def tier(
        self,
        name: str,
        codec: Codec | None = None,
        device: torch.device | str | None = None,
        storage: str | None = None,
        page_size: int | None = None,
    ) -> PagedStore:
        """The tier ``name``, created on first use as an empty store like the hot one, with ``codec`` (default
        identity) on ``device`` (default the hot store's), in ``storage`` (see ``PagePool``), with pages of
        ``page_size`` tokens (default the hot store's; a quantised tier's page is its group of tokens)."""
        if name not in self.tiers:
            st = self.hot
            self.tiers[name] = PagedStore(
                st.batch, st.heads, st.k_dim, st.v_dim, st.num_shards, page_size or st.page_size, st.dtype,
                torch.device(device) if device is not None else st.device, codec=codec, storage=storage,
            )  # fmt: skip
            st.summed_with.append(self.tiers[name])  # its tokens arrive from the hot store, whose sums keep them
        return self.tiers[name]

    def move(self, name: str, keep: torch.Tensor, pool_tails: bool = False) -> torch.Tensor:
        """Move the hot store's valid tokens where ``keep`` (``[B, H, W * P]`` bool over its frame) is False to the
        tier ``name`` (see :meth:`tier`), with their shard and position; returns ``[B, H]`` tokens moved. Attention
        still reads them, from the tier; their per-slot statistics start over there. ``pool_tails``: the hot store's
        re-pack pools the shards' partly filled pages (``PagedStore.retain``; some kept tokens change shard)."""
        st = self.hot
        move = st.frame("valid") & ~keep
        n = move.sum(-1)
        if not bool(n.any()):
            self._drop_empty()  # a tier made for this move that receives nothing
            return n
        tier = self.tier(name)
        pos = st.frame("pos").to(torch.int64)
        order = torch.where(move, pos, torch.iinfo(torch.int64).max).argsort(dim=-1, stable=True)[..., : int(n.max())]
        present = torch.arange(order.shape[-1], device=st.device) < n.unsqueeze(-1)
        keys, values = st.frame_kv()

        def take(t: torch.Tensor) -> torch.Tensor:
            return t.gather(2, order.unsqueeze(-1).expand(*order.shape, t.shape[-1])).to(tier.device)

        shard = st.frame("shard").long().repeat_interleave(st.page_size, dim=-1).gather(2, order).clamp(min=0)
        d = tier.device
        tier.append(take(keys), take(values), shard.to(d), pos.gather(2, order).to(d), present.to(d))
        st.retain(keep | ~st.frame("valid"), pool_tails)
        return n

    def offload(self, keep: torch.Tensor, target: str = "cpu") -> torch.Tensor:
        """Move the hot store's tokens outside ``keep`` to the offload tier: CPU memory (``"cpu"``, pinned when the
        layer is on a GPU) or memory-mapped files that leave nothing behind (``"disk"``). Returns ``[B, H]`` moved."""
        if OFFLOAD not in self.tiers:
            storage = "disk" if target == "disk" else ("pinned" if self.hot.device.type == "cuda" else None)
            self.tier(OFFLOAD, device="cpu", storage=storage)
        return self.move(OFFLOAD, keep, pool_tails=True)  # what stays resident is the press's share, in bytes

    def crop(self, max_length: int) -> torch.Tensor:
        """Drop every stored token at a position ``>= max_length``; returns ``[B, H]`` tokens removed. Every other
        token keeps its shard (no pooled tails: a crop undoes appends, it is no press's ratio)."""
        removed = self.hot.retain(self.hot.frame("pos") < max_length, pool_tails=False)
        for tier in self.tiers.values():
            removed += tier.retain(tier.frame("pos") < max_length, pool_tails=False).to(removed.device)
        self._drop_empty()
        return removed

    def index_batch(self, index: torch.Tensor) -> None:
        for st in self.all():
            st.index_batch(index.to(st.device))
        self._drop_empty()

    def _drop_empty(self) -> None:
        """Forget the tiers that hold no token (a crop or a batch selection emptied them, or a move made one and put
        nothing in it): a tier exists while it holds tokens, so reads, sum recounts and the refusal to evict a layer
        that holds tiers see only those (an empty tier's read and recount failed on its empty pool)."""
        for name in [name for name, tier in self.tiers.items() if not bool(tier.stats.count.any())]:
            self.hot.summed_with.remove(self.tiers.pop(name))
            self.hot.mark_sums_stale()

    def tokens_per_shard(self) -> torch.Tensor:
        """``[B, H, S]`` valid tokens per shard over every store."""
        return self.group().tokens_per_shard()

    def resident_tokens(self) -> torch.Tensor:
        """``[B, H]`` tokens held outside the offload tier."""
        return sum(s.tokens_per_shard().sum(-1).to(self.hot.device) for n, s in self.named() if n != OFFLOAD)

    def kv_nbytes(self) -> int:
        """Key/value bytes allocated in every store but the offload tier."""
        return sum(s.kv_nbytes() for n, s in self.named() if n != OFFLOAD)

    def empty_nbytes(self) -> int:
        """The share of :meth:`kv_nbytes` in slots that hold no token (``PagedStore.empty_nbytes``)."""
        return sum(s.empty_nbytes() for n, s in self.named() if n != OFFLOAD)

    def offloaded_nbytes(self) -> int:
        return self.tiers[OFFLOAD].kv_nbytes() if OFFLOAD in self.tiers else 0

    def meta_nbytes(self) -> int:
        return sum(s.meta_nbytes() for s in self.all())
