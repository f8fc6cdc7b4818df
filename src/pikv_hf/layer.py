"""``PiKVLayer``: one decoder layer's cache. Per-layer policy lives here; the work is delegated.

``update``: validate -> placement router (token -> shard) -> ``PagedStore.append`` -> ``PagedKV`` view.
``attend``: padding -> read policy (``ReadPlan``) -> attention backend (``(o, lse)``) -> statistics.
``evict`` / ``crop`` / batch operations: ``PagedStore.retain`` / ``index_batch``.
"""

from __future__ import annotations

import tempfile
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import CacheLayerMixin

from pikv_hf.attention import Partial, TorchBackend, allowed_mask, merge_partials, sink_partial
from pikv_hf.checks import calling_press
from pikv_hf.codecs import Codec
from pikv_hf.config import ReadConfig
from pikv_hf.constants import ATTN_IMPLEMENTATION
from pikv_hf.read import ReadPlan, RoutingStats, make_policy, sink_or_recent
from pikv_hf.routing import Placement, PlacementContext
from pikv_hf.store import PagedStore
from pikv_hf.store.group import StoreGroup
from pikv_hf.view import DenseView, dense_view, match_rows, prefix_length


def _is_gather(given: torch.Tensor, index: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether ``new`` is ``given`` gathered at ``index`` (``[B, H, n]``) along the token axis."""
    if new.shape[:3] != index.shape or new.shape[3] != given.shape[3] or new.dtype != given.dtype:
        return False
    return torch.equal(given.gather(2, index.unsqueeze(-1).expand_as(new)), new)


def _same_action(a: tuple, b: tuple) -> bool:
    """Whether two interpreted assignments (``("same",)``, ``("crop", n)``, ``("keep", index)``) agree."""
    if a[0] != b[0]:
        return False
    return a[0] == "same" or (a[1] == b[1] if a[0] == "crop" else torch.equal(a[1], b[1]))


if TYPE_CHECKING:
    from pikv_hf.distributed import Partition


OFFLOAD = "offload"  # the tier evicted tokens move to instead of being dropped (not resident)
OFFLOAD_TARGETS = ("cpu", "disk")  # where the offload tier keeps its pages: CPU memory or memory-mapped files


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
        return torch.Size((st.batch, st.heads, layer.kv_length(), dim))

    def __setitem__(self, index, value) -> None:
        """kvpress's attention patch writes fake keys at ``(batch, head, seq)`` indices of the view a head-wise press
        scored (AdaKV, DuoAttention, ...) so that those tokens get no attention; here they are evicted instead."""
        if self.kind != "keys" or not (isinstance(index, tuple) and len(index) == 3):
            raise TypeError(
                "PiKVCache keeps K/V in pages: only kvpress's (batch, head, seq) key masking can be written to its "
                f"attention inputs, got an assignment to {self.kind}[{index!r}]"
            )
        self.layer.evict_view_entries(*index)


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
    is_sliding : bool
        Whether the model's layer uses sliding-window attention (as ``DynamicCache(config)`` reports it).
    max_cache_len : int, optional
        Reserve pages for this many tokens per (row, head) at the first update and never move them afterwards: a
        decode step then has no host synchronisation on the exact path, so ``torch.compile`` captures it in one
        graph (``is_compileable``). Appending past the reservation is not checked in that mode.
    attention_module : torch.nn.Module, optional
        The model's attention module of this layer (weakly referenced): head-wise kvpress presses leave their key
        masks on it (``masked_key_indices``), which the layer turns into evictions.
    partition : pikv_hf.distributed.Partition, optional
        Store the shards on several devices / ranks and merge their partial attention (``pikv_hf.distributed``).

    Notes
    -----
    ``keys`` / ``values`` read as a position-ordered copy of the stored tokens (:mod:`pikv_hf.view`), taken once per
    write of the layer; assigning to them drops tokens (a gather of the view's rows) or crops positions (a prefix
    slice of the view), as kvpress presses and kvpress's pipeline do on a ``DynamicCache``.
    """

    def __init__(
        self,
        layer_idx: int,
        placement: Placement,
        page_size: int,
        shard_groups: int = 1,
        track_stats: bool = False,
        read: ReadConfig | None = None,
        backend: TorchBackend | None = None,
        is_sliding: bool = False,
        attention_module: torch.nn.Module | None = None,
        max_cache_len: int | None = None,
        partition: Partition | None = None,
    ) -> None:
        self.store: PagedStore | None = None
        self._view: DenseView | None = None  # the latest dense view; its tensors are dropped on every write
        self._pending: dict[str, tuple] = {}  # assignments to keys / values waiting for their partner
        super().__init__()  # sets keys / values to None: ignored by the setters while nothing is stored
        self.is_sliding = is_sliding
        self.max_cache_len = max_cache_len
        self.is_compileable = max_cache_len is not None
        self._module = None if attention_module is None else weakref.ref(attention_module)
        self.layer_idx = layer_idx
        self.placement = placement
        self.num_shards = placement.num_shards
        self.page_size = page_size
        self.shard_groups = shard_groups
        self.track_stats = track_stats
        self.backend = backend or TorchBackend()
        self._seen = 0  # tokens seen by this layer, pads included (a tensor, _seen_t, in compileable mode)
        self._seen_t: torch.Tensor | None = None
        self.partition = partition
        self.tiers: dict[str, PagedStore] = {}  # cold tiers (offloaded, compressed tokens): every token in one store
        self.evicted: torch.Tensor | None = None  # [B, H] tokens evicted per (row, KV head); crop is not eviction
        self._min_evicted = 0  # evicted.min(), kept as a Python int so that mask sizes need no device sync
        self.row_start: torch.Tensor | None = None  # [B] position of each row's first real token
        self._last_qpos: torch.Tensor | None = None  # [q] positions of the latest update
        self._fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # latest K/V when the store was empty
        self.set_read(read or ReadConfig())

    def set_read(self, read: ReadConfig) -> None:
        """Use these read settings; fresh policy (selector) and statistics."""
        self.read = read
        self.policy = make_policy(read, self.layer_idx)
        self.routing_stats = RoutingStats()

    @property
    def seen(self) -> int:
        """Tokens seen by this layer, pads included."""
        return self._seen if self._seen_t is None else int(self._seen_t)

    @seen.setter
    def seen(self, value: int) -> None:
        if self._seen_t is None:
            self._seen = value
        else:
            self._seen_t.fill_(value)

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
        if self.max_cache_len is not None:
            self._seen_t = torch.zeros((), dtype=torch.int64, device=key_states.device)
            self.store.reserve(-(-self.max_cache_len // self.page_size) + self.num_shards)  # + a partial page/shard
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
        self._flush_pending()
        self.prefetch()
        self._check_update(key_states, value_states)
        if self.store is None:
            self.lazy_initialization(key_states, value_states)
        self._touch()
        q = key_states.shape[2]
        static = self._seen_t is not None
        offsets = torch.arange(q, device=key_states.device)
        token_index = self._seen_t + offsets if static else offsets + self._seen
        ctx = PlacementContext(self.layer_idx, key_states, token_index, self.page_size, self.num_shards)
        shard = self.placement.place(ctx)
        # the first chunk into an empty layer is attended with SDPA over these tensors, then dropped (attend)
        self._fresh_kv = (key_states, value_states) if q > 1 and self.seen == 0 else None
        self.store.append(key_states, value_states, shard, token_index, grow=not static)
        self._last_qpos = token_index
        if static:
            self._seen_t += q
        else:
            self._seen += q
        module = None if self._module is None else self._module()
        if (
            module is not None
            and getattr(module.config, "_attn_implementation", ATTN_IMPLEMENTATION) != ATTN_IMPLEMENTATION
        ):
            # the model runs another attention (e.g. a press switched it to eager): it needs tensors, and builds its
            # own mask for a contiguous cache of kv_length tokens
            self._fresh_kv = None
            v = self.view()
            return v.keys, v.values
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
        self.prefetch()
        st = self.store
        q = query.shape[2]
        if self._last_qpos is None or self._last_qpos.numel() != q:
            raise RuntimeError(f"layer {self.layer_idx}: attend() expects the {q} queries of the latest update()")
        fresh, self._fresh_kv = self._fresh_kv, None  # never held past this call
        padded = False
        if padding is not None and q > 1:  # a decode token is never padding (generate masks only earlier tokens)
            padding = padding.to(st.device)
            if not bool(padding.all()):
                st.invalidate(int(self._last_qpos[0]), padding[:, -q:])
                self.row_start = padding.to(torch.int8).argmax(-1)  # first real token of each row
                padded = not bool(padding[:, -q:].all())
        if self.partition is not None:  # shards on several devices / ranks: partials merged there
            return self.partition.attend(self, query, self._last_qpos, scale, sliding_window, sinks)
        if (
            fresh is not None
            and not padded
            and sliding_window is None
            and sinks is None
            and self.shard_groups == 1
            and not self.track_stats
            and not self.tiers
        ):
            # First chunk into an empty layer, no padding: the stored tokens are exactly these, in order, so causal
            # attention over them is the same computation; SDPA's fused causal kernel skips the O(q^2) mask.
            keys, values = fresh
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
            return out.transpose(1, 2)
        if q == 1 and self.read.sparse:
            part = self._attend_sparse(query, scale, sliding_window, sinks)
        else:
            part = self._read(query, [ReadPlan()] * (1 + len(self.tiers)), scale, sliding_window, sinks)
            self._record_stats(part, query.shape[1] // st.heads * q)
        return part.o.transpose(1, 2).to(query.dtype)

    def stores(self) -> list[PagedStore]:
        """The hot store (where new tokens arrive), then the cold tiers."""
        return [self.store, *self.tiers.values()]

    def _read(
        self,
        query: torch.Tensor,
        plans: list[ReadPlan],
        scale: float,
        sliding_window: int | None,
        sinks: torch.Tensor | None,
        count: bool = False,
    ) -> Partial:
        """One partial per store and plan, merged exactly; with ``track_stats`` the hot store's slot masses (over
        the hot store's own partial when tiers exist: a tier's tokens are not tracked while they sit there)."""
        if not self.tiers:
            return self.backend.attend(
                query, self.store, plans[0], self._last_qpos, scale, sliding_window, sinks, self.shard_groups,
                self.track_stats, count,
            )  # fmt: skip
        d = self.store.device
        parts = [
            self.backend.attend(
                query.to(s.device),
                s,
                plan,
                self._last_qpos.to(s.device),
                scale,
                sliding_window,
                None,
                self.shard_groups,
                self.track_stats and s is self.store,
                count,
            )  # fmt: skip
            for s, plan in zip(self.stores(), plans, strict=True)
        ]
        o, lse = merge_partials([(p.o.to(d), p.lse.to(d)) for p in parts])
        if sinks is not None:
            o, lse = merge_partials([(o, lse), sink_partial(sinks, o)])
        attended = sum(p.attended.to(d) for p in parts) if count else None
        return Partial(o, lse, parts[0].mass, parts[0].slots, attended)

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
        offloaded = (self.tiers[OFFLOAD],) if OFFLOAD in self.tiers else ()
        plans = self.policy.plans(StoreGroup(self.stores(), offloaded), qg, scale, int(self._last_qpos[-1]), row_start)
        plan = plans[0]
        part = self._read(query, plans, scale, sliding_window, sinks, count=True)
        self._record_stats(part, hq // h * q)
        stats = self.routing_stats
        stats.steps += 1
        stats.heads += b * h
        stats.tokens_attended += int(part.attended.sum())
        for store, read in zip(self.stores(), plans, strict=True):
            n_read = int((store.table.n_pages if read.exact else (read.pages >= 0).sum(-1)).sum())
            stats.tokens_stored += int(store.stats.count.sum())
            stats.pages_gathered += n_read
            stats.pages_stored += int(store.table.n_pages.sum())
            stats.slots_gathered += n_read * p
            if store in offloaded:  # pages brought back from the offload tier
                stats.bytes_fetched += n_read * store.pool.nbytes(store.kv_fields) // max(1, store.pool.num_pages)
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
        if self.tiers:
            raise RuntimeError(
                f"layer {self.layer_idx}: recall (measure_recall, learning selectors) is measured on the hot store "
                "only, and this layer holds tokens in tiers"
            )
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

    # ------------------------------------------------------------------ dense views (kvpress, DynamicCache code)
    def _touch(self) -> None:
        """Mark a write: the dense view taken before it no longer describes the store (its small index tensors are
        kept: kvpress's later key masks refer to them)."""
        v = self._view
        if v is not None and v.keys is not None:
            self._view = DenseView(None, None, v.frame_index, v.pos, v.valid)

    def view(self) -> DenseView | None:
        """The position-ordered copy of the stored tokens (taken once per write; None before the first update)."""
        if self.store is None:
            return None
        if self.partition is not None:
            raise RuntimeError(
                f"layer {self.layer_idx}: this layer keeps tokens in partitions on other devices or ranks, so it has "
                "no dense keys / values view"
            )
        self._flush_pending()
        return self._snapshot()

    def frame_mask(self, index: torch.Tensor, mark: torch.Tensor) -> torch.Tensor:
        """``[B, H, W * P]`` bool over the hot store's frame: True at the valid slots ``index`` (``[B, H, n]``, frame
        indices, ``-1`` for none) where ``mark`` holds (entries of ``index`` may repeat: any True wins)."""
        st = self.store
        hits = torch.zeros(st.batch, st.heads, st.table.width() * st.page_size, dtype=torch.int32, device=st.device)
        hits.scatter_add_(2, index.clamp(min=0), (mark & (index >= 0)).to(torch.int32))
        return (hits > 0) & st.frame("valid")

    def view_index(self) -> DenseView:
        """The hot store's dense view index tensors alone (``frame_index``, ``pos``, ``valid``; keys and values
        None): what a press needs to turn view scores into a keep mask, without copying the keys and values."""
        v = self._view
        if v is not None and v.keys is not None and not self.tiers:
            return v
        return dense_view(self.store, with_kv=False)

    def view_field(self, name: str, view: DenseView | None = None) -> torch.Tensor:
        """A slot field of the hot store (e.g. ``attn_mass``) in the order of the dense view (``[B, H, T]``; padding
        entries read slot 0's value and must be masked by the caller with ``view.pos >= 0``)."""
        v = view or self.view_index()
        return self.store.frame(name).gather(2, v.frame_index.clamp(min=0))

    def _snapshot(self) -> DenseView:
        v = self._view
        if v is None or v.keys is None:
            self._view = v = dense_view(*self.stores())
        return v

    @property
    def keys(self) -> torch.Tensor | None:
        """``[B, H, T, Dk]`` stored keys of every (row, head) in position order (a copy; see the class notes)."""
        v = self.view()
        return None if v is None else v.keys

    @keys.setter
    def keys(self, new: torch.Tensor | None) -> None:
        self._assign("keys", new)

    @property
    def values(self) -> torch.Tensor | None:
        """``[B, H, T, Dv]`` stored values in the order of :attr:`keys` (a copy)."""
        v = self.view()
        return None if v is None else v.values

    @values.setter
    def values(self, new: torch.Tensor | None) -> None:
        self._assign("values", new)

    def _assign(self, kind: str, new: torch.Tensor | None) -> None:
        """Interpret an assignment to ``keys`` / ``values`` (see :mod:`pikv_hf.view`); applied once its partner
        arrives (or at the next access), after both were checked, so a rejected pair changes nothing."""
        if self.store is None:
            if new is None:
                return
            raise ValueError(f"layer {self.layer_idx}: cannot assign {kind} to an empty PiKVCache layer (use update)")
        if new is None:
            raise ValueError(f"layer {self.layer_idx}: {kind} cannot be set to None; use reset() to empty the layer")
        v = self._snapshot()  # the view the partner assignment (if pending) refers to
        given = v.keys if kind == "keys" else v.values
        other = "values" if kind == "keys" else "keys"
        partner = self._pending.pop(other, None)
        if new is given:
            action: tuple = ("same",)
        elif (n := prefix_length(new, given)) is not None:
            action = ("crop", n)
        elif partner is not None and partner[0] == "keep" and _is_gather(given, partner[1], new):
            action = partner  # values repeat rows (no position in them): check them against the keys' selection
        else:
            index = match_rows(given, new)
            if index is None:
                raise ValueError(
                    f"{calling_press()}: the {kind} assigned to layer {self.layer_idx} are not a selection of the "
                    f"cached {kind} (shape {tuple(new.shape)}, cached {tuple(given.shape)}): the press rewrites them "
                    "(e.g. re-rotated, merged or quantised), and a PiKVCache stores each token's own key, value and "
                    "position, so it can only drop tokens; run this press on a DynamicCache"
                )
            action = ("keep", index)
        if partner is None:
            self._pending[kind] = action
            return
        if not _same_action(partner, action):
            raise ValueError(
                f"{calling_press()}: layer {self.layer_idx} was given keys and values that select different tokens"
            )
        self._apply(action)

    def _flush_pending(self) -> None:
        """Apply an assignment whose partner never came (only keys, or only values, were set)."""
        if self._pending:
            (action,) = self._pending.values()
            self._pending.clear()
            self._apply(action)

    def _apply(self, action: tuple) -> None:
        v = self._view
        if action[0] == "crop":
            self.crop(action[1])
        elif action[0] == "keep":
            if self.tiers:
                raise ValueError(
                    f"{calling_press()}: layer {self.layer_idx} holds tokens in tiers ({', '.join(self.tiers)}); a "
                    "selection of its view can only crop positions there: run eviction presses before compression"
                )
            index = v.frame_index.gather(2, action[1])
            self.evict(self.frame_mask(index, index >= 0))
        module = None if self._module is None else self._module()
        masked = getattr(module, "masked_key_indices", None)
        if masked is not None:  # a head-wise press (AdaKV, DuoAttention, ...) marked tokens in the view it scored
            self.evict_view_entries(*masked, view=v)
            module.masked_key_indices = None

    def attention_weights(
        self, query: torch.Tensor, scale: float, sliding_window: int | None, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        """``[B, Hq, q, T]`` attention probabilities of the latest update's queries over the entries of :meth:`view`
        (what an eager attention returns over a ``DynamicCache``), computed only when a caller asks for them."""
        v = self.view()
        b, hq, q, dk = query.shape
        h = v.keys.shape[1]
        qg = query.reshape(b, h, hq // h * q, dk).to(v.keys.dtype)
        logits = (qg @ v.keys.transpose(-1, -2)).float().mul_(scale).view(b, h, hq // h, q, -1)
        allowed = allowed_mask(v.valid, v.pos, self._last_qpos, sliding_window).unsqueeze(2)
        logits = logits.masked_fill(~allowed, float("-inf")).view(b, hq, q, -1)
        lse = logits.logsumexp(-1, keepdim=True)
        if sinks is not None:
            lse = torch.logaddexp(lse, sinks.float().view(1, hq, 1, 1))
        return torch.exp(logits - lse).to(query.dtype)

    def evict_view_entries(
        self, batch: torch.Tensor, head: torch.Tensor, index: torch.Tensor, view: DenseView | None = None
    ) -> None:
        """Evict the tokens at entries ``(batch[i], head[i], index[i])`` of a dense view (default: the latest taken),
        e.g. the keys a head-wise kvpress press masks. Tokens already gone are skipped."""
        v = view or self._view
        if v is None:
            raise RuntimeError(f"layer {self.layer_idx}: no dense view was taken, so view entries name no token")
        st = self.store
        pos = v.pos[batch.to(v.pos.device), head.to(v.pos.device), index.to(v.pos.device)]
        drop = torch.zeros(st.batch, st.heads, self.seen, dtype=torch.bool, device=st.device)
        drop[batch.to(st.device), head.to(st.device), pos.clamp(min=0).to(st.device)] = pos.to(st.device) >= 0
        frame_pos = st.frame("pos").to(torch.int64)
        hit = drop.gather(2, frame_pos.clamp(0, max(self.seen - 1, 0))) & (frame_pos >= 0)
        if bool(hit.any()):
            self.evict(st.frame("valid") & ~hit)

    def offload(self) -> None:
        """Move this layer's pages to the CPU (``Cache(offloading=True)`` calls it after the layer's update)."""
        if self.store is not None:
            self.store.to(torch.device("cpu"))

    def prefetch(self) -> None:
        """Move this layer's pages back to its device (called ahead of the layer; ``update`` / ``attend`` also do)."""
        if self.store is not None and self.store.device != self.device:
            self.store.to(self.device)

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
        self._check_keep(keep)
        dropped = st.frame("valid") & ~keep.to(st.device)
        shard = st.frame("shard").long().clamp(min=0).repeat_interleave(st.page_size, dim=-1)
        per_shard = torch.zeros(st.batch, st.heads, st.num_shards, dtype=torch.int64, device=st.device)
        self.policy.note_evicted(per_shard.scatter_add_(2, shard, dropped.long()))
        self._touch()
        self.evicted += st.retain(keep.to(st.device))
        self._min_evicted = int(self.evicted.min())
        self._fresh_kv = None

    def tier(
        self,
        name: str,
        codec: Codec | None = None,
        device: torch.device | str | None = None,
        storage: str | None = None,
        page_size: int | None = None,
    ) -> PagedStore:
        """The cold tier ``name``, created on first use as an empty store like the hot one, with ``codec`` (default
        identity) on ``device`` (default the layer's), in ``storage`` (see ``PagePool``), with pages of ``page_size``
        tokens (default the hot store's; a quantised tier's page is its group of tokens)."""
        if name not in self.tiers:
            st = self.store
            if st is None:
                raise RuntimeError(f"layer {self.layer_idx}: a tier is made after the first update")
            self.tiers[name] = PagedStore(
                st.batch, st.heads, st.k_dim, st.v_dim, st.num_shards, page_size or st.page_size, st.dtype,
                torch.device(device) if device is not None else st.device, codec=codec, storage=storage,
            )  # fmt: skip
        return self.tiers[name]

    def move_to_tier(self, name: str, keep: torch.Tensor) -> torch.Tensor:
        """Move the hot store's valid tokens where ``keep`` (``[B, H, W * P]`` over its frame) is False to the tier
        ``name`` (see :meth:`tier`), with their shard and position; returns ``[B, H]`` tokens moved. Nothing is
        evicted: attention still reads them, from the tier. Their per-slot statistics start over there."""
        st = self.store
        self._check_keep(keep)
        tier = self.tier(name)
        move = st.frame("valid") & ~keep.to(st.device)
        n = move.sum(-1)
        if not bool(n.any()):
            return n
        pos = st.frame("pos").to(torch.int64)
        order = torch.where(move, pos, torch.iinfo(torch.int64).max).argsort(dim=-1, stable=True)[..., : int(n.max())]
        present = torch.arange(order.shape[-1], device=st.device) < n.unsqueeze(-1)
        keys, values = st.frame_kv()
        take = lambda t: t.gather(2, order.unsqueeze(-1).expand(*order.shape, t.shape[-1]))  # noqa: E731
        shard = st.frame("shard").long().repeat_interleave(st.page_size, dim=-1).gather(2, order).clamp(min=0)
        d = tier.device
        tier.append(take(keys).to(d), take(values).to(d), shard.to(d), pos.gather(2, order).to(d), present.to(d))
        self._touch()
        st.retain(keep.to(st.device) | ~st.frame("valid"))
        return n

    def _check_keep(self, keep: torch.Tensor) -> None:
        """Raise ``ValueError`` unless ``keep`` is a bool mask over the hot store's frame."""
        st = self.store
        frame = (st.batch, st.heads, st.table.width() * st.page_size)
        if tuple(keep.shape) != frame or keep.dtype != torch.bool:
            raise ValueError(f"keep must be a bool tensor of shape {frame}, got {keep.dtype} {tuple(keep.shape)}")

    def offload_tokens(self, keep: torch.Tensor, target: str = "cpu") -> torch.Tensor:
        """Move the hot store's tokens outside ``keep`` to the offload tier: CPU memory (``"cpu"``, pinned when the
        layer is on a GPU) or memory-mapped files in a temporary directory (``"disk"``). Returns ``[B, H]`` moved."""
        if target not in OFFLOAD_TARGETS:
            raise ValueError(f"target must be one of {', '.join(OFFLOAD_TARGETS)}, got {target!r}")
        self._check_keep(keep)
        if OFFLOAD not in self.tiers:
            if target == "disk":
                storage = tempfile.mkdtemp(prefix="pikv-offload-")
            else:
                storage = "pinned" if self.store.device.type == "cuda" else None
            self.tier(OFFLOAD, device="cpu", storage=storage)
        return self.move_to_tier(OFFLOAD, keep)

    def min_evicted(self) -> int:
        """Fewest tokens evicted from any (row, KV head)."""
        return self._min_evicted

    def get_seq_length(self) -> int:
        """Tokens seen by this layer (not tokens stored): what transformers uses for positions."""
        return self.seen

    def kv_length(self) -> int:
        """Tokens seen minus the fewest evicted from any (row, head); the reserved frame in compileable mode."""
        if self._seen_t is not None:
            return self.store.table.width() * self.page_size
        return self._seen - self._min_evicted

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for the coming update: ``seen + q`` minus the fewest tokens any (row, head) had
        evicted, and that offset. Masking itself is done by the ``pikv`` attention from stored positions."""
        if self._seen_t is not None:  # compileable: the reserved frame, as StaticCache reports its max length
            return self.store.table.width() * self.page_size, 0
        q = cache_position.shape[0]
        return self._seen + q - self._min_evicted, self._min_evicted

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        self.store = None
        self.tiers = {}
        self.backend.reset()  # shared with the other layers, which are reset too: frees the gather scratch
        self.is_initialized = False
        self._seen, self._seen_t, self._min_evicted = 0, None, 0
        self.evicted = self.row_start = None
        self._last_qpos = self._fresh_kv = None
        self._touch()
        self.placement.reset()
        self.policy.reset()

    def crop(self, max_length: int) -> None:
        """Keep the positions below ``max_length`` (negative: drop that many from the end).

        After an eviction this is still well defined: the tokens at cut positions that are stored are dropped, and
        the eviction counts keep only the evictions below ``max_length`` (padding is assumed to sit at the start of
        a row, as in left-padded batches).
        """
        if max_length < 0:
            max_length = self.seen + max_length
        if self.store is None or max_length >= self.seen:
            return
        if self.partition is not None:
            raise RuntimeError(f"layer {self.layer_idx}: crop() is not supported on a partitioned cache")
        max_length = max(max_length, 0)
        self._touch()
        removed = self.store.retain(self.store.frame("pos") < max_length)
        for tier in self.tiers.values():
            removed += tier.retain(tier.frame("pos") < max_length).to(removed.device)
        self.evicted -= (self.seen - max_length) - removed  # cut positions that were evicted, not stored
        self._min_evicted = int(self.evicted.min())
        self.seen = max_length
        self._last_qpos = self._fresh_kv = None

    # ------------------------------------------------------------------ batch ops
    def _index_batch(self, index: torch.Tensor) -> None:
        self._flush_pending()
        if self.store is not None:
            index = index.to(self.device)
            self._touch()
            self.store.index_batch(index)
            for tier in self.tiers.values():
                tier.index_batch(index.to(tier.device))
            self.placement.index_batch(index)
            self.policy.index_batch(index)
            self.evicted = self.evicted.index_select(0, index)
            self._min_evicted = int(self.evicted.min())
            self.row_start = None if self.row_start is None else self.row_start.index_select(0, index)
            self._last_qpos = self._fresh_kv = None
            self._touch()

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
        """``[B, H_kv, S]`` valid tokens stored per shard, over the hot store and its tiers (zeros before the first
        update)."""
        if self.store is None:
            return torch.zeros(0, 0, self.num_shards, dtype=torch.int64)
        if self.partition is not None:
            return self.store.tokens_per_shard()
        return StoreGroup(self.stores()).tokens_per_shard()

    def resident_tokens(self) -> torch.Tensor:
        """``[B, H_kv]`` tokens held per row and KV head in the hot store and every tier but the offload tier."""
        if self.store is None:
            return torch.zeros(0, 0, dtype=torch.int64)
        return sum(s.tokens_per_shard().sum(-1) for name, s in self._named_stores() if name != OFFLOAD)

    def kv_nbytes(self) -> int:
        """Key/value bytes allocated for the resident tokens: the hot store and every tier but the offload tier."""
        if self.store is None:
            return 0
        return sum(s.kv_nbytes() for name, s in self._named_stores() if name != OFFLOAD)

    def offloaded_nbytes(self) -> int:
        """Key/value bytes of the offload tier (CPU memory or memory-mapped files)."""
        return self.tiers[OFFLOAD].kv_nbytes() if OFFLOAD in self.tiers else 0

    def meta_nbytes(self) -> int:
        return 0 if self.store is None else sum(s.meta_nbytes() for s in [self.store, *self.tiers.values()])

    def _named_stores(self) -> list[tuple[str, PagedStore]]:
        return [("hot", self.store), *self.tiers.items()]
