"""The codec seam: how one layer's keys and values are held in pool pages.

A codec declares the pool fields it needs (``fields``), turns new tokens into those fields (``encode``) and pages
of those fields back into keys and values (``decode``). The identity codec stores the model's tensors as they are;
compressed codecs (quantised pages with scales, rank-r factors) plug in here without touching the store.
"""

from __future__ import annotations

import torch

from pikv_hf.store.pool import FieldSpec, PagePool


class Codec:
    """Base class of codecs (one instance per layer)."""

    name: str = ""

    def fields(self, k_dim: int, v_dim: int, dtype: torch.dtype) -> dict[str, FieldSpec]:
        """The slot fields that hold one token's key and value."""
        raise NotImplementedError

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """``[M, Dk]`` keys and ``[M, Dv]`` values -> ``[M, ...]`` per field."""
        raise NotImplementedError

    def decode(self, fields: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Field tensors ``[..., n, ...]`` (any leading shape, ``n`` slots) -> keys ``[..., n, Dk]``, values
        ``[..., n, Dv]`` in the model dtype."""
        raise NotImplementedError

    def slot_keys(self, pool: PagePool, slots: torch.Tensor) -> torch.Tensor:
        """``[M, Dk]`` keys stored at flat slot ids ``slots`` (``[M]``): decodes the pages holding them."""
        p = pool.page_size
        pages = slots.div(p, rounding_mode="floor")
        keys, _ = self.decode({name: pool.gather(name, pages) for name in self.fields_of(pool)})
        return keys[torch.arange(slots.numel(), device=slots.device), slots % p]

    def fields_of(self, pool: PagePool) -> tuple[str, ...]:
        """Names of this codec's fields in ``pool``."""
        raise NotImplementedError
