"""Dense, position-ordered views of a layer's stores, and what assigning to them means.

Code written for ``DynamicCache`` reads ``cache.layers[i].keys`` / ``.values`` as ``[B, H, T, D]`` tensors in position
order and writes back what it keeps: kvpress presses assign ``keys.gather(2, kept)``, kvpress's pipeline assigns
``keys[:, :, :n]``. A ``PiKVLayer`` serves those reads with a :class:`DenseView` (a copy: every stored token of every
(row, KV head), sorted by position, padded at the end with zeros where a row holds fewer tokens) and
:class:`LayerViews` interprets the assignment of a tensor as one of:

* the view itself (or the tensor it was given earlier): nothing to do;
* a prefix slice ``view[:, :, :n]`` of it: keep the positions below ``n`` (``crop(n)``: ``get_seq_length`` counts
  positions, so a length read from it is a position);
* a gather of its rows: keep exactly those tokens, per (row, head) (rows are matched bit for bit);
* anything else (keys re-rotated, tokens merged): the layer is re-packed from the assigned tensors (``rewrite``).

Keys and values are applied together, once both arrived (or at the next access), so a rejected pair changes nothing.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

from pikv_hf.checks import calling_press
from pikv_hf.store import PagedStore
from pikv_hf.store.tiers import LayerStores


class ViewedLayer(Protocol):
    """What :class:`LayerViews` needs of the layer it serves (``PiKVLayer``; named here so this module need not
    import the layer)."""

    layer_idx: int
    store: PagedStore | None
    stores: LayerStores | None
    row_start: torch.Tensor | None

    def crop(self, max_length: int) -> None: ...
    def keep(self, view: DenseView, keep: torch.Tensor) -> None: ...
    def rewrite(self, keys: torch.Tensor, values: torch.Tensor) -> None: ...
    def write_entries(self, view: DenseView, index: torch.Tensor, name: str, new: torch.Tensor) -> None: ...
    def apply_head_masks(self, masks, view: DenseView | None = None) -> None: ...
    def attention_module(self) -> torch.nn.Module | None: ...


_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class DenseView:
    """A position-ordered copy of a layer's stored tokens.

    Attributes
    ----------
    keys, values : torch.Tensor or None
        ``[B, H, T, Dk]`` and ``[B, H, T, Dv]``; ``T`` is the most tokens any (row, head) stores (None in an
        index-only view).
    frame_index : torch.Tensor
        ``[B, H, T]`` int64 index of each entry in the stores' frames (``-1`` for padding entries).
    pos : torch.Tensor
        ``[B, H, T]`` int64 sequence position of each entry (``-1`` for padding entries).
    valid : torch.Tensor
        ``[B, H, T]`` bool, False for padding entries.
    row_start : torch.Tensor
        ``[B]`` int64 position of each row's first real token (left padding takes positions, not slots).
    shard : torch.Tensor
        ``[B, H, T]`` int64 shard of each entry (``-1`` for padding entries).
    """

    keys: torch.Tensor | None
    values: torch.Tensor | None
    frame_index: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor
    row_start: torch.Tensor
    shard: torch.Tensor

    @property
    def rel_pos(self) -> torch.Tensor:
        """``[B, H, T]`` position of each entry counted from its row's first real token (``-1`` for padding
        entries): what a press ranks by, so a row of a left-padded batch scores as it would alone."""
        return torch.where(self.valid, self.pos - self.row_start.view(-1, 1, 1), -1)

    @property
    def count(self) -> torch.Tensor:
        """``[B, H]`` tokens of each (row, head)."""
        return self.valid.sum(-1)

    @property
    def contiguous(self) -> bool:
        """Whether entry ``j`` of every (row, head) is position ``j`` (nothing evicted, no padding)."""
        return bool((self.pos == torch.arange(self.pos.shape[-1], device=self.pos.device)).all())


def dense_view(stores: list[PagedStore], row_start: torch.Tensor, with_kv: bool = True) -> DenseView:
    """Every valid slot of ``stores`` (a layer's hot store, then its tiers), per (row, head), in position order
    (``with_kv=False``: only the index tensors, keys and values left None). Tiers' tokens are decoded and brought
    to the hot store's device; ``frame_index`` indexes the hot store's frame followed by each tier's."""
    store = stores[0]
    valid = torch.cat([s.frame("valid").to(store.device) for s in stores], -1)
    pos = torch.cat([s.frame("pos").to(store.device) for s in stores], -1).to(torch.int64)
    order = torch.where(valid, pos, torch.iinfo(torch.int64).max).argsort(dim=-1, stable=True)
    n = valid.sum(-1)
    length = int(n.max()) if n.numel() else 0
    order = order[..., :length]
    ok = torch.arange(length, device=pos.device) < n.unsqueeze(-1)
    keys = values = None
    if with_kv:
        decoded = [s.frame_kv() for s in stores]
        keys, values = (torch.cat([d[i].to(store.device, store.dtype) for d in decoded], 2) for i in (0, 1))

        def take(t: torch.Tensor) -> torch.Tensor:
            out = t.gather(2, order.unsqueeze(-1).expand(*order.shape, t.shape[-1]))
            return out.masked_fill_(~ok.unsqueeze(-1), 0)

        keys, values = take(keys), take(values)
    shard = torch.cat([s.frame("shard").repeat_interleave(s.page_size, -1).to(store.device) for s in stores], -1)
    return DenseView(
        keys=keys,
        values=values,
        frame_index=torch.where(ok, order, -1),
        pos=torch.where(ok, pos.gather(2, order), -1),
        valid=ok,
        row_start=row_start,
        shard=torch.where(ok, shard.long().gather(2, order), -1),
    )


def positional_kv(view: DenseView, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, length, D]`` keys and values with every stored token at its own position and zeros elsewhere (left
    padding): what an attention implementation that masks by position (with the model's own 2-D padding mask)
    reads correctly as long as nothing was evicted."""
    b, h, _, dk = view.keys.shape
    at = view.pos.clamp(min=0).unsqueeze(-1)
    out = []
    for t in (view.keys, view.values):
        full = t.new_zeros(b, h, length, t.shape[-1])
        out.append(full.scatter_(2, at.expand(*at.shape[:3], t.shape[-1]), t * view.valid.unsqueeze(-1)))
    del dk
    return out[0], out[1]


def positional_weights(weights: torch.Tensor, view: DenseView, length: int) -> torch.Tensor:
    """Attention probabilities over ``view``'s entries (``[B, Hq, q, T]``, query heads grouped by KV head) laid out
    by position (``[B, Hq, q, length]``, zero at positions not held: left padding, evicted tokens): what an eager
    attention returns over a ``DynamicCache``. Inverse: :func:`view_weights`."""
    b, hq, q, t = weights.shape
    at = _head_columns(view, hq, q)
    return weights.new_zeros(b, hq, q, length).scatter_add_(3, at, weights * _head_columns(view, hq, q, valid=True))


def view_weights(weights: torch.Tensor, view: DenseView) -> torch.Tensor:
    """Positional attention probabilities (``[B, Hq, q, length]``) read at ``view``'s entries (``[B, Hq, q, T]``, 0
    at entries that hold no token)."""
    b, hq, q, _ = weights.shape
    return weights.gather(3, _head_columns(view, hq, q)) * _head_columns(view, hq, q, valid=True)


def _head_columns(view: DenseView, hq: int, q: int, valid: bool = False) -> torch.Tensor:
    """``view.pos`` (clamped at 0), or ``view.valid`` with ``valid``, repeated for the query heads of each KV head and
    the ``q`` queries: ``[B, Hq, q, T]``."""
    b, h, t = view.pos.shape
    x = view.valid if valid else view.pos.clamp(min=0).long()
    return x.unsqueeze(2).unsqueeze(3).expand(b, h, hq // h, q, t).reshape(b, hq, q, t)


def prefix_length(new: torch.Tensor, given: torch.Tensor) -> int | None:
    """``n`` if ``new`` is ``given[:, :, :n]`` (a view of the same memory), else None."""
    if new.dim() != 4 or new.shape[:2] != given.shape[:2] or new.shape[3] != given.shape[3]:
        return None
    same_memory = new.data_ptr() == given.data_ptr() and new.stride() == given.stride()
    return new.shape[2] if same_memory and new.shape[2] <= given.shape[2] else None


def _row_hash(x: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
    """``[..., D] -> [...]`` int64 hash of each row's bit pattern (equal rows hash equally)."""
    bits = x.contiguous().view(_INT_VIEWS[x.element_size()]).to(torch.int64)
    return (bits * mult).sum(-1)


def match_rows(given: torch.Tensor, new: torch.Tensor) -> torch.Tensor | None:
    """Per (row, head), the index in ``given`` (``[B, H, T, D]``) of every row of ``new`` (``[B, H, n, D]``), or None
    if some row of ``new`` is not bit-for-bit a row of ``given``."""
    if new.dim() != 4 or new.shape[:2] != given.shape[:2] or new.shape[3] != given.shape[3]:
        return None
    if new.dtype != given.dtype or new.device != given.device or given.shape[2] == 0:
        return None if new.shape[2] else torch.zeros(*new.shape[:3], dtype=torch.int64, device=new.device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    mult = torch.randint(1, 2**62, (given.shape[-1],), generator=gen, dtype=torch.int64).to(given.device) | 1
    h_given, h_new = _row_hash(given, mult), _row_hash(new, mult)
    sorted_hash, order = h_given.sort(dim=-1, stable=True)
    at = torch.searchsorted(sorted_hash, h_new).clamp(max=given.shape[2] - 1)
    index = order.gather(2, at)
    picked = given.gather(2, index.unsqueeze(-1).expand_as(new))
    return index if torch.equal(picked, new) else None


def _is_gather(given: torch.Tensor, index: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether ``new`` is ``given`` gathered at ``index`` (``[B, H, n]``) along the token axis."""
    if new.shape[:3] != index.shape or new.shape[3] != given.shape[3] or new.dtype != given.dtype:
        return False
    return torch.equal(given.gather(2, index.unsqueeze(-1).expand_as(new)), new)


class LayerViews:
    """The dense view of one layer (taken once per write of the layer, kept until the next write, so keys and values
    come from one snapshot) and the interpretation of assignments to it."""

    def __init__(self, layer: ViewedLayer) -> None:
        # a weak reference: the layer holds this object, and a cycle would keep the layer's tensors alive after the
        # cache is deleted, until Python's cycle collector happens to run (GPU memory is not what triggers it)
        self._layer = weakref.ref(layer)
        self._view: DenseView | None = None
        self._pending: dict[str, tuple] = {}  # assignments to keys / values waiting for their partner
        self._versions: dict[str, int] = {}  # the snapshot's keys / values version counters when it was taken

    @property
    def layer(self) -> ViewedLayer:
        return self._layer()

    def __deepcopy__(self, memo: dict) -> LayerViews:
        """A copy serving the copy of the layer (``PiKVCache.fork`` deep-copies the layer, which it is in ``memo``)."""
        new = LayerViews(memo.get(id(self.layer), self.layer))
        new._view, new._pending = copy.deepcopy(self._view, memo), copy.deepcopy(self._pending, memo)
        new._versions = new._kv_versions()
        return new

    def touch(self) -> None:
        """Mark a write: the view taken before it no longer describes the store (its index tensors are kept:
        kvpress's later key masks refer to them)."""
        v = self._view
        if v is not None and v.keys is not None:
            self._view = DenseView(None, None, v.frame_index, v.pos, v.valid, v.row_start, v.shard)

    def reset(self) -> None:
        self._view = None
        self._pending.clear()

    def release(self, keep_positions: bool) -> None:
        """Drop the latest view at the end of a model forward (its keys and values, when nothing wrote since, and its
        int64 ``frame_index`` and ``shard``: 16 bytes per stored token and KV head), unless an assignment still
        waits for its partner. ``keep_positions``: keep its ``pos`` (``[B, H, T]``), the index space of head masks a
        press left on the attention module for the next forward (:attr:`latest`, read by ``apply_head_masks``)."""
        v = self._view
        if self._pending or v is None:
            return
        self._view = DenseView(None, None, None, v.pos, None, None, None) if keep_positions else None

    @property
    def latest(self) -> DenseView | None:
        """The latest view taken (its keys and values dropped after a write; only its ``pos`` after the forward that
        took it, see :meth:`release`)."""
        return self._view

    def snapshot(self) -> DenseView:
        """The view with keys and values (taken now unless the latest is still current)."""
        v = self._view
        if v is None or v.keys is None:
            self._view = v = dense_view(self.layer.stores.all(), self.layer.row_start)
            self._versions = self._kv_versions()
        return v

    def _kv_versions(self) -> dict[str, int]:
        v = self._view
        return {} if v is None or v.keys is None else {"keys": v.keys._version, "values": v.values._version}

    def index(self) -> DenseView:
        """The hot store's view index tensors alone (keys and values None), without copying keys and values."""
        v = self._view
        if v is not None and v.keys is not None and not self.layer.stores.tiers:
            return v
        return dense_view([self.layer.store], self.layer.row_start, with_kv=False)

    def assign(self, kind: str, new: torch.Tensor | None) -> None:
        """Interpret an assignment to ``keys`` / ``values``; applied once its partner arrives (or at the next
        access), after both were checked, so a rejected pair changes nothing."""
        layer = self.layer
        if layer.store is None:
            if new is None:
                return
            raise ValueError(f"layer {layer.layer_idx}: cannot assign {kind} to an empty PiKVCache layer (use update)")
        if not isinstance(new, torch.Tensor):
            raise TypeError(f"layer {layer.layer_idx}: {kind} must be a tensor; use reset() to empty the layer")
        v = self.snapshot()  # the view the partner assignment (if pending) refers to
        given = v.keys if kind == "keys" else v.values
        other = "values" if kind == "keys" else "keys"
        partner = self._pending.pop(other, None)
        if new is given:  # edited in place (ThinK zeroes key channels) or not at all
            action: tuple = ("same",) if new._version == self._versions.get(kind) else ("edited",)
        elif (n := prefix_length(new, given)) is not None:
            action = ("crop", n)
        elif partner is not None and partner[0] == "keep" and _is_gather(given, partner[1], new):
            action = partner  # values repeat rows (no position in them): check them against the keys' selection
        elif (index := match_rows(given, new)) is not None:
            action = ("keep", index)
        else:
            action = ("rewrite", new)
        if partner is None:
            self._pending[kind] = action
            return
        self._apply(*((action, partner) if kind == "keys" else (partner, action)))

    def flush(self) -> None:
        """Apply an assignment whose partner never came (only keys, or only values, were set): a selection or crop
        of one side applies to both; a rewrite of one side keeps the other."""
        if self._pending:
            ((kind, action),) = self._pending.items()
            self._pending.clear()
            other = action if action[0] != "rewrite" else ("same",)
            self._apply(*((action, other) if kind == "keys" else (other, action)))

    def _apply(self, keys_action: tuple, values_action: tuple) -> None:
        layer, v = self.layer, self._view
        for kind, action in (("keys", keys_action), ("values", values_action)):
            if action[0] == "edited":  # the same tokens, new contents: every entry written back
                self._refuse_tiers(f"an edit of the {kind} in place")
                index = torch.arange(v.pos.shape[-1], device=v.pos.device).expand_as(v.pos)
                layer.write_entries(v, index, kind, v.keys if kind == "keys" else v.values)
        keys_action, values_action = (("same",) if a[0] == "edited" else a for a in (keys_action, values_action))
        if keys_action[0] == "rewrite":  # re-rotated or merged keys: they carry positions of their own
            layer.rewrite(keys_action[1], _resolve(values_action, v.values))
        elif values_action[0] == "rewrite":  # new values (merged) for the tokens the keys name
            self._refuse_tiers("a rewrite of the values")
            layer.write_entries(v, _entries(keys_action, v), "values", values_action[1])
            self._select(keys_action, v)
        elif not _same(keys_action, values_action):
            raise ValueError(
                f"{calling_press()}: layer {layer.layer_idx} was given keys and values that select different tokens"
            )
        else:
            self._select(keys_action, v)
        masked = getattr(layer.attention_module(), "masked_key_indices", None)
        if masked is not None:  # a head-wise press (AdaKV, DuoAttention, ...) marked tokens in the view it scored
            layer.apply_head_masks(masked, view=v)

    def _select(self, action: tuple, v: DenseView) -> None:
        """Apply a crop or a selection of the view's entries."""
        layer = self.layer
        if action[0] == "crop":
            layer.crop(action[1])
        elif action[0] == "keep":
            self._refuse_tiers("a selection of its view")
            keep = torch.zeros_like(v.valid).scatter_(2, action[1], True)
            layer.keep(v, keep)

    def _refuse_tiers(self, what: str) -> None:
        layer = self.layer
        if layer.stores.tiers:
            raise ValueError(
                f"{calling_press()}: layer {layer.layer_idx} holds tokens in tiers ({', '.join(layer.stores.tiers)}); "
                f"{what} can only crop positions there: run eviction presses before compression"
            )


def _entries(action: tuple, v: DenseView) -> torch.Tensor:
    """``[B, H, n]`` the view entries an interpreted assignment of keys names, in its order."""
    if action[0] == "keep":
        return action[1]
    n = action[1] if action[0] == "crop" else v.pos.shape[-1]
    return torch.arange(n, device=v.pos.device).expand(*v.pos.shape[:2], n)


def _resolve(action: tuple, given: torch.Tensor) -> torch.Tensor:
    """The tensor an interpreted assignment of ``given`` stands for."""
    if action[0] == "rewrite":
        return action[1]
    if action[0] == "crop":
        return given[:, :, : action[1]]
    if action[0] == "keep":
        return given.gather(2, action[1].unsqueeze(-1).expand(*action[1].shape, given.shape[-1]))
    return given


def _same(a: tuple, b: tuple) -> bool:
    """Whether two interpreted assignments (``("same",)``, ``("crop", n)``, ``("keep", index)``) agree."""
    if a[0] != b[0]:
        return False
    return a[0] == "same" or (a[1] == b[1] if a[0] == "crop" else torch.equal(a[1], b[1]))
