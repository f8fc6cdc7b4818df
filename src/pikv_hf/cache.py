"""``PiKVCache``: a ``transformers.Cache`` whose layers store KV in expert shards of fixed-size pages.

Data flow of one forward (see docs/ARCHITECTURE.md):

1. ``PiKVCache.update(k, v, layer_idx)`` -> ``PiKVLayer.update``: validates, asks the layer's placement router for
   each token's shard, appends to the ``PagedShardStore`` and returns a ``PagedKV`` view (not tensors).
2. transformers calls the registered ``"pikv"`` attention function with that view; it calls
   ``PiKVLayer.attend``, which marks the forward's padding tokens invalid and runs exact attention over the
   store's slots, one partial per shard group, merged by log-sum-exp (``attention.py``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from pikv_hf.attention import ATTN_IMPLEMENTATION, allowed_mask, masked_attention
from pikv_hf.checks import check_int_at_least
from pikv_hf.routing import (
    ExpertTap,
    Placement,
    PlacementContext,
    Selector,
    check_placement_name,
    make_placement,
    make_selector,
)
from pikv_hf.routing.base import ShardSummary
from pikv_hf.routing.expert import num_experts_of
from pikv_hf.routing.scores import estimated_mass, upper_bounds
from pikv_hf.store import PagedShardStore

DEFAULT_DENSE_SHARDS = 8
ATTENTION_MODES = ("exact", "routed", "quest")


@dataclass(frozen=True)
class RoutedAttention:
    """Settings of routed decode attention (PiKV Routing) and of its Quest-style page baseline.

    At decode time (one new token per row) each query attends, per batch row and KV head, only to the tokens of
    its ``top_k_shards`` selected shards, plus always the first ``n_sink`` positions and its last ``window``
    positions. Prefill stays exact.

    With ``read_fraction`` set instead (``attention="quest"``), selection is per page rather than per shard, as in
    Quest (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024): every
    (row, KV head) reads ``ceil(read_fraction * pages stored)`` pages, the pages holding sink or recent-window
    tokens first, then the pages with the largest upper bound of ``q . k`` from per-page key min / max (max over
    the KV head's query heads). Every token of a page read is attended.

    Attributes
    ----------
    top_k_shards : int or None
        Shards selected per query, in ``[1, num_shards]`` (None in page mode).
    selector : str
        Selection router (``pikv_hf.routing.SELECTORS``); unused in page mode.
    selector_kwargs : dict
        Constructor arguments of the selector, e.g. ``{"score": "bound"}`` to rank shards by Quest's key min / max
        bound instead of the centroid.
    n_sink, window : int
        Always-kept first positions and recent window.
    measure_recall : bool
        On every routed step also run exact attention and record the fraction of its probability mass that the
        routed tokens hold (slow: for measurements).
    reward_every : int
        Learning selectors (``adaptive``) get that recall as reward every ``reward_every`` routed steps.
    read_fraction : float or None
        Page mode (Quest): fraction of each (row, KV head)'s stored pages read per decode step, in ``(0, 1]``.
    dense_layers : int
        The first ``dense_layers`` decoder layers read every page at decode time (exact attention, counted as a
        full read in the statistics), as Quest does for its first two layers, whose attention is not sparse.
    mass_target : float or None
        Shard mode: read, per (row, KV head), only the shortest prefix of the selector's ``top_k_shards`` ranked
        shards whose estimated share of the attention mass (``pikv_hf.routing.scores.estimated_mass``) reaches
        ``mass_target``; ``top_k_shards`` is then a cap and the number read adapts to each head and step (top-p).
    """

    top_k_shards: int | None
    selector: str = "topk"
    n_sink: int = 4
    window: int = 64
    measure_recall: bool = False
    reward_every: int = 16
    read_fraction: float | None = None
    selector_kwargs: dict = field(default_factory=dict)
    dense_layers: int = 0
    mass_target: float | None = None


@dataclass
class RoutingStats:
    """What routed attention read, accumulated over routed steps of one layer (sums over rows and KV heads)."""

    steps: int = 0
    heads: int = 0  # (row, KV head) pairs routed, summed over steps
    tokens_attended: int = 0
    tokens_stored: int = 0
    pages_gathered: int = 0
    pages_stored: int = 0
    slots_gathered: int = 0  # pages gathered x page size
    recall_sum: float = 0.0
    recall_heads: int = 0

    def as_dict(self) -> dict[str, float]:
        return {
            "steps": self.steps,
            "selected_tokens_per_head": self.tokens_attended / max(1, self.heads),
            "fraction_tokens_attended": self.tokens_attended / max(1, self.tokens_stored),
            "fraction_pages_read": self.pages_gathered / max(1, self.pages_stored),
            # slots moved (empty slots of partly filled pages included) over the tokens a dense cache would read
            "kv_read_vs_dense": self.slots_gathered / max(1, self.tokens_stored),
            "recall": self.recall_sum / self.recall_heads if self.recall_heads else float("nan"),
        }


@dataclass(frozen=True)
class PagedKV:
    """What ``PiKVLayer.update`` returns in place of key/value tensors; only the ``pikv`` attention reads it.

    ``shape`` is ``[B, H_kv, T, D]`` with ``T = seen - evicted`` (the ``kv_length`` of ``get_mask_sizes``), so code
    that wraps attention functions and inspects sizes, such as kvpress's attention patch, keeps working.
    """

    layer: PiKVLayer
    kind: str  # "keys" or "values"

    @property
    def shape(self) -> torch.Size:
        st, layer = self.layer.store, self.layer
        dim = st.k_dim if self.kind == "keys" else st.v_dim
        return torch.Size((st.batch, st.heads, layer.seen - layer.evicted, dim))

    def __setitem__(self, index, value) -> None:
        raise TypeError(
            "PiKVCache keeps K/V in pages and cannot take in-place key edits (kvpress head-wise presses such as "
            "AdaKV write fake keys through masked_key_indices); presses inside PiKVCache arrive with the "
            "scheduling issue"
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
        Number of groups the shards are split into for attention; one partial per group, merged exactly.
    track_stats : bool
        Update each slot's attention mass, hit count and last access in the attention path.
    routed : RoutedAttention, optional
        Routed decode attention; None for exact attention.
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
        routed: RoutedAttention | None = None,
        workspace: dict | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.workspace = {} if workspace is None else workspace  # gather scratch shared by the cache's layers
        self.placement = placement
        self.num_shards = placement.num_shards
        self.page_size = page_size
        self.shard_groups = shard_groups
        self.track_stats = track_stats
        self.set_routed(routed)
        self.misses: torch.Tensor | None = None  # [B, H, S] selected shards that had lost tokens to eviction
        self.shard_evicted: torch.Tensor | None = None  # [B, H, S] tokens evicted from each shard
        self.store: PagedShardStore | None = None
        self.seen = 0  # tokens seen by this layer, pads included
        self.evicted = 0  # most tokens evicted from any (row, KV head): crop is not eviction
        self._last_slot: torch.Tensor | None = None  # [B, H, q] slots of the latest update
        self._last_qpos: torch.Tensor | None = None  # [q] positions of the latest update
        self._fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # latest K/V when the store was empty

    def set_routed(self, routed: RoutedAttention | None) -> None:
        """Use routed decode attention with these settings (None: exact); fresh selector and statistics."""
        self.routed = routed
        shards = routed is not None and routed.read_fraction is None
        self.selector = make_selector(routed.selector, **routed.selector_kwargs) if shards else None
        self.routing_stats = RoutingStats()

    # ------------------------------------------------------------------ CacheLayerMixin contract
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, dk = key_states.shape
        self.store = PagedShardStore(
            b,
            h,
            dk,
            value_states.shape[-1],
            self.num_shards,
            self.page_size,
            key_states.dtype,
            key_states.device,
            self.workspace,
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
        return PagedKV(self, "keys"), PagedKV(self, "values")

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
        if self.routed is not None and q == 1:
            return self._attend_routed(query, scale, sliding_window, sinks)
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

    def _attend_routed(
        self, query: torch.Tensor, scale: float, sliding_window: int | None, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        """Routed decode attention: selected shards (or Quest pages) + sinks + recent window, read page by page."""
        st, cfg = self.store, self.routed
        b, hq, q, dk = query.shape
        h, p = st.heads, self.page_size
        qg = query.reshape(b, h, hq // h * q, dk)
        qpos = self._last_qpos
        # pages holding sink or recent-window tokens are always read
        posp = st.pos.view(b, h, -1, p)
        special = (st.valid.view(b, h, -1, p) & ((posp < cfg.n_sink) | (posp > int(qpos[0]) - cfg.window))).any(-1)
        summary = selected = None
        if self.layer_idx < cfg.dense_layers:
            need = st.page_shard >= 0

            def selected_slots(shard: torch.Tensor, pos: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
                """A dense layer attends to every stored token."""
                return read

        elif cfg.read_fraction is None:
            summary, selected, chosen_shard, need = self._select_shards(qg, scale, special)

            def selected_slots(shard: torch.Tensor, pos: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
                """Slots of a selected shard, and sinks (``allowed_mask`` adds the window)."""
                return chosen_shard.gather(2, shard.clamp(min=0)) | (pos < cfg.n_sink)

        else:
            need = self._select_pages(qg, special)

            def selected_slots(shard: torch.Tensor, pos: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
                """Quest attends to every token of a page it reads."""
                return read

        n_read = need.sum(-1)
        pages = torch.argsort((~need).to(torch.uint8), dim=-1, stable=True)[..., : int(n_read.max())]
        part = st.gather_pages(pages)
        read = need.gather(2, pages).repeat_interleave(p, dim=-1)
        valid = part["valid"] & read
        chosen = selected_slots(part["shard"], part["pos"], read)
        # one decode row: the routed restriction becomes the slot mask of an ordinary masked attention
        attended = allowed_mask(valid, part["pos"], qpos, sliding_window, (chosen, cfg.window))[:, :, 0]
        out = masked_attention(query, part["keys"], part["values"], attended, part["pos"], qpos, scale, sinks=sinks)
        stats = self.routing_stats
        stats.steps += 1
        stats.heads += b * h
        stats.tokens_attended += int(attended.sum())
        stats.tokens_stored += int(st.valid.sum())
        stats.pages_gathered += int(n_read.sum())
        stats.pages_stored += int(st.n_pages.sum())
        stats.slots_gathered += int(n_read.sum()) * p
        learn = selected is not None and self.selector.update is not Selector.update
        learn = learn and stats.steps % cfg.reward_every == 0
        if cfg.measure_recall or learn:
            kept = selected_slots(st.slot_shard(), st.pos, need.repeat_interleave(p, dim=-1))
            recall = self._recall(query, scale, sliding_window, sinks, kept)
            stats.recall_sum += float(recall.sum())
            stats.recall_heads += recall.numel()
            if learn:
                self.selector.update(qg, summary, selected, recall)
        return out

    def _select_shards(
        self, qg: torch.Tensor, scale: float, special: torch.Tensor
    ) -> tuple[ShardSummary, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Shard selection for the ``[B, H, G, D]`` queries.

        Returns ``(summary, selected [B, H, k], chosen_shard [B, H, S] bool, pages to read [B, H, NP] bool)`` and
        counts a miss for every selected shard that had lost tokens to eviction. With a mass target only a prefix
        of ``selected`` is chosen (``chosen_shard``); ``selected`` keeps the selector's full answer.
        """
        st = self.store
        b, h, s = st.batch, st.heads, self.num_shards
        if self.misses is None or self.misses.shape[:2] != (b, h):
            self.misses = torch.zeros(b, h, s, dtype=torch.int64, device=st.device)
        summary = st.summary(self.misses)
        selected = self.selector.select(qg, summary, self.routed.top_k_shards)
        keep = torch.ones_like(selected, dtype=torch.bool)
        if self.routed.mass_target is not None:  # shortest ranked prefix reaching the target (always >= 1 shard)
            covered = estimated_mass(qg, summary, scale).gather(2, selected).cumsum(-1)
            keep[..., 1:] = covered[..., :-1] < self.routed.mass_target
        chosen_shard = torch.zeros(b, h, s, dtype=torch.bool, device=st.device).scatter_(2, selected, keep)
        if self.shard_evicted is not None:
            self.misses += (chosen_shard & (self.shard_evicted > 0)).long()
        in_shard = chosen_shard.gather(2, st.page_shard.clamp(min=0)) & (st.page_shard >= 0)
        return summary, selected, chosen_shard, in_shard | special

    def _select_pages(self, qg: torch.Tensor, special: torch.Tensor) -> torch.Tensor:
        """Quest page selection for the ``[B, H, G, D]`` queries -> ``[B, H, NP]`` bool pages to read.

        Each (row, KV head) reads ``ceil(read_fraction * n_pages)`` pages: sink / window pages first, then the
        pages of largest ``q . k`` upper bound (``pikv_hf.routing.scores.upper_bounds``).
        """
        st = self.store
        st.enable_page_bounds()
        key_min, key_max, count = st.page_bounds()
        score = upper_bounds(qg, key_min, key_max, count).masked_fill(special, float("inf"))
        budget = torch.ceil(st.n_pages * self.routed.read_fraction).long()  # [B, H]
        order = score.argsort(dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(
            2, order, torch.arange(order.shape[-1], device=order.device).expand_as(order)
        )
        return (rank < budget.unsqueeze(-1)) & (count > 0)

    def _recall(
        self,
        query: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        sinks: torch.Tensor | None,
        chosen: torch.Tensor,
    ) -> torch.Tensor:
        """``[B, H]`` fraction of exact attention's probability mass on the tokens routed attention keeps
        (``chosen`` ``[B, H, C]`` over the store's slots, plus the recent window)."""
        st, cfg = self.store, self.routed
        mass = torch.zeros_like(st.attn_mass)
        qpos = self._last_qpos
        masked_attention(query, st.keys, st.values, st.valid, st.pos, qpos, scale, sliding_window, sinks, mass_out=mass)
        kept = allowed_mask(st.valid, st.pos, qpos, sliding_window, (chosen, cfg.window)).any(2)
        return (mass * kept).sum(-1) / mass.sum(-1).clamp(min=torch.finfo(torch.float32).tiny)

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
        dropped = st.valid & ~keep
        removed = dropped.sum(-1)
        per_shard = torch.zeros_like(st.shard_count).scatter_add_(2, st.slot_shard().clamp(min=0), dropped.long())
        self.shard_evicted = per_shard if self.shard_evicted is None else self.shard_evicted + per_shard
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
        self.workspace.clear()  # shared with the other layers, which are reset too: frees the routed gather scratch
        self.is_initialized = False
        self.seen = self.evicted = 0
        self._last_slot = self._last_qpos = self._fresh_kv = None
        self.misses = self.shard_evicted = None
        self.placement.reset()
        if self.selector is not None:
            self.selector.reset()

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
            index = index.to(self.device)
            self.store.index_batch(index)
            self.placement.index_batch(index)
            self._last_slot = None if self._last_slot is None else self._last_slot.index_select(0, index)
            self.misses = None if self.misses is None else self.misses.index_select(0, index)
            self.shard_evicted = None if self.shard_evicted is None else self.shard_evicted.index_select(0, index)

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


def routed_settings(
    num_shards: int | None,
    *,
    attention: str,
    top_k_shards: int | None,
    selector: str,
    n_sink: int,
    window: int,
    measure_recall: bool,
    read_fraction: float | None = None,
    selector_kwargs: dict | None = None,
    dense_layers: int = 0,
    num_layers: int | None = None,
    mass_target: float | None = None,
) -> RoutedAttention | None:
    """Validate the attention arguments of ``PiKVCache``; the ``RoutedAttention`` they ask for, or None (exact).
    ``num_shards`` is only read for ``attention="routed"``; ``dense_layers`` is checked against ``num_layers``
    when it is known."""
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_MODES)}; got {attention!r}")
    if attention == "exact":
        return None
    if attention == "routed":
        if not isinstance(top_k_shards, int) or not 1 <= top_k_shards <= num_shards:
            raise ValueError(
                f"top_k_shards must be an integer in [1, num_shards={num_shards}] for attention='routed', "
                f"got {top_k_shards!r}"
            )
        selector_kwargs = dict(selector_kwargs or {})
        try:
            make_selector(selector, **selector_kwargs)
        except TypeError as err:
            raise ValueError(f"selector_kwargs {selector_kwargs} do not fit selector {selector!r}: {err}") from None
        read_fraction = None
        if mass_target is not None and (
            isinstance(mass_target, bool) or not isinstance(mass_target, (int, float)) or not 0 < mass_target <= 1
        ):
            raise ValueError(f"mass_target must be None or a number in (0, 1], got {mass_target!r}")
    else:
        if mass_target is not None:
            raise ValueError("mass_target applies to attention='routed' (shard selection) only; got attention='quest'")
        if isinstance(read_fraction, bool) or not isinstance(read_fraction, (int, float)) or not 0 < read_fraction <= 1:
            raise ValueError(f"read_fraction must be a number in (0, 1] for attention='quest', got {read_fraction!r}")
        top_k_shards, read_fraction = None, float(read_fraction)
    check_int_at_least("n_sink", n_sink, 0)
    check_int_at_least("window", window, 1)
    most = num_layers if num_layers is not None else "the number of layers"
    if not isinstance(dense_layers, int) or not 0 <= dense_layers <= (num_layers or dense_layers):
        raise ValueError(f"dense_layers must be an integer in [0, {most}], got {dense_layers!r}")
    return RoutedAttention(
        top_k_shards=top_k_shards,
        selector=selector,
        n_sink=n_sink,
        window=window,
        measure_recall=measure_recall,
        read_fraction=read_fraction,
        selector_kwargs=selector_kwargs or {},
        dense_layers=dense_layers,
        mass_target=None if mass_target is None else float(mass_target),
    )


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
    attention : str
        ``"exact"`` (default), ``"routed"``: at decode time each query attends only to its ``top_k_shards``
        selected shards plus ``n_sink`` first and ``window`` recent positions, or ``"quest"``: the same with
        Quest's per-page selection of ``read_fraction`` of the pages instead of shards (see ``RoutedAttention``).
    top_k_shards : int, optional
        Shards per query in routed mode, in ``[1, num_shards]``.
    selector : str
        Selection router for routed mode (``pikv_hf.routing.SELECTORS``; default ``"topk"``).
    n_sink, window : int
        Always-kept first positions (default 4) and recent window (default 64) in routed mode.
    measure_recall : bool
        Routed mode: also compute exact attention each step and record the recall (slow; for measurements).
    read_fraction : float, optional
        Quest mode: fraction of each (row, KV head)'s pages read per decode step, in ``(0, 1]``.
    selector_kwargs : dict, optional
        Constructor arguments of the selector (e.g. ``{"score": "bound"}``).
    dense_layers : int
        Routed / Quest mode: the first ``dense_layers`` layers keep exact decode attention (default 0).
    mass_target : float, optional
        Routed mode: read only the shortest prefix of the ``top_k_shards`` ranked shards whose estimated share of
        the attention mass reaches this value, in ``(0, 1]`` (top-p; ``top_k_shards`` becomes a cap).

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
        attention: str = "exact",
        top_k_shards: int | None = None,
        selector: str = "topk",
        n_sink: int = 4,
        window: int = 64,
        measure_recall: bool = False,
        read_fraction: float | None = None,
        selector_kwargs: dict | None = None,
        dense_layers: int = 0,
        mass_target: float | None = None,
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
        check_int_at_least("num_shards", num_shards, 1)
        check_int_at_least("page_size", page_size, 1)
        if not isinstance(shard_groups, int) or not 1 <= shard_groups <= num_shards:
            raise ValueError(f"shard_groups must be an integer in [1, num_shards={num_shards}], got {shard_groups!r}")
        routed = routed_settings(
            num_shards,
            attention=attention,
            top_k_shards=top_k_shards,
            selector=selector,
            n_sink=n_sink,
            window=window,
            measure_recall=measure_recall,
            read_fraction=read_fraction,
            selector_kwargs=selector_kwargs,
            dense_layers=dense_layers,
            num_layers=text_config.num_hidden_layers,
            mass_target=mass_target,
        )
        if router == "expert" and num_experts is None:
            raise ValueError(f"router='expert' needs an MoE model; {type(config).__name__} declares no experts")
        tap = _expert_tap(model) if router == "expert" else None
        if is_model:
            attach(model)
        n_layers = text_config.num_hidden_layers
        workspace: dict = {}  # one gather workspace for all layers: they attend one after the other
        layers = [
            PiKVLayer(
                i, make_placement(router, num_shards, i, tap), page_size, shard_groups, track_stats, workspace=workspace
            )
            for i in range(n_layers)
        ]
        super().__init__(layers=layers)
        self.router = router
        self.num_shards = num_shards
        self.page_size = page_size
        self._apply_routed(routed)

    def set_attention(
        self,
        attention: str = "exact",
        top_k_shards: int | None = None,
        selector: str = "topk",
        n_sink: int = 4,
        window: int = 64,
        measure_recall: bool = False,
        read_fraction: float | None = None,
        selector_kwargs: dict | None = None,
        dense_layers: int = 0,
        mass_target: float | None = None,
    ) -> None:
        """Switch every layer between exact, routed and quest decode attention (arguments as in the constructor).

        Stored tokens are kept; selectors and routing statistics start fresh. Raises before changing anything.
        """
        self._apply_routed(
            routed_settings(
                self.num_shards,
                attention=attention,
                top_k_shards=top_k_shards,
                selector=selector,
                n_sink=n_sink,
                window=window,
                measure_recall=measure_recall,
                read_fraction=read_fraction,
                selector_kwargs=selector_kwargs,
                dense_layers=dense_layers,
                num_layers=len(self.layers),
                mass_target=mass_target,
            )
        )

    def _apply_routed(self, routed: RoutedAttention | None) -> None:
        self.routed = routed
        for layer in self.layers:
            layer.set_routed(routed)

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

    def fork(self) -> PiKVCache:
        """An independent copy of everything stored (pages, router and selector state, statistics).

        The copy shares only the model's expert tap, so several continuations (e.g. one per attention mode) can
        be decoded from one prefill.
        """
        taps = {
            id(layer.placement.tap): layer.placement.tap for layer in self.layers if hasattr(layer.placement, "tap")
        }
        return copy.deepcopy(self, memo=taps)

    def crop(self, max_length: int) -> None:
        """Crop every layer to ``max_length`` tokens; raises before touching any layer if one has evicted tokens."""
        for layer in self.layers:
            layer.check_croppable()
        super().crop(max_length)

    def tokens_per_shard(self) -> torch.Tensor:
        """``[L, S]`` valid tokens per shard and layer, summed over batch rows and KV heads."""
        return torch.stack([layer.tokens_per_shard().sum(dim=(0, 1)) for layer in self.layers])

    def routing_stats(self) -> dict:
        """Routed mode: per-layer and overall fraction of KV read, tokens per head and recall (if measured)."""
        per_layer = [layer.routing_stats.as_dict() for layer in self.layers]
        total = RoutingStats()
        for layer in self.layers:
            for name, value in vars(layer.routing_stats).items():
                setattr(total, name, getattr(total, name) + value)
        return {"overall": total.as_dict(), "per_layer": per_layer}

    def kv_nbytes(self) -> int:
        """Bytes allocated for keys and values across layers."""
        return sum(layer.kv_nbytes() for layer in self.layers)

    def meta_nbytes(self) -> int:
        """Bytes allocated for positions, valid bits, statistics and page tables across layers."""
        return sum(layer.meta_nbytes() for layer in self.layers)
