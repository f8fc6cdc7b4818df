"""``PiKVLayer``: one decoder layer's cache. Per-layer policy lives here; the work is delegated.

``update``: validate -> placement router (token -> shard) -> ``PagedStore.append`` -> ``PagedKV`` view.
``attend``: padding -> read policy (``ReadPlan``) -> attention backend (``(o, lse)``) -> statistics.
``evict`` / ``crop`` / batch operations: ``PagedStore.retain`` / ``index_batch``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import CacheLayerMixin

from pikv_hf.attention import Partial, TorchBackend
from pikv_hf.config import ReadConfig
from pikv_hf.read import ReadPlan, RoutingStats, make_policy, sink_or_recent
from pikv_hf.routing import Placement, PlacementContext
from pikv_hf.store import PagedStore

if TYPE_CHECKING:
    from pikv_hf.distributed import Partition


@dataclass(frozen=True)
class PagedKV:
    """What ``PiKVLayer.update`` returns in place of key/value tensors; only the ``pikv`` attention reads it.

    ``shape`` is ``[B, H_kv, T, D]`` with ``T`` the ``kv_length`` of ``get_mask_sizes`` (tokens seen minus the
    fewest evicted from any (row, head)), so code that wraps attention functions and inspects sizes, such as
    kvpress's attention patch, keeps working.
    """

    layer: PiKVLayer
    kind: str  # "keys" or "values"

    @property
    def shape(self) -> torch.Size:
        st, layer = self.layer.store, self.layer
        dim = st.k_dim if self.kind == "keys" else st.v_dim
        return torch.Size((st.batch, st.heads, layer.seen - layer.min_evicted(), dim))

    def __setitem__(self, index, value) -> None:
        raise TypeError(
            "PiKVCache keeps K/V in pages and cannot take in-place key edits (kvpress head-wise presses such as "
            "AdaKV write fake keys through masked_key_indices); presses inside PiKVCache arrive with the "
            "kvpress-native issue"
        )


class PiKVLayer(CacheLayerMixin):
    """One decoder layer's expert-sharded paged cache.

    Parameters
    ----------
    layer_idx : int
        Index of the decoder layer.
    placement : Placement
        This layer's placement router (token -> shard).
    page_size : int
        Tokens per page.
    shard_groups : int
        Exact attention computes one partial per group of shards and merges them with log-sum-exp.
    track_stats : bool
        Update each slot's attention mass, hit count and last access in the attention path (every read mode).
    read : ReadConfig
        Decode-time read settings (exact, routed, Quest).
    backend : TorchBackend, optional
        Attention backend (shared by the layers of a cache; default: a fresh torch reference backend).
    partition : pikv_hf.distributed.Partition, optional
        Store the shards on several devices / ranks and merge their partial attention (``pikv_hf.distributed``).
    """

    is_sliding = False
    is_compileable = False

    def __init__(
        self,
        layer_idx: int,
        placement: Placement,
        page_size: int,
        shard_groups: int = 1,
        track_stats: bool = False,
        read: ReadConfig | None = None,
        backend: TorchBackend | None = None,
        partition: Partition | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.placement = placement
        self.num_shards = placement.num_shards
        self.page_size = page_size
        self.shard_groups = shard_groups
        self.track_stats = track_stats
        self.backend = backend or TorchBackend()
        self.partition = partition
        self.store: PagedStore | None = None
        self.seen = 0  # tokens seen by this layer, pads included
        self.evicted: torch.Tensor | None = None  # [B, H] tokens evicted per (row, KV head); crop is not eviction
        self.row_start: torch.Tensor | None = None  # [B] position of each row's first real token
        self._last_slot: torch.Tensor | None = None  # [B, H, q] pool slots of the latest update
        self._last_qpos: torch.Tensor | None = None  # [q] positions of the latest update
        self._fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # latest K/V when the store was empty
        self.set_read(read or ReadConfig())

    def set_read(self, read: ReadConfig) -> None:
        """Use these read settings; fresh policy (selector) and statistics."""
        self.read = read
        self.policy = make_policy(read, self.layer_idx)
        self.routing_stats = RoutingStats()

    # ------------------------------------------------------------------ CacheLayerMixin contract
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, dk = key_states.shape
        make_store = PagedStore if self.partition is None else self.partition.store
        self.store = make_store(
            b,
            h,
            dk,
            value_states.shape[-1],
            self.num_shards,
            self.page_size,
            key_states.dtype,
            key_states.device,
            track_stats=self.track_stats,
        )
        self.evicted = torch.zeros(b, h, dtype=torch.int64, device=key_states.device)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _check_update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dim() != 4 or value_states.dim() != 4:
            raise ValueError(
                f"key_states and value_states must be [B, H_kv, q, D]; got {tuple(key_states.shape)} and "
                f"{tuple(value_states.shape)}"
            )
        if key_states.shape[:3] != value_states.shape[:3]:
            raise ValueError(
                f"key_states and value_states must agree on [B, H_kv, q]; got {tuple(key_states.shape[:3])} and "
                f"{tuple(value_states.shape[:3])}"
            )
        if key_states.shape[2] < 1:
            raise ValueError("key_states must hold at least one new token (q >= 1)")
        if key_states.dtype != value_states.dtype:
            raise ValueError(f"key_states dtype {key_states.dtype} != value_states dtype {value_states.dtype}")
        if self.store is None:
            return
        st = self.store
        expected = {
            "batch size": (key_states.shape[0], st.batch),
            "number of KV heads": (key_states.shape[1], st.heads),
            "key head dim": (key_states.shape[3], st.k_dim),
            "value head dim": (value_states.shape[3], st.v_dim),
        }
        for what, (got, want) in expected.items():
            if got != want:
                raise ValueError(f"layer {self.layer_idx}: {what} of key/value_states is {got}, cache holds {want}")
        if key_states.dtype != st.dtype:
            raise ValueError(
                f"layer {self.layer_idx}: key/value_states dtype changed mid-sequence: got {key_states.dtype}, "
                f"cache holds {st.dtype}"
            )
        if key_states.device != st.device:
            raise ValueError(f"layer {self.layer_idx}: key/value_states on {key_states.device}, cache on {st.device}")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: dict[str, Any] | None = None
    ) -> tuple[PagedKV, PagedKV]:
        """Store ``[B, H_kv, q, D]`` post-RoPE keys/values; returns this layer's ``PagedKV`` view twice."""
        self._check_update(key_states, value_states)
        if self.store is None:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        token_index = torch.arange(self.seen, self.seen + q, device=key_states.device)
        ctx = PlacementContext(self.layer_idx, key_states, token_index, self.page_size, self.num_shards)
        shard = self.placement.place(ctx)
        # the first chunk into an empty layer is attended with SDPA over these tensors, then dropped (attend)
        self._fresh_kv = (key_states, value_states) if self.seen == 0 and q > 1 else None
        self._last_slot = self.store.append(key_states, value_states, shard, token_index)
        self._last_qpos = token_index
        self.seen += q
        return PagedKV(self, "keys"), PagedKV(self, "values")

    def attend(
        self,
        query: torch.Tensor,
        scale: float,
        padding: torch.Tensor | None,
        sliding_window: int | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention of the latest update's queries (``[B, Hq, q, Dk]``) over this layer -> ``[B, q, Hq, Dv]``."""
        st = self.store
        q = query.shape[2]
        if self._last_qpos is None or self._last_qpos.numel() != q:
            raise RuntimeError(f"layer {self.layer_idx}: attend() expects the {q} queries of the latest update()")
        fresh, self._fresh_kv = self._fresh_kv, None  # never held past this call
        if padding is not None:
            padding = padding.to(st.device)
            if not bool(padding.all()):
                st.invalidate(self._last_slot, padding[:, -q:])
                self.row_start = padding.to(torch.int8).argmax(-1)  # first real token of each row
        if self.partition is not None:  # shards on several devices / ranks: partials merged there
            return self.partition.attend(self, query, self._last_qpos, scale, sliding_window, sinks)
        if (
            fresh is not None
            and (padding is None or bool(padding[:, -q:].all()))
            and sliding_window is None
            and sinks is None
            and self.shard_groups == 1
            and not self.track_stats
        ):
            # First chunk into an empty layer, no padding: the stored tokens are exactly these, in order, so causal
            # attention over them is the same computation; SDPA's fused causal kernel skips the O(q^2) mask.
            keys, values = fresh
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
            return out.transpose(1, 2)
        if q == 1 and self.read.sparse:
            part = self._attend_sparse(query, scale, sliding_window, sinks)
        else:
            part = self.backend.attend(
                query,
                st,
                ReadPlan(),
                self._last_qpos,
                scale,
                sliding_window,
                sinks,
                self.shard_groups,
                self.track_stats,
            )
            self._record_stats(part, query.shape[1] // st.heads * q)
        return part.o.transpose(1, 2).to(query.dtype)

    def _row_start(self) -> torch.Tensor:
        if self.row_start is None:
            return torch.zeros(self.store.batch, dtype=torch.int64, device=self.store.device)
        return self.row_start.to(torch.int64)

    def _attend_sparse(
        self, query: torch.Tensor, scale: float, sliding_window: int | None, sinks: torch.Tensor | None
    ) -> Partial:
        """One decode step under a routed / Quest read policy, with its read statistics."""
        st, cfg = self.store, self.read
        b, hq, q, dk = query.shape
        h, p = st.heads, st.page_size
        qg = query.reshape(b, h, hq // h * q, dk)
        row_start = self._row_start()
        plan = self.policy.plan(st, qg, scale, int(self._last_qpos[-1]), row_start)
        part = self.backend.attend(
            query, st, plan, self._last_qpos, scale, sliding_window, sinks, want_mass=self.track_stats, count=True
        )
        self._record_stats(part, hq // h * q)
        n_read = st.table.n_pages if plan.exact else (plan.pages >= 0).sum(-1)
        stats = self.routing_stats
        stats.steps += 1
        stats.heads += b * h
        stats.tokens_attended += int(part.attended.sum())
        stats.tokens_stored += int(st.stats.count.sum())
        stats.pages_gathered += int(n_read.sum())
        stats.pages_stored += int(st.table.n_pages.sum())
        stats.slots_gathered += int(n_read.sum()) * p
        learn = self.policy.learns() and stats.steps % cfg.reward_every == 0
        if cfg.measure_recall or learn:
            recall = self._recall(query, scale, sliding_window, sinks, plan, row_start)
            stats.recall_sum += float(recall.sum())
            stats.recall_heads += recall.numel()
            if learn:
                self.policy.feedback(qg, recall)
        return part

    def _recall(
        self,
        query: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        sinks: torch.Tensor | None,
        plan: ReadPlan,
        row_start: torch.Tensor,
    ) -> torch.Tensor:
        """``[B, H]`` fraction of exact attention's probability mass on the tokens ``plan`` lets the query read."""
        st, p = self.store, self.store.page_size
        exact = self.backend.attend(
            query, st, ReadPlan(), self._last_qpos, scale, sliding_window, sinks, want_mass=True
        )
        if plan.exact:
            return torch.ones(st.batch, st.heads, device=st.device)
        b, h, w = st.batch, st.heads, st.table.width()
        full = (plan.pages >= 0) if plan.page_full is None else plan.page_full & (plan.pages >= 0)
        read_full = torch.zeros(b, h, w, dtype=torch.int64, device=st.device)
        read_full.scatter_add_(2, plan.pages.clamp(min=0), full.long())
        kept = (read_full > 0).repeat_interleave(p, dim=-1)
        recent = sink_or_recent(st.frame("pos"), int(self._last_qpos[-1]), plan.n_sink, plan.window, row_start)
        if plan.page_full is not None:
            kept = kept | recent
        mass = exact.mass
        return (mass * kept).sum(-1) / mass.sum(-1).clamp(min=torch.finfo(torch.float32).tiny)

    def _record_stats(self, part: Partial, rows: int) -> None:
        """Accumulate attention mass (summed over the ``rows`` query rows of each KV head); a *hit* is a slot that
        received more than a uniform share of those rows' mass; ``last_access`` is the position of the latest
        query that hit it."""
        if part.mass is None:
            return
        n_valid = self.store.stats.count.sum(-1, keepdim=True).clamp(min=1)  # [B, H, 1]
        hit = part.mass * n_valid > rows
        self.store.add_stats(part.slots.reshape(-1), part.mass.reshape(-1), hit.reshape(-1), int(self._last_qpos[-1]))

    # ------------------------------------------------------------------ eviction and length
    def evict(self, keep: torch.Tensor) -> None:
        """Drop every stored token where ``keep`` (``[B, H_kv, W * P]`` bool over the store's frame, see
        ``PagedStore.frame``) is False.

        Budgets may differ per batch row and KV head; kept tokens are re-packed into as many pages as they need, so
        the bytes are really released. Masking stays exact because it reads each kept slot's own position.
        """
        st = self.store
        if st is None:
            raise RuntimeError(f"layer {self.layer_idx}: evict() before any token was stored")
        if self.partition is not None:
            raise RuntimeError(f"layer {self.layer_idx}: evict() is not supported on a partitioned cache")
        frame = (st.batch, st.heads, st.table.width() * st.page_size)
        if tuple(keep.shape) != frame or keep.dtype != torch.bool:
            raise ValueError(f"keep must be a bool tensor of shape {frame}, got {keep.dtype} {tuple(keep.shape)}")
        dropped = st.frame("valid") & ~keep.to(st.device)
        shard = st.frame("shard").long().clamp(min=0).repeat_interleave(st.page_size, dim=-1)
        per_shard = torch.zeros(st.batch, st.heads, st.num_shards, dtype=torch.int64, device=st.device)
        self.policy.note_evicted(per_shard.scatter_add_(2, shard, dropped.long()))
        self.evicted += st.retain(keep.to(st.device))
        self._last_slot = self._last_qpos = self._fresh_kv = None

    def min_evicted(self) -> int:
        """Fewest tokens evicted from any (row, KV head)."""
        return 0 if self.evicted is None or not self.evicted.numel() else int(self.evicted.min())

    def get_seq_length(self) -> int:
        """Tokens seen by this layer (not tokens stored): what transformers uses for positions."""
        return self.seen

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for the coming update: ``seen + q`` minus the fewest tokens any (row, head) had
        evicted, and that offset. Masking itself is done by the ``pikv`` attention from stored positions."""
        q = cache_position.shape[0]
        dropped = self.min_evicted()
        return self.seen + q - dropped, dropped

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        self.store = None
        self.backend.reset()  # shared with the other layers, which are reset too: frees the gather scratch
        self.is_initialized = False
        self.seen = 0
        self.evicted = self.row_start = None
        self._last_slot = self._last_qpos = self._fresh_kv = None
        self.placement.reset()
        self.policy.reset()

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` positions (negative: drop that many from the end). Only before eviction."""
        self.check_croppable()
        if max_length < 0:
            max_length = self.seen + max_length
        if self.store is None or max_length >= self.seen:
            return
        self.store.retain(self.store.frame("pos") < max_length)
        self.seen = max(max_length, 0)
        self._last_slot = self._last_qpos = self._fresh_kv = None

    def check_croppable(self) -> None:
        """Raise if tokens were evicted (positions being cut may no longer be stored, so crop is undefined) or the
        layer is partitioned."""
        if self.partition is not None and self.store is not None:
            raise RuntimeError(f"layer {self.layer_idx}: crop() is not supported on a partitioned cache")
        if self.evicted is not None and bool((self.evicted > 0).any()):
            raise RuntimeError(
                f"layer {self.layer_idx}: crop() is undefined after {int(self.evicted.max())} tokens were evicted "
                "(the positions being cut may no longer be stored)"
            )

    # ------------------------------------------------------------------ batch ops
    def _index_batch(self, index: torch.Tensor) -> None:
        if self.store is not None:
            index = index.to(self.device)
            self.store.index_batch(index)
            self.placement.index_batch(index)
            self.policy.index_batch(index)
            self.evicted = self.evicted.index_select(0, index)
            self.row_start = None if self.row_start is None else self.row_start.index_select(0, index)
            self._last_slot = self._last_qpos = self._fresh_kv = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._index_batch(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.store is not None:
            self._index_batch(torch.arange(self.store.batch, device=self.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.store is not None:
            idx = torch.arange(self.store.batch, device=self.device)[indices.to(self.device)]
            self._index_batch(idx)

    # ------------------------------------------------------------------ introspection
    def tokens_per_shard(self) -> torch.Tensor:
        """``[B, H_kv, S]`` valid tokens stored per shard (zeros before the first update)."""
        if self.store is None:
            return torch.zeros(0, 0, self.num_shards, dtype=torch.int64)
        return self.store.tokens_per_shard()

    def kv_nbytes(self) -> int:
        return 0 if self.store is None else self.store.kv_nbytes()

    def meta_nbytes(self) -> int:
        return 0 if self.store is None else self.store.meta_nbytes()
