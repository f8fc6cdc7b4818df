"""Writes through a page-level codec (one set of parameters per page, e.g. a shared scale): a page is re-encoded
whole from its decoded content whenever tokens land in it or its slots move."""

from __future__ import annotations

import torch

from pikv_hf.codecs import Codec
from pikv_hf.codecs.base import PageBatch
from pikv_hf.store.pool import PagePool


def encode_pages(
    pool: PagePool,
    codec: Codec,
    pages: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    fresh: torch.Tensor,
    old: dict[str, torch.Tensor],
    heads: torch.Tensor,
) -> None:
    """Encode ``keys`` / ``values`` (``[n, P, D]``) into pool pages ``pages`` (``[n]`` int64, owned by KV heads
    ``heads``); slots not ``fresh`` (``[n, P]`` bool) keep their per-slot fields from ``old``."""
    assert keys.dim() == 3 and keys.shape[:2] == fresh.shape == (pages.numel(), pool.page_size), "pages mismatch"
    batch = PageBatch(keys, values, pool.gather("valid", pages), fresh, heads, old)
    for name, t in codec.encode_pages(batch).items():
        pool[name].index_copy_(0, pages, t.to(pool[name].dtype))


def append_to_pages(
    pool: PagePool,
    codec: Codec,
    kv_fields: tuple[str, ...],
    flat: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    page_heads: torch.Tensor,
) -> None:
    """Re-encode every page that new tokens ``keys`` / ``values`` (``[M, D]``, at flat slots ``flat`` ``[M]``) land
    in, from its decoded content (its ``kv_fields``) plus the new tokens; ``page_heads``: ``[N]`` KV head of every
    pool page."""
    p = pool.page_size
    pages, inv = flat.div(p, rounding_mode="floor").unique(return_inverse=True)
    old = {name: pool.gather(name, pages) for name in kv_fields}
    dec_k, dec_v = codec.decode(old)
    at = inv * p + flat % p
    dec_k = dec_k.reshape(-1, keys.shape[-1]).index_copy(0, at, keys.to(dec_k.dtype))
    dec_v = dec_v.reshape(-1, values.shape[-1]).index_copy(0, at, values.to(dec_v.dtype))
    fresh = torch.zeros(pages.numel() * p, dtype=torch.bool, device=flat.device).index_fill_(0, at, True)
    n = pages.numel()
    encode_pages(pool, codec, pages, dec_k.view(n, p, -1), dec_v.view(n, p, -1), fresh.view(n, p), old,
                 page_heads[pages])  # fmt: skip
