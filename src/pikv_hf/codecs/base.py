"""The codec seam: how one layer's keys and values are held in pool pages.

A codec declares the pool fields it needs (``fields``), turns new tokens into those fields (``encode``) and pages
of those fields back into keys and values (``decode``). The identity codec stores the model's tensors as they are;
compressed codecs (quantised pages with scales, rank-r factors) plug in here without touching the store.

Page-level codecs (``page_level = True``) hold fields that depend on all tokens of a page (KIVI's per-channel key
scales) or on the KV head that owns it (a projection fitted per head): the store hands them whole pages
(:class:`PageBatch`) instead of loose tokens, both when tokens arrive and when eviction or crop re-packs pages.
Their fields may be per page (``FieldSpec(per_page=True)``); ``decode`` then receives slot fields ``[..., n, ...]``
and page fields ``[..., n // P, ...]`` (the frame or a gather) or ``[N, P, ...]`` and ``[N, ...]`` (the pool), and
:func:`as_pages` brings both to ``[pages, P, ...]`` / ``[pages, ...]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pikv_hf.store.pool import FieldSpec, PagePool


@dataclass
class PageBatch:
    """Whole pages handed to a page-level codec.

    Attributes
    ----------
    keys, values : torch.Tensor
        ``[N, P, Dk]`` and ``[N, P, Dv]`` in the model dtype: the new tokens' own keys / values at ``fresh`` slots,
        the decoded content of the slots already stored elsewhere (zeros where empty).
    valid : torch.Tensor
        ``[N, P]`` bool: slots holding a token.
    fresh : torch.Tensor
        ``[N, P]`` bool: slots whose token arrives now; the others keep their per-slot fields (``old``).
    heads : torch.Tensor
        ``[N]`` int64 KV head that owns each page.
    old : dict of str to torch.Tensor
        The pages' current fields (``[N, P, ...]`` slot fields, ``[N, ...]`` page fields).
    """

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    fresh: torch.Tensor
    heads: torch.Tensor
    old: dict[str, torch.Tensor]

    def keep_old(self, name: str, new: torch.Tensor) -> torch.Tensor:
        """Slot field ``name``: ``new`` (``[N, P, ...]``) at fresh slots, the stored value elsewhere."""
        fresh = self.fresh.view(*self.fresh.shape, *([1] * (new.dim() - 2)))
        return torch.where(fresh, new.to(self.old[name].dtype), self.old[name])


def as_pages(slot: torch.Tensor, page: torch.Tensor, page_dims: int = 1) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A slot field (one trailing dim) and a page field (``page_dims`` trailing dims ``*``) of the same pages, frame
    (``[..., n, d]`` / ``[..., n // P, *]``) or pool (``[N, P, d]`` / ``[N, *]``), as ``[pages, P, d]`` and
    ``[pages, *]``, with ``P``."""
    page_shape = page.shape[page.dim() - page_dims :]
    n_pages = page.numel() // max(1, page_shape.numel())
    p = slot.numel() // max(1, slot.shape[-1]) // max(1, n_pages)
    return slot.reshape(n_pages, p, slot.shape[-1]), page.reshape(n_pages, *page_shape), p


class Codec:
    """Base class of codecs (one instance per layer)."""

    name: str = ""
    page_level: bool = False  # True: the store calls encode_pages with whole pages (module docstring)
    code_bits: int | None = None  # KIVI-layout codes of this many bits a CPU decode reads as they are (attention.codes)
    lossless: bool = False  # decoding returns the keys and values the model produced, in its dtype
    origin: str = ""  # what built it (a compressor press's description): a tier's tokens all come through one codec

    def fields(self, k_dim: int, v_dim: int, dtype: torch.dtype) -> dict[str, FieldSpec]:
        """The slot fields that hold one token's key and value."""
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the codec itself holds (a projection's maps), which its store counts as metadata."""
        return []

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """``[M, Dk]`` keys and ``[M, Dv]`` values -> ``[M, ...]`` per field."""
        raise NotImplementedError

    def encode_pages(self, batch: PageBatch) -> dict[str, torch.Tensor]:
        """Page-level codecs: the fields of whole pages (``[N, P, ...]`` slot fields, ``[N, ...]`` page fields)."""
        raise NotImplementedError

    def decode(self, fields: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Field tensors ``[..., n, ...]`` (any leading shape, ``n`` slots) -> keys ``[..., n, Dk]``, values
        ``[..., n, Dv]`` in the model dtype."""
        raise NotImplementedError

    def slot_keys(self, pool: PagePool, slots: torch.Tensor, names: tuple[str, ...]) -> torch.Tensor:
        """``[M, Dk]`` keys stored at flat slot ids ``slots`` (``[M]``) of ``pool``, whose fields ``names`` this codec
        declared: decodes the pages holding them."""
        p = pool.page_size
        pages = slots.div(p, rounding_mode="floor")
        keys, _ = self.decode({name: pool.gather(name, pages) for name in names})
        return keys[torch.arange(slots.numel(), device=slots.device), slots % p]
