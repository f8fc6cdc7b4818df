"""``LayerEdits``: what presses and code written for ``DynamicCache`` do to a ``PiKVLayer`` besides the cache contract.

Presses act through this small API instead of the stores: :meth:`LayerEdits.view` / :meth:`LayerEdits.view_index`
(position-ordered entries to score), :meth:`LayerEdits.keep`, :meth:`LayerEdits.offload_tokens` and
:meth:`LayerEdits.move_to_tier` (of view entries), :meth:`LayerEdits.slot_stat` (named per-slot statistics in view
order), :meth:`LayerEdits.held`; kvpress's head-wise masks (:meth:`LayerEdits.apply_head_masks`) and presses that
rewrite keys or values (:meth:`LayerEdits.write_entries`, :meth:`LayerEdits.rewrite`) end up here too, and so do the
dense tensors another attention implementation reads (:meth:`LayerEdits.dense_kv`) and the attention weights eager
consumers ask for. ``PiKVLayer`` (``layer.py``) mixes it in.
"""

from __future__ import annotations

import torch

from pikv_hf.attention import allowed_mask
from pikv_hf.checks import calling_press, check_tensor
from pikv_hf.codecs import Codec
from pikv_hf.store import STAT_FIELDS
from pikv_hf.store.tiers import OFFLOAD_TARGETS
from pikv_hf.view import DenseView, positional_kv, positional_weights


class LayerEdits:
    """The press API of a ``PiKVLayer`` (module docstring); it reads the layer's stores, views and counters."""

    def dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values for a model forward that runs an attention implementation other than ``"pikv"``: every
        token at its own position (zeros at left padding, which the model's own mask hides), exact as long as
        nothing was evicted (:meth:`_check_dense_readable`)."""
        return positional_kv(self.views.snapshot(), self.kv_length())

    def _check_dense_readable(self) -> None:
        """After an eviction a forward on another attention than ``"pikv"`` cannot read the cache exactly: refused."""
        if self.evicted is not None and bool((self.evicted > 0).any()):
            module = self.attention_module()
            impl = getattr(getattr(module, "config", None), "_attn_implementation", None) or "another"
            raise RuntimeError(
                f"layer {self.layer_idx}: this PiKVCache keeps a different set of tokens per row and KV head (a press "
                f"evicted some), which only the 'pikv' attention reads exactly, but the model runs {impl!r} "
                "attention: it was detached from the cache (another PiKVCache on this model left its `with` block or "
                "called detach()). Call cache.attach() before using this cache again."
            )

    def attention_weights(
        self, query: torch.Tensor, scale: float, sliding_window: int | None, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        """``[B, Hq, q, T]`` attention probabilities of the latest update's queries over the ``T`` positions seen,
        column ``j`` position ``j`` (what an eager attention returns over a ``DynamicCache``: zero at left padding and
        at evicted positions), computed only when a caller asks for them; a decode step of a sparse cache counts it
        in ``routing_stats`` (``dense_passes``)."""
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
        lse = lse.masked_fill(torch.isneginf(lse), 0.0)  # a query that sees nothing (left padding): zeros, not NaN
        if q == 1 and self.read.sparse:
            self.read_stats.add(self.store.device, dense_passes=1)
        # every position seen has a column (after an eviction kv_length() is fewer: the scatter went out of bounds)
        width = max(self.kv_length(), self.seen)
        return positional_weights(torch.exp(logits - lse), v, width).to(query.dtype)

    def end_forward(self) -> None:
        """The model forward ended (also by an exception): drop what only it needed, so that the layer references
        nothing beyond its stores between forwards: the latest view, the new tokens' positions and the K/V of a first
        chunk not attended yet. A head-wise press's masks left on the attention module for the next forward keep the
        view's positions, their index space (``apply_head_masks``)."""
        self._last_qpos = self._fresh_kv = None
        self.views.release(keep_positions=getattr(self.attention_module(), "masked_key_indices", None) is not None)

    # ------------------------------------------------------------------ what presses act through
    def view(self) -> DenseView | None:
        """The position-ordered copy of the stored tokens (taken once per write; None before the first update)."""
        if self.store is None:
            return None
        self.views.flush()
        return self.views.snapshot()

    def view_index(self) -> DenseView:
        """The hot store's view without keys and values (``frame_index``, ``pos``, ``valid``, ``row_start``): what a
        press needs to turn view scores into a keep mask."""
        return self.views.index()

    def keep(self, view: DenseView, keep: torch.Tensor) -> None:
        """Evict every token of the hot store whose entry of ``view`` (``[B, H, T]`` bool ``keep``) is False (a
        selection: the view after it is the index space of later head masks)."""
        self.evict(self._frame_keep(view, keep))
        self._index_pos = self._masks_applied = None

    def offload_tokens(self, view: DenseView, keep: torch.Tensor, target: str = "cpu") -> torch.Tensor:
        """Move the hot store's tokens whose entry of ``view`` is not kept to the offload tier (``"cpu"`` or
        ``"disk"``), where attention still reads them; returns ``[B, H]`` tokens moved."""
        if target not in OFFLOAD_TARGETS:
            raise ValueError(f"target must be one of {', '.join(OFFLOAD_TARGETS)}, got {target!r}")
        self._check_tiers_allowed()
        frame = self._frame_keep(view, keep)
        self.views.touch()
        return self.stores.offload(frame, target)

    def move_to_tier(
        self,
        name: str,
        view: DenseView,
        keep: torch.Tensor,
        codec: Codec | None = None,
        page_size: int | None = None,
    ) -> torch.Tensor:
        """Move the hot store's tokens whose entry of ``view`` is not kept to the tier ``name`` (created on first
        use with ``codec`` and pages of ``page_size`` tokens, see ``LayerStores.tier``); attention reads them there.
        Returns ``[B, H]`` tokens moved."""
        self._check_tiers_allowed()
        frame = self._frame_keep(view, keep)
        self.stores.tier(name, codec, page_size=page_size)
        self.views.touch()
        return self.stores.move(name, frame)

    def _check_tiers_allowed(self) -> None:
        """``ValueError`` before anything moves when this layer's reads measure recall (over the hot store alone)."""
        reason = self.policy.measures_recall()
        if reason is not None:
            raise ValueError(
                f"{calling_press()}: layer {self.layer_idx} reads with {reason}, which measures recall against exact "
                "attention over the hot store alone, so its tokens cannot move into a tier (offload, compression): "
                "use measure_recall=False and a selector that does not learn"
            )

    def _frame_keep(self, view: DenseView, keep: torch.Tensor) -> torch.Tensor:
        """A keep mask over ``view``'s entries as one over the hot store's frame (``ValueError`` if malformed)."""
        if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.shape != view.pos.shape:
            got = f"{keep.dtype} {tuple(keep.shape)}" if isinstance(keep, torch.Tensor) else type(keep).__name__
            want = tuple(view.pos.shape)
            raise ValueError(f"keep must be a bool tensor of shape {want} (the view's entries), got {got}")
        return self.frame_mask(view.frame_index, keep.to(view.pos.device) & view.valid)

    def slot_stat(self, name: str, view: DenseView) -> torch.Tensor:
        """Per-slot statistic ``name`` (``attn_mass``, ``hits``, ``last_access``) of the hot store in the order of
        ``view`` (``[B, H, T]``; entries that are not valid read slot 0's value: mask them with ``view.valid``)."""
        if name not in STAT_FIELDS:
            raise ValueError(f"name must be one of {', '.join(STAT_FIELDS)}, got {name!r}")
        self.enable_stats()
        return self.store.frame(name).gather(2, view.frame_index.clamp(min=0))

    def enable_stats(self) -> None:
        """Track per-slot attention statistics from now on (what ``track_stats=True`` does from the start)."""
        self.track_stats = True
        if self.store is not None:
            self.store.enable_stats()

    def empty_nbytes(self) -> int:
        """The share of ``kv_nbytes()`` in allocated slots that hold no token (partly filled pages, growth headroom,
        a ``max_cache_len`` reservation), every store but the offload tier: the gap between the bytes held and those
        of the tokens held, which no press ratio frees."""
        return 0 if self.stores is None else self.stores.empty_nbytes()

    def held(self) -> torch.Tensor:
        """``[B, H]`` tokens held in the hot store per row and KV head."""
        return self.store.stats.count.sum(-1)

    def frame_mask(self, index: torch.Tensor, mark: torch.Tensor) -> torch.Tensor:
        """``[B, H, W * P]`` bool over the hot store's frame: True at the valid slots ``index`` (``[B, H, n]``, frame
        indices, ``-1`` for none) where ``mark`` holds (entries of ``index`` may repeat: any True wins)."""
        st = self.store
        hits = torch.zeros(st.batch, st.heads, st.table.width() * st.page_size, dtype=torch.int32, device=st.device)
        hits.scatter_add_(2, index.clamp(min=0), (mark & (index >= 0)).to(torch.int32))
        return (hits > 0) & st.frame("valid")

    def apply_head_masks(self, masks, view: DenseView | None = None) -> None:
        """Evict the tokens a head-wise kvpress press masks (``masked_key_indices``: batch, head and index tensors, in
        kvpress's index space: the entries of the keys it was given, ``view`` or the latest view taken, with the
        tokens it masked earlier still counted, as a DynamicCache keeps them). The same masks again (kvpress's
        attention patch hands them over at every step) are skipped; tokens already gone are skipped."""
        batch, head, index = masks
        if self._masks_applied is not None and all(a is b for a, b in zip(masks, self._masks_applied, strict=True)):
            return
        if self._index_pos is None:
            v = view or self.views.latest or self.view_index()
            self._index_pos = v.pos
        st = self.store
        d = self._index_pos.device
        pos = self._index_pos[batch.to(d), head.to(d), index.to(d)].to(st.device)
        seen = self.seen
        drop = torch.zeros(st.batch, st.heads, seen, dtype=torch.bool, device=st.device)
        drop[batch.to(st.device), head.to(st.device), pos.clamp(min=0)] = pos >= 0
        frame_pos = st.frame("pos").to(torch.int64)
        hit = drop.gather(2, frame_pos.clamp(0, max(seen - 1, 0))) & (frame_pos >= 0)
        self._masks_applied = tuple(masks)
        if bool(hit.any()):
            self.evict(st.frame("valid") & ~hit)

    def evict(self, keep: torch.Tensor) -> None:
        """Drop every stored token where ``keep`` (``[B, H_kv, W * P]`` bool over the hot store's frame) is False.

        Budgets may differ per batch row and KV head; kept tokens are re-packed into as many pages as they need, so
        the bytes are really released. Masking stays exact because it reads each kept slot's own position.
        """
        st = self.store
        if st is None:
            raise RuntimeError(f"layer {self.layer_idx}: evict() before any token was stored")
        self._check_keep(keep)
        dropped = st.frame("valid") & ~keep
        shard = st.frame("shard").long().clamp(min=0).repeat_interleave(st.page_size, dim=-1)
        per_shard = torch.zeros(st.batch, st.heads, st.num_shards, dtype=torch.int64, device=st.device)
        self.policy.note_evicted(per_shard.scatter_add_(2, shard, dropped.long()))
        self.views.touch()
        self.evicted += st.retain(keep)
        self._min_evicted = int(self.evicted.min())
        self._fresh_kv = None

    def _check_keep(self, keep: torch.Tensor) -> None:
        """Raise ``ValueError`` unless ``keep`` is a bool mask over the hot store's frame."""
        st = self.store
        frame = (st.batch, st.heads, st.table.width() * st.page_size)
        if not isinstance(keep, torch.Tensor) or tuple(keep.shape) != frame or keep.dtype != torch.bool:
            got = f"{keep.dtype} {tuple(keep.shape)}" if isinstance(keep, torch.Tensor) else type(keep).__name__
            raise ValueError(f"keep must be a bool tensor of shape {frame}, got {got}")
        if keep.device != st.device:
            raise ValueError(f"keep must be on the layer's device {st.device}, got {keep.device}")

    def write_entries(self, view: DenseView, index: torch.Tensor, name: str, new: torch.Tensor) -> None:
        """Overwrite the ``name`` (``"keys"`` / ``"values"``) of ``view``'s entries ``index`` (``[B, H, n]``) with
        ``new`` (``[B, H, n, D]``): the values kvpress's MergingPress merges into the tokens it keeps, the keys ThinK
        prunes channels of in place. The tokens and their positions stay (``PagedStore.write_slots``)."""
        st = self.store
        check_tensor(name, new, dims=4, dtype=st.dtype, device=st.device)
        dim = st.k_dim if name == "keys" else st.v_dim
        if tuple(new.shape) != (*index.shape, dim):
            raise ValueError(
                f"layer {self.layer_idx}: {name} written to {tuple(index.shape)} entries must be "
                f"{(*index.shape, dim)}, got {tuple(new.shape)}"
            )
        slots = st.frame_slots().gather(2, view.frame_index.gather(2, index).clamp(min=0))
        ok = view.valid.gather(2, index)
        st.write_slots(name, slots[ok], new[ok])
        self.views.touch()

    def rewrite(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace everything the layer holds by ``keys`` / ``values`` (``[B, H, n, D]``: keys a kvpress press
        re-rotated or merged): entry ``i`` of every (row, head) becomes the token at position ``i`` and the layer has
        seen ``n`` positions, as a ``DynamicCache`` holding these tensors reports (re-rotated keys carry the positions
        ``0 .. n - 1``); nothing counts as evicted. All rows must keep the same ``n``."""
        st = self.store
        check_tensor("keys", keys, dims=4, dtype=st.dtype, device=st.device)
        check_tensor("values", values, dims=4, dtype=st.dtype, device=st.device)
        want = (st.batch, st.heads)
        if tuple(keys.shape[:2]) != want or keys.shape[:3] != values.shape[:3] or keys.shape[3] != st.k_dim:
            raise ValueError(
                f"{calling_press()}: layer {self.layer_idx}: rewritten keys / values must be [B, H, n, D] with "
                f"[B, H] = {want} and D = ({st.k_dim}, {st.v_dim}); got {tuple(keys.shape)} and {tuple(values.shape)}"
            )
        self.reset()
        self._store(keys, values, None)
        self._fresh_kv = None
