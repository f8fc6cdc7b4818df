"""``PiKVCache``: a ``transformers.Cache`` whose layers store KV in expert shards of fixed-size pages.

Data flow of one forward (see docs/ARCHITECTURE.md):

1. ``PiKVCache.update(k, v, layer_idx)`` -> ``PiKVLayer.update``: validates, asks the layer's placement router for
   each token's shard, appends to the ``PagedShardStore`` and returns a ``PagedKV`` view (not tensors).
2. transformers calls the registered ``"pikv"`` attention function with that view; it calls
   ``PiKVLayer.attend``, which marks the forward's padding tokens invalid and runs exact attention over the
   store's slots, one partial per shard group, merged by log-sum-exp (``attention.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from pikv_hf.attention import ATTN_IMPLEMENTATION, masked_attention
from pikv_hf.routing import ExpertTap, Placement, PlacementContext, check_placement_name, make_placement
from pikv_hf.routing.expert import num_experts_of
from pikv_hf.store import PagedShardStore

DEFAULT_DENSE_SHARDS = 8


@dataclass(frozen=True)
class PagedKV:
    """What ``PiKVLayer.update`` returns in place of key/value tensors; only the ``pikv`` attention reads it."""

    layer: PiKVLayer


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
        Number of groups the shards are split into for attention; one partial per group, merged exactly.
    track_stats : bool
        Update each slot's attention mass, hit count and last access in the attention path.
    """

    is_sliding = False
    is_compileable = False

    def __init__(
        self, layer_idx: int, placement: Placement, page_size: int, shard_groups: int = 1, track_stats: bool = False
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.placement = placement
        self.num_shards = placement.num_shards
        self.page_size = page_size
        self.shard_groups = shard_groups
        self.track_stats = track_stats
        self.store: PagedShardStore | None = None
        self.seen = 0  # tokens seen by this layer, pads included
        self.evicted = 0  # most tokens evicted from any (row, KV head): crop is not eviction
        self._last_slot: torch.Tensor | None = None  # [B, H, q] slots of the latest update
        self._last_qpos: torch.Tensor | None = None  # [q] positions of the latest update
        self._fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # latest K/V when the store was empty

    # ------------------------------------------------------------------ CacheLayerMixin contract
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, dk = key_states.shape
        self.store = PagedShardStore(
            b, h, dk, value_states.shape[-1], self.num_shards, self.page_size, key_states.dtype, key_states.device
        )
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
        self._fresh_kv = (key_states, value_states) if self.seen == 0 and q > 1 else None
        self._last_slot = self.store.append(key_states, value_states, shard, token_index)
        self._last_qpos = token_index
        self.seen += q
        view = PagedKV(self)
        return view, view

    def attend(
        self,
        query: torch.Tensor,
        scale: float,
        padding: torch.Tensor | None,
        sliding_window: int | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Exact attention of the latest update's queries (``[B, Hq, q, Dk]``) over this layer -> ``[B, q, Hq, Dv]``."""
        st = self.store
        q = query.shape[2]
        if self._last_qpos is None or self._last_qpos.numel() != q:
            raise RuntimeError(f"layer {self.layer_idx}: attend() expects the {q} queries of the latest update()")
        if padding is not None:
            st.invalidate(self._last_slot, padding[:, -q:].to(st.device))
        if (
            self._fresh_kv is not None
            and (padding is None or bool(padding[:, -q:].all()))
            and sliding_window is None
            and sinks is None
            and self.shard_groups == 1
            and not self.track_stats
        ):
            # First chunk into an empty layer, no padding: the stored tokens are exactly these, in order, so causal
            # attention over them is the same computation; SDPA's fused causal kernel skips the O(q^2) mask.
            keys, values = self._fresh_kv
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
            return out.transpose(1, 2)
        groups = None
        if self.shard_groups > 1:
            group_of_slot = st.slot_shard() * self.shard_groups // self.num_shards
            groups = [group_of_slot == gi for gi in range(self.shard_groups)]
        mass = torch.zeros_like(st.attn_mass) if self.track_stats else None
        out = masked_attention(
            query, st.keys, st.values, st.valid, st.pos, self._last_qpos, scale, sliding_window, sinks, groups, mass
        )
        if mass is not None:
            self._record_stats(mass, query.shape[1] // st.heads * q)
        return out

    def _record_stats(self, mass: torch.Tensor, rows: int) -> None:
        """Accumulate attention mass (summed over the ``rows`` query rows of each KV head); a *hit* is a slot that
        received more than a uniform share of those rows' mass; ``last_access`` is the position of the latest
        query that hit it."""
        st = self.store
        st.attn_mass += mass
        n_valid = st.valid.sum(-1, keepdim=True).clamp(min=1)
        hit = st.valid & (mass * n_valid > rows)
        st.hits += hit.to(st.hits.dtype)
        st.last_access = torch.where(hit, self._last_qpos[-1].to(st.last_access.dtype), st.last_access)

    def evict(self, keep: torch.Tensor) -> None:
        """Drop every stored token where ``keep`` (``[B, H_kv, C]`` bool over the store's slots) is False.

        Budgets may differ per batch row and KV head; the store is re-packed, so the bytes are really released.
        Masking stays exact because it reads each kept slot's own position.
        """
        st = self.store
        if st is None:
            raise RuntimeError(f"layer {self.layer_idx}: evict() before any token was stored")
        if keep.shape != st.valid.shape or keep.dtype != torch.bool:
            raise ValueError(
                f"keep must be a bool tensor of shape {tuple(st.valid.shape)}, got {keep.dtype} {tuple(keep.shape)}"
            )
        removed = (st.valid & ~keep).sum(-1)
        st.compact(keep)
        self.evicted += int(removed.max())
        self._last_slot = self._last_qpos = self._fresh_kv = None

    def get_seq_length(self) -> int:
        """Tokens seen by this layer (not tokens stored): what transformers uses for positions."""
        return self.seen

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for the coming update: at most ``seen + q - evicted`` slots hold tokens, and
        ``evicted`` positions were dropped. Masking itself is done by the ``pikv`` attention from stored positions."""
        q = cache_position.shape[0]
        return self.seen + q - self.evicted, self.evicted

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        self.store = None
        self.is_initialized = False
        self.seen = self.evicted = 0
        self._last_slot = self._last_qpos = self._fresh_kv = None
        self.placement.reset()

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` positions (negative: drop that many from the end). Only before eviction."""
        self.check_croppable()
        if max_length < 0:
            max_length = self.seen + max_length
        if self.store is None or max_length >= self.seen:
            return
        self.store.compact(self.store.pos < max_length)
        self.seen = max(max_length, 0)
        self._last_slot = self._last_qpos = self._fresh_kv = None

    def check_croppable(self) -> None:
        """Raise if tokens were evicted: positions being cut may no longer be stored, so crop is undefined."""
        if self.evicted:
            raise RuntimeError(
                f"layer {self.layer_idx}: crop() is undefined after {self.evicted} tokens were evicted "
                "(the positions being cut may no longer be stored)"
            )

    def _index_batch(self, index: torch.Tensor) -> None:
        if self.store is not None:
            self.store.index_batch(index)
            self.placement.index_batch(index)
            self._last_slot = None if self._last_slot is None else self._last_slot.index_select(0, index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._index_batch(beam_idx.to(self.device) if self.store is not None else beam_idx)

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


def attach(model: nn.Module) -> None:
    """Switch ``model`` to the ``"pikv"`` attention implementation (registering it first if needed)."""
    from pikv_hf.attention import register

    register()
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)


def _expert_tap(model: nn.Module) -> ExpertTap:
    """The model's ``ExpertTap`` (installed once per model, shared by every cache built on it)."""
    tap = getattr(model, "_pikv_expert_tap", None)
    if tap is None:
        tap = ExpertTap(model)
        model._pikv_expert_tap = tap
    return tap


class PiKVCache(Cache):
    """Expert-sharded paged KV cache; with no compression it reproduces ``DynamicCache`` exactly.

    Parameters
    ----------
    model : PreTrainedModel or PretrainedConfig
        The model (preferred: the cache switches it to the ``"pikv"`` attention and, for ``router="expert"``,
        installs the hooks that capture expert choices) or its config (then load the model with
        ``attn_implementation="pikv"`` yourself).
    router : str
        Placement router: ``"round_robin"`` (alias ``"hash"``), ``"expert"`` (the model's own MoE routing from
        the previous MoE layer) or ``"key_cluster"`` (online k-means on keys).
    num_shards : int, optional
        Shards per layer and KV head. Default: the model's number of routed experts, or 8 for a dense model.
    page_size : int
        Tokens per page (default 16).
    shard_groups : int
        Shards are split into this many groups for attention; each group yields a partial result and the
        partials are merged exactly with log-sum-exp (default 1: one group on one device).
    track_stats : bool
        Update per-token attention mass / hits / last access during attention (default False).

    Examples
    --------
    >>> cache = PiKVCache(model, router="expert")
    >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=32)
    """

    def __init__(
        self,
        model: nn.Module | PretrainedConfig,
        router: str = "round_robin",
        num_shards: int | None = None,
        page_size: int = 16,
        shard_groups: int = 1,
        track_stats: bool = False,
    ) -> None:
        is_model = isinstance(model, nn.Module)
        config = model.config if is_model else model
        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"model must be a transformers model or config, got {type(model).__name__}")
        router = check_placement_name(router)
        if router == "expert" and not is_model:
            raise ValueError("router='expert' needs the model itself (its MoE routing is captured with hooks)")
        text_config = config.get_text_config()
        num_experts = num_experts_of(text_config)
        if num_shards is None:
            num_shards = num_experts or DEFAULT_DENSE_SHARDS
        if not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"num_shards must be an integer >= 1, got {num_shards!r}")
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
        if not isinstance(shard_groups, int) or not 1 <= shard_groups <= num_shards:
            raise ValueError(f"shard_groups must be an integer in [1, num_shards={num_shards}], got {shard_groups!r}")
        if router == "expert" and num_experts is None:
            raise ValueError(f"router='expert' needs an MoE model; {type(config).__name__} declares no experts")
        tap = _expert_tap(model) if router == "expert" else None
        if is_model:
            attach(model)
        n_layers = text_config.num_hidden_layers
        layers = [
            PiKVLayer(i, make_placement(router, num_shards, i, tap), page_size, shard_groups, track_stats)
            for i in range(n_layers)
        ]
        super().__init__(layers=layers)
        self.router = router
        self.num_shards = num_shards
        self.page_size = page_size

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[PagedKV, PagedKV]:
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < len(self.layers):
            raise IndexError(f"layer_idx must be in [0, {len(self.layers)}), got {layer_idx!r}")
        return self.layers[layer_idx].update(key_states, value_states, cache_kwargs)

    def crop(self, max_length: int) -> None:
        """Crop every layer to ``max_length`` tokens; raises before touching any layer if one has evicted tokens."""
        for layer in self.layers:
            layer.check_croppable()
        super().crop(max_length)

    def tokens_per_shard(self) -> torch.Tensor:
        """``[L, S]`` valid tokens per shard and layer, summed over batch rows and KV heads."""
        return torch.stack([layer.tokens_per_shard().sum(dim=(0, 1)) for layer in self.layers])

    def kv_nbytes(self) -> int:
        """Bytes allocated for keys and values across layers."""
        return sum(layer.kv_nbytes() for layer in self.layers)

    def meta_nbytes(self) -> int:
        """Bytes allocated for positions, valid bits, statistics and page tables across layers."""
        return sum(layer.meta_nbytes() for layer in self.layers)
