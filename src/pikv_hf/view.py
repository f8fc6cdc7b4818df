"""Dense, position-ordered views of a layer's store, and how an assignment to them maps back to stored slots.

Code written for ``DynamicCache`` reads ``cache.layers[i].keys`` / ``.values`` as ``[B, H, T, D]`` tensors in position
order and writes back what it keeps: kvpress presses assign ``keys.gather(2, kept)``, kvpress's pipeline assigns
``keys[:, :, :n]``. A ``PiKVLayer`` serves those reads with a :class:`DenseView` (a copy: every stored token of every
(row, KV head), sorted by position, padded at the end with zeros where a row holds fewer tokens) and interprets the
assignment of a tensor as one of:

* the view itself (or the tensor it was given earlier): nothing to do;
* a prefix slice ``view[:, :, :n]`` of it: keep the positions below ``n`` (``crop(n)``: ``get_seq_length`` counts
  positions, so a length read from it is a position);
* a gather of its rows: keep exactly those tokens, per (row, head) (rows are matched bit for bit, so a press that
  rewrites keys or values is told so instead of silently storing something else).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pikv_hf.store import PagedStore

_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class DenseView:
    """A position-ordered copy of a layer's stored tokens.

    Attributes
    ----------
    keys, values : torch.Tensor
        ``[B, H, T, Dk]`` and ``[B, H, T, Dv]``; ``T`` is the most tokens any (row, head) stores.
    frame_index : torch.Tensor
        ``[B, H, T]`` int64 index of each entry in the store's frame (``-1`` for padding entries).
    pos : torch.Tensor
        ``[B, H, T]`` int64 sequence position of each entry (``-1`` for padding entries).
    valid : torch.Tensor
        ``[B, H, T]`` bool, False for stored padding tokens and padding entries.
    """

    keys: torch.Tensor
    values: torch.Tensor
    frame_index: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor

    @property
    def contiguous(self) -> bool:
        """Whether entry ``j`` of every (row, head) is position ``j`` (nothing evicted or dropped)."""
        return bool((self.pos == torch.arange(self.pos.shape[-1], device=self.pos.device)).all())


def dense_view(store: PagedStore, *tiers: PagedStore, with_kv: bool = True) -> DenseView:
    """Every occupied slot of ``store`` (valid tokens and stored padding), per (row, head), in position order
    (``with_kv=False``: only the index tensors, keys and values left None).

    With ``tiers`` (a layer's cold stores) the view covers them too, their tokens decoded and brought to the store's
    device; its ``frame_index`` then indexes the store's frame followed by each tier's.
    """
    stores = (store, *tiers)
    pos = torch.cat([s.frame("pos").to(store.device) for s in stores], -1).to(torch.int64)
    occupied = pos >= 0
    order = torch.where(occupied, pos, torch.iinfo(torch.int64).max).argsort(dim=-1, stable=True)
    n = occupied.sum(-1)
    length = int(n.max()) if n.numel() else 0
    order = order[..., :length]
    ok = torch.arange(length, device=pos.device) < n.unsqueeze(-1)
    keys = values = None
    if with_kv:
        if tiers:
            decoded = [s.frame_kv() for s in stores]
            keys, values = (torch.cat([d[i].to(store.device, store.dtype) for d in decoded], 2) for i in (0, 1))
        else:
            keys, values = store.frame_kv()

        def take(t: torch.Tensor) -> torch.Tensor:
            out = t.gather(2, order.unsqueeze(-1).expand(*order.shape, t.shape[-1]))
            return out.masked_fill_(~ok.unsqueeze(-1), 0)

        keys, values = take(keys), take(values)
    return DenseView(
        keys=keys,
        values=values,
        frame_index=torch.where(ok, order, -1),
        pos=torch.where(ok, pos.gather(2, order), -1),
        valid=torch.cat([s.frame("valid").to(store.device) for s in stores], -1).gather(2, order) & ok,
    )


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
