"""``PiKVLayer``: one decoder layer's cache, the ``CacheLayerMixin`` contract and the small API presses act through.

``update``: checks -> placement router (token -> shard) -> ``PagedStore.append`` (padding takes no slot) -> a
``PagedKV`` handle for the ``"pikv"`` attention (tensors for anyone else). ``attend``: ``DecodeStep`` (``step.py``).
What presses do to a layer is ``edits.py`` (mixed in), the dense views kvpress reads and writes ``view.py``, the
stores and tiers ``store/tiers.py``. Modes are layer classes: ``StaticPiKVLayer`` (``static_layer.py``, reserved
pages for ``torch.compile``) and ``PartitionedLayer`` (``distributed/layer.py``, shards on several devices or
ranks).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import CacheLayerMixin

from pikv_hf.attention import TorchBackend
from pikv_hf.checks import check_int_at_least, check_kv_update, check_rows, check_tensor
from pikv_hf.config import ReadConfig
from pikv_hf.constants import ATTN_IMPLEMENTATION
from pikv_hf.edits import LayerEdits
from pikv_hf.forward import ForwardState, PagedKV
from pikv_hf.read import make_policy
from pikv_hf.routing import Placement, PlacementContext
from pikv_hf.step import DecodeStep, Query
from pikv_hf.store import PagedStore
from pikv_hf.store.tiers import OFFLOAD, LayerStores
from pikv_hf.view import LayerViews


class PiKVLayer(LayerEdits, CacheLayerMixin):
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
    sliding_window : int, optional
        The window of a sliding layer (the config's ``sliding_window``): attention applies it when the model does not
        pass one to the attention function (Qwen2-MoE and PhiMoE apply theirs through the mask alone, which a PiKV
        forward does not build).
    attention_module : torch.nn.Module, optional
        The model's attention module of this layer (weakly referenced): head-wise kvpress presses leave their key
        masks on it (``masked_key_indices``), which the layer turns into evictions.
    forward : ForwardState, optional
        Shared with the cache, which fills it at the start of every model forward.

    Notes
    -----
    Presses act through the API of :class:`pikv_hf.edits.LayerEdits`; assigning to ``keys`` / ``values`` as kvpress
    does is interpreted by :class:`pikv_hf.view.LayerViews`.
    """

    is_compileable = False
    max_cache_len: int | None = None
    has_view = True  # a dense position-ordered view of the stored tokens exists (not for partitions)

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
        sliding_window: int | None = None,
        attention_module: torch.nn.Module | None = None,
        forward: ForwardState | None = None,
    ) -> None:
        self.store: PagedStore | None = None  # the hot store, where new tokens arrive
        self.stores: LayerStores | None = None
        self.views = LayerViews(self)
        super().__init__()  # sets keys / values to None: ignored by the setters while nothing is stored
        self.is_sliding = is_sliding
        self.sliding_window = sliding_window if is_sliding else None
        self._module = None if attention_module is None else weakref.ref(attention_module)
        self.layer_idx = layer_idx
        self.placement = placement
        self.num_shards = placement.num_shards
        self.page_size = page_size
        self.shard_groups = shard_groups
        self.track_stats = track_stats
        self.backend = backend or TorchBackend()
        self.forward = forward or ForwardState()
        self._seen = 0  # tokens seen by this layer, pads included
        self.evicted: torch.Tensor | None = None  # [B, H] tokens evicted per (row, KV head); crop is not eviction
        self._min_evicted = 0  # evicted.min(), kept as a Python int so that mask sizes need no device sync
        self.row_start: torch.Tensor | None = None  # [B] position of each row's first real token
        self._start_bounds = (0, 0)  # (min, max) of row_start over rows with a real token, as Python ints
        self._last_qpos: torch.Tensor | None = None  # [q] positions of the latest update (during its forward)
        self._last_q = 0  # its token count (kept after the forward)
        self._fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # latest K/V when the store was empty
        self._index_pos: torch.Tensor | None = None  # [B, H, n] positions of kvpress's head-mask index space
        self._masks_applied: tuple | None = None  # the head masks evicted last (kvpress repeats them every step)
        self.set_read(read or ReadConfig())

    def set_read(self, read: ReadConfig) -> None:
        """Use these read settings; fresh policy (selector) and statistics."""
        self.read = read
        self.policy = make_policy(read, self.layer_idx)
        self.step = DecodeStep(self.policy, self.backend, self.shard_groups)
        if self._summaries_up_front() and self.stores is not None:
            self.stores.keep_summaries()

    def _summaries_up_front(self) -> bool:
        """Whether the stores keep shard summaries from the start. A routed read computes them from the pages at its
        first sparse step (dense steps below ``sparse_from`` then pay nothing for them); a compiled step cannot."""
        return self.policy.reads_summaries and self.is_compileable

    @property
    def read_stats(self):
        """This layer's ``ReadStats`` (decode reads; numbers through ``PiKVCache.routing_stats()``)."""
        return self.step.stats

    @property
    def tiers(self) -> dict[str, PagedStore]:
        return {} if self.stores is None else self.stores.tiers

    @property
    def seen(self) -> int:
        """Tokens seen by this layer, pads included."""
        return self._seen

    @property
    def last_positions(self) -> torch.Tensor | None:
        """``[q]`` positions of the tokens of the latest update (after its forward ended, when the layer no longer
        holds them, made again from the count: an update's positions are the ``q`` after those seen before it)."""
        if self._last_qpos is None and self._last_q and self.store is not None:
            return torch.arange(self.seen - self._last_q, self.seen, device=self.store.device)
        return self._last_qpos

    @property
    def max_batch_size(self) -> int | None:
        """Batch rows held (``StaticLayer``'s attribute; None before the first update)."""
        return None if self.store is None else self.store.batch

    def attention_module(self) -> torch.nn.Module | None:
        return None if self._module is None else self._module()

    # ------------------------------------------------------------------ CacheLayerMixin contract
    def _new_store(self, key_states: torch.Tensor, value_states: torch.Tensor) -> PagedStore:
        b, h, _, dk = key_states.shape
        return PagedStore(
            b, h, dk, value_states.shape[-1], self.num_shards, self.page_size, key_states.dtype, key_states.device,
            track_stats=self.track_stats,
        )  # fmt: skip

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.store = self._new_store(key_states, value_states)
        self.stores = LayerStores(self.store)
        if self._summaries_up_front():
            self.stores.keep_summaries()
        b, h = key_states.shape[:2]
        self.evicted = torch.zeros(b, h, dtype=torch.int64, device=key_states.device)
        self.row_start = torch.zeros(b, dtype=torch.int64, device=key_states.device)
        self._row_open = torch.ones(b, dtype=torch.bool, device=key_states.device)  # no real token stored yet
        self._rows_open, self._padded = True, False  # host flags: some row still open / left padding seen
        self._start_bounds = (0, 0)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _token_index(self, q: int, device: torch.device) -> torch.Tensor:
        """``[q]`` ordinals (positions) of the next ``q`` tokens (one tensor for the layers of a forward)."""
        return self.forward.token_positions(self._seen, q, device)

    def _advance(self, q: int) -> None:
        self._seen += q

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: dict[str, Any] | None = None
    ) -> tuple[PagedKV, PagedKV] | tuple[torch.Tensor, torch.Tensor]:
        """Store ``[B, H_kv, q, D]`` post-RoPE keys/values. Inside a forward that runs the ``"pikv"`` attention it
        returns this layer's ``PagedKV`` handle twice; otherwise the dense keys and values, as ``DynamicCache``."""
        dtype = check_kv_update(self.layer_idx, key_states, value_states, self.forward.present, self.store)
        if key_states.dtype != value_states.dtype:  # autocast: one pool dtype, the wider
            key_states, value_states = key_states.to(dtype), value_states.to(dtype)
        pikv = self._read_by_pikv()
        if self.forward.active and not pikv:
            self._check_dense_readable()  # before anything is stored
        self.views.flush()
        self.prefetch()
        self._store(key_states, value_states, self.forward.present)
        if pikv:
            return PagedKV(self, "keys"), PagedKV(self, "values")
        self._fresh_kv = None
        if not self.forward.active:  # a direct call: the stored tokens in position order, as `keys` / `values` read
            v = self.view()
            return v.keys, v.values
        return self.dense_kv()

    def _read_by_pikv(self) -> bool:
        """Whether the attention about to read this layer is the ``"pikv"`` one: inside a forward of a model that runs
        it (checked on the layer's attention module when the cache knows it: a press may switch the model's
        implementation in the middle of a forward, as kvpress's KVComposePress does)."""
        module = self.attention_module()
        if module is None or not self.forward.active:
            return self.forward.pikv
        return getattr(module.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION

    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor, present: torch.Tensor | None) -> None:
        """Place and append new tokens (``present``: ``[B, q]``, False for padding, which takes no slot)."""
        q = key_states.shape[2]
        self._check_capacity(q)  # before the first tokens set the layer up for their batch
        if self.store is None:
            self.lazy_initialization(key_states, value_states)
        self.views.touch()
        token_index = self._token_index(q, key_states.device)
        self._note_rows(present, token_index)
        row_start = self.row_start if self._padded else None
        decode = q == 1 and present is None and isinstance(self.store, PagedStore)
        if decode and self.placement.placed_by_append:
            shard = None  # placed by the append operator itself
        else:
            ctx = PlacementContext(
                self.layer_idx, key_states, token_index, self.page_size, self.num_shards, present, row_start
            )
            shard = self.placement.place(ctx)
        # the first chunk into an empty layer (no padding) is attended with SDPA over these tensors, then dropped
        self._fresh_kv = (key_states, value_states) if q > 1 and self.seen == 0 and present is None else None
        if decode:  # one token per (row, head): one operator (pikv_hf.kernels.append)
            grow, position = not self.is_compileable, None if row_start is not None else self._seen
            self.store.append_one(key_states, value_states, shard, token_index, row_start, grow, position)
        else:
            slots_of = None if present is None else present.unsqueeze(1).expand_as(shard)
            self.store.append(
                key_states, value_states, shard, token_index, slots_of, not self.is_compileable, self.row_start
            )
        self._last_qpos, self._last_q = token_index, q
        self._advance(q)
        if q > 1 and self.policy.sparse:
            self.policy.prepare(self._group(), self.row_start)
        if q > 1 and self.is_compileable:  # counters a compiled decode step adds to exist before it is traced
            self.step.stats.prepare(key_states.shape[0] * key_states.shape[1], self.store.device)
        if self._index_pos is not None:  # head masks in use: their index space grows with the new tokens
            grown = token_index.to(self._index_pos).expand(*key_states.shape[:3])
            self._index_pos = torch.cat([self._index_pos, grown], -1)

    def _check_capacity(self, q: int) -> None:
        """Raise before storing ``q`` more tokens than the layer may hold (reserved caches)."""

    def _note_rows(self, present: torch.Tensor | None, token_index: torch.Tensor) -> None:
        """Record the position of each row's first real token (left padding: a row whose first tokens are pads)."""
        if present is None and not self._rows_open:
            return
        if present is None:
            first, real = token_index[0].expand_as(self.row_start), torch.ones_like(self._row_open)
        else:
            first, real = token_index[0] + present.to(torch.int8).argmax(-1), present.any(-1)
        opening = self._row_open & real
        self.row_start = torch.where(opening, first, self.row_start)
        self._row_open = self._row_open & ~real
        self._read_rows()
        self._padded = self._padded or present is not None

    def held_positions(self, length: int) -> torch.Tensor:
        """``[B, length]`` bool: the positions ``0 .. length - 1`` of which some store of this layer (the hot store and
        its tiers) holds a token of the row, in some KV head (padding and evicted tokens are not held)."""
        held = torch.zeros(self.store.batch, length + 1, dtype=torch.bool, device=self.store.device)
        for st in self.stores.all():
            pos = st.frame("pos").to(held.device).long()
            at = torch.where(st.frame("valid").to(held.device) & (pos < length), pos, length).flatten(1)
            held.scatter_(1, at, True)
        return held[:, :length]

    def _read_rows(self) -> None:
        """Read back (one host read, only while some row is still open or after a batch change) whether a row has
        no real token yet and the range of the rows' first real positions, which ``_sparse_rows`` compares."""
        closed = ~self._row_open
        lo = torch.where(closed, self.row_start, torch.iinfo(torch.int64).max).min()
        hi = torch.where(closed, self.row_start, -1).max()
        still_open, lo, hi = torch.stack([self._row_open.any().long(), lo, hi]).tolist()
        self._rows_open, self._start_bounds = bool(still_open), (lo, hi)

    def attend(
        self, query: torch.Tensor, scale: float, sliding_window: int | None, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention of the latest update's queries (``[B, Hq, q, Dk]``) over this layer -> ``[B, q, Hq, Dv]``."""
        self.prefetch()
        q = query.shape[2]
        if self._last_qpos is None or self._last_qpos.numel() != q:
            raise RuntimeError(f"layer {self.layer_idx}: attend() expects the {q} queries of the latest update()")
        fresh, self._fresh_kv = self._fresh_kv, None  # never held past this call
        if (
            fresh is not None
            and sliding_window is None
            and sinks is None
            and self.shard_groups == 1
            and not self.track_stats
            and not self.stores.tiers
        ):
            # First chunk into an empty layer, no padding: the stored tokens are exactly these, in order, so causal
            # attention over them is the same computation; SDPA's fused causal kernel skips the O(q^2) mask.
            keys, values = fresh
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
            return out.transpose(1, 2)
        decode = q == 1 and self.read.sparse
        x = Query(query, self._last_qpos, scale, sliding_window, sinks, self.row_start, self.forward.present)
        mass_of = self.store if self.track_stats else None
        sparse = self._sparse_rows() if decode else False
        dense_rows = None if isinstance(sparse, bool) else ~sparse
        part = self.step(self._group(), x, sparse is not False, decode, mass_of, dense_rows)
        return part.o.transpose(1, 2).to(query.dtype)

    def _group(self):
        return self.stores.group()

    def _sparse_rows(self) -> bool | torch.Tensor:
        """Which rows of a decode step read under the sparse policy: a row once it has seen
        ``read.sparse_threshold`` positions from its first real token (left padding is not counted; below that a
        dense read costs less than planning a sparse one), and every row while the layer holds tokens in the offload
        tier (a dense read would fetch the whole tier every step). ``True`` / ``False``: all rows / none (decided
        on the host); else a ``[B]`` bool tensor."""
        if not self.policy.sparse:
            return False
        if OFFLOAD in self.stores.tiers:
            return True
        threshold, (lo, hi) = self.read.sparse_threshold, self._start_bounds
        if self._seen - lo < threshold:  # the row with the most real positions (lo: none has one yet -> negative)
            return False
        if not self._rows_open and self._seen - hi >= threshold:  # the row with the fewest
            return True
        return (self._seen - self.row_start >= threshold) & ~self._row_open

    # ------------------------------------------------------------------ length, crop, batch operations
    def rows_start_apart(self) -> bool:
        """Whether the rows' first real tokens sit at different positions (a left-padded batch; a host flag): the
        dense view packs each row's tokens from its start, so entry ``i`` is not one position across rows."""
        lo, hi = self._start_bounds
        return self.store is not None and self._padded and (lo != hi or self._rows_open)

    def min_evicted(self) -> int:
        """Fewest tokens evicted from any (row, KV head)."""
        return self._min_evicted

    def get_seq_length(self) -> int:
        """Tokens seen by this layer (not tokens stored): what transformers uses for positions."""
        return self.seen

    def kv_length(self) -> int:
        """Tokens seen minus the fewest evicted from any (row, head)."""
        return self._seen - self._min_evicted

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for the coming update: ``seen + q`` minus the fewest tokens any (row, head) had
        evicted, and that offset. Masking itself is done by the ``pikv`` attention from stored positions."""
        q = cache_position.shape[0]
        return self._seen + q - self._min_evicted, self._min_evicted

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        self.store = self.stores = None
        self.backend.reset()  # shared with the other layers, which are reset too: frees the gather scratch
        self.is_initialized = False
        self._seen, self._min_evicted = 0, 0
        self.evicted = self.row_start = None
        self._last_qpos = self._fresh_kv = None
        self._last_q = 0
        self._index_pos = self._masks_applied = None
        self.views.reset()
        self.placement.reset()
        self.policy.reset()
        self.step.stats.clear()  # routing_stats() counts the reads of this context only

    def crop(self, max_length: int) -> None:
        """Keep the positions below ``max_length`` (negative: drop that many from the end).

        After an eviction this is still well defined: the tokens at cut positions that are stored are dropped, and
        the eviction counts keep only the evictions below ``max_length`` (padding is assumed to sit at the start of
        a row, as in left-padded batches).
        """
        if not isinstance(max_length, int) or isinstance(max_length, bool):
            raise TypeError(f"max_length must be an int (a position, negative: from the end), got {max_length!r}")
        if max_length < 0:
            max_length = self.seen + max_length
        if self.store is None or max_length >= self.seen:
            return
        max_length = max(max_length, 0)
        self.views.touch()
        removed = self.stores.crop(max_length)
        # cut positions neither stored nor padding were evicted: a row's padding is its positions before row_start
        # (every position it saw while it has no real token)
        pad_end = torch.where(self._row_open, self.seen, self.row_start.clamp(max=self.seen))
        padding = (pad_end - max_length).clamp(min=0).unsqueeze(-1)  # [B, 1]
        self.evicted -= (self.seen - max_length) - removed - padding
        self._min_evicted = int(self.evicted.min())
        self._row_open = self._row_open | (self.row_start >= max_length)  # its real tokens were all cut
        self._read_rows()
        self._set_seen(max_length)
        self._last_qpos = self._fresh_kv = None
        self._last_q = 0
        self._index_pos = self._masks_applied = None

    def _set_seen(self, value: int) -> None:
        self._seen = value

    def _index_batch(self, index: torch.Tensor) -> None:
        self.views.flush()
        if self.store is not None:
            index = index.to(self.device)
            self.views.touch()
            self.stores.index_batch(index)
            self.placement.index_batch(index)
            self.policy.index_batch(index)
            self.evicted = self.evicted.index_select(0, index)
            self._min_evicted = int(self.evicted.min())
            self.row_start = self.row_start.index_select(0, index)
            self._row_open = self._row_open.index_select(0, index)
            self._read_rows()
            self._last_qpos = self._fresh_kv = None
            self._last_q = 0
            self._index_pos = None if self._index_pos is None else self._index_pos.index_select(0, index)

    def _check_rows(self, name: str, index: torch.Tensor) -> None:
        """``checks.check_rows`` against this layer's batch (the type alone before the first update)."""
        check_tensor(name, index)
        if self.store is not None:
            check_rows(name, index, self.store.batch, self.store.device)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._check_rows("beam_idx", beam_idx)
        self._index_batch(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        check_int_at_least("repeats", repeats, 1)
        if self.store is not None:
            self._index_batch(torch.arange(self.store.batch, device=self.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._check_rows("indices", indices)
        self._select_rows(indices)

    def _select_rows(self, indices: torch.Tensor) -> None:
        """:meth:`batch_select_indices` on checked ``indices`` (row ids or a row mask)."""
        if self.store is not None:
            self._index_batch(torch.arange(self.store.batch, device=self.device)[indices.to(self.device)])

    def offload(self) -> None:
        """Move this layer's pages to the CPU (``Cache(offloading=True)`` calls it after the layer's update)."""
        if self.store is not None:
            self.store.to(torch.device("cpu"))

    def prefetch(self) -> None:
        """Move this layer's pages back to its device (called ahead of the layer; ``update`` / ``attend`` also do)."""
        if self.store is not None and self.store.device != self.device:
            self.store.to(self.device)

    # ------------------------------------------------------------------ views for DynamicCache code, bytes
    @property
    def keys(self) -> torch.Tensor | None:
        """``[B, H, T, Dk]`` stored keys of every (row, head) in position order (a copy; see ``pikv_hf.view``)."""
        v = self.view()
        return None if v is None else v.keys

    @keys.setter
    def keys(self, new: torch.Tensor | None) -> None:
        self.views.assign("keys", new)

    @property
    def values(self) -> torch.Tensor | None:
        """``[B, H, T, Dv]`` stored values in the order of :attr:`keys` (a copy)."""
        v = self.view()
        return None if v is None else v.values

    @values.setter
    def values(self, new: torch.Tensor | None) -> None:
        self.views.assign("values", new)

    def tokens_per_shard(self) -> torch.Tensor:
        """``[B, H_kv, S]`` valid tokens stored per shard over every store (zeros before the first update)."""
        if self.store is None:
            return torch.zeros(0, 0, self.num_shards, dtype=torch.int64)
        return self.stores.tokens_per_shard()

    def resident_tokens(self) -> torch.Tensor:
        """``[B, H_kv]`` tokens held per row and KV head in the hot store and every tier but the offload tier."""
        return torch.zeros(0, 0, dtype=torch.int64) if self.store is None else self.stores.resident_tokens()

    def kv_nbytes(self) -> int:
        """Key/value bytes allocated for the resident tokens: the hot store and every tier but the offload tier."""
        return 0 if self.store is None else self.stores.kv_nbytes()

    def offloaded_nbytes(self) -> int:
        """Key/value bytes of the offload tier (CPU memory or memory-mapped files)."""
        return 0 if self.store is None else self.stores.offloaded_nbytes()

    def meta_nbytes(self) -> int:
        return 0 if self.store is None else self.stores.meta_nbytes()
