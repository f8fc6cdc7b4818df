"""What a layer learns from the model's forward and what it hands the ``"pikv"`` attention: ``ForwardState`` (set by
``pikv_hf.hf``'s forward hooks) and ``PagedKV`` (the handle ``PiKVLayer.update`` returns in place of tensors)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:  # annotations only: the store package imports the kernels, which hf.py must not load first
    from pikv_hf.store import PagedStore
    from pikv_hf.view import DenseView


class PagedLayer(Protocol):
    """What a ``PagedKV`` handle and the ``"pikv"`` attention (``pikv_hf.hf``) use of the layer behind it
    (``PiKVLayer``; named here so this module need not import the layer)."""

    layer_idx: int
    store: PagedStore | None
    has_view: bool
    sliding_window: int | None

    def kv_length(self) -> int: ...
    def view(self) -> DenseView | None: ...
    def apply_head_masks(self, masks, view: DenseView | None = None) -> None: ...
    def attend(
        self, query: torch.Tensor, scale: float, sliding_window: int | None, sinks: torch.Tensor | None
    ) -> torch.Tensor: ...


@dataclass
class ForwardState:
    """What a cache learns from the model's forward before its layers run (``pikv_hf.hf``'s hooks set it): that a
    forward is running (``active``), whether it runs the ``"pikv"`` attention, and ``present`` (``[B, q]`` bool, False
    for left padding among the new tokens; None when there is none). Outside a forward (direct ``update`` calls)
    all are off. ``rows_started``: the cache's flag once this forward ends without an error."""

    active: bool = False
    pikv: bool = False
    present: torch.Tensor | None = None
    rows_started: bool = False
    positions: tuple[int, torch.Tensor] | None = None  # (first, tensor): token_positions' latest, within a forward

    def token_positions(self, first: int, q: int, device: torch.device) -> torch.Tensor:
        """``[q]`` int64 positions ``first .. first + q - 1`` on ``device``. Within a forward the layers that store
        the same new tokens share one tensor (a decode step of 30 layers: one ``arange``, one kernel on CUDA, in place
        of 30); the cache drops it when the forward ends."""
        memo = self.positions
        if memo is not None and memo[0] == first and memo[1].numel() == q and memo[1].device == device:
            return memo[1]
        out = torch.arange(first, first + q, device=device)
        if self.active:
            self.positions = (first, out)
        return out


@dataclass(frozen=True)
class PagedKV:
    """What ``PiKVLayer.update`` returns in place of key/value tensors inside a forward that runs the ``"pikv"``
    attention; only that attention reads it. ``shape`` is ``[B, H_kv, T, D]`` with ``T`` the ``kv_length`` of
    ``get_mask_sizes``, so code that wraps attention functions and inspects sizes (kvpress's patch) keeps working."""

    layer: PagedLayer
    kind: str  # "keys" or "values"

    @property
    def shape(self) -> torch.Size:
        st = self.layer.store
        dim = st.k_dim if self.kind == "keys" else st.v_dim
        return torch.Size((st.batch, st.heads, self.layer.kv_length(), dim))

    def __setitem__(self, index, value) -> None:
        """kvpress's attention patch writes fake keys at ``(batch, head, seq)`` indices of the view a head-wise press
        scored (AdaKV, DuoAttention, ...) so that those tokens get no attention; here they are evicted instead."""
        if self.kind != "keys" or not (isinstance(index, tuple) and len(index) == 3):
            raise TypeError(
                "PiKVCache keeps K/V in pages: only kvpress's (batch, head, seq) key masking can be written to its "
                f"attention inputs, got an assignment to {self.kind}[{index!r}]"
            )
        self.layer.apply_head_masks(index)
