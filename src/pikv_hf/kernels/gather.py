"""Paged gather: selected pages of a pool field into one contiguous buffer (for paths that need dense K/V, such as
kvpress scoring or gather + SDPA), as a Triton kernel with its torch reference.

A page is copied as raw words (the widest of 8, 4, 2 or 1 bytes that divides a page's bytes), so one kernel serves
every field dtype (keys, values, ``pos``, ``valid``, quantised codes). Page id ``-1`` yields a zero page (zero keys,
``valid`` False).
"""

from __future__ import annotations

import torch

from pikv_hf.kernels._host import cdiv, check_pages_in_range, expect
from pikv_hf.kernels._triton import check_launchable, jit, tl

_BLOCK = 1024  # words per program


@jit
def _gather_kernel(src_ptr, pages_ptr, out_ptr, n_pages, words, BLOCK: tl.constexpr):
    """Program ``(i, c)`` copies words ``[c * BLOCK, (c + 1) * BLOCK)`` of page ``pages[i]`` to row ``i``."""
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < words
    page = tl.load(pages_ptr + i + cols * 0).to(tl.int64)  # one id per lane (a scalar mask upsets the interpreter)
    ok = in_row & (page >= 0) & (page < n_pages)
    x = tl.load(src_ptr + page * words + cols, mask=ok, other=0)
    tl.store(out_ptr + i.to(tl.int64) * words + cols, x, mask=in_row)


def gather_pages_reference(field: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`gather_pages`.

    Parameters
    ----------
    field : torch.Tensor
        ``[N, ...]`` a pool field (slot field ``[N, P, ...]`` or page field ``[N, ...]``).
    pages : torch.Tensor
        Integer page ids of any shape ``S`` (``-1``: none).

    Returns
    -------
    torch.Tensor
        ``[*S, ...]``: page ``pages[s]`` of ``field``, zeros where ``pages[s] == -1``.
    """
    flat = pages.reshape(-1).long()
    g = field.index_select(0, flat.clamp(min=0))
    return g.masked_fill_((flat < 0).view(-1, *[1] * (field.dim() - 1)), 0).view(*pages.shape, *field.shape[1:])


def _as_words(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Contiguous ``t`` as ``[rows, words]`` of the widest integer word that divides a row and its alignment."""
    raw = t.reshape(rows, -1).view(torch.uint8)
    for dtype in (torch.int64, torch.int32, torch.int16):
        if raw.shape[1] % dtype.itemsize == 0 and raw.data_ptr() % dtype.itemsize == 0:
            return raw.view(dtype)
    return raw


def gather_pages(
    field: torch.Tensor, pages: torch.Tensor, out: torch.Tensor | None = None, check: bool = True
) -> torch.Tensor:
    """Pages ``pages`` of a pool field as one contiguous tensor, read by a Triton kernel.

    Parameters
    ----------
    field : torch.Tensor
        ``[N, ...]`` contiguous pool field (any dtype).
    pages : torch.Tensor
        int32 / int64 contiguous page ids of any shape ``S`` on the field's device (``-1``: a zero page).
    out : torch.Tensor, optional
        Contiguous ``[*S, ...]`` destination of the field's dtype.
    check : bool
        Check that every id is in ``[-1, N)`` before launch. This reads ``pages`` (a host sync on CUDA); pass False
        on a path that must stay asynchronous with ids it built itself (out-of-range ids then read zeros).

    Returns
    -------
    torch.Tensor
        ``[*S, ...]``, equal to :func:`gather_pages_reference`.
    """
    if field.dim() < 1:
        raise ValueError("field must have a page dim first: [N, ...]")
    expect("field", field, tuple(field.shape), (field.dtype,), field.device)
    expect("pages", pages, tuple(pages.shape), (torch.int32, torch.int64), field.device)
    shape = (*pages.shape, *field.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=field.dtype, device=field.device)
    expect("out", out, shape, (field.dtype,), field.device)
    if check:
        check_pages_in_range(pages, field.shape[0])
    if not out.numel() or not field.shape[0]:
        return out.zero_()
    check_launchable(_gather_kernel, field.device)
    src, dst = _as_words(field, field.shape[0]), _as_words(out, pages.numel())
    if src.dtype != dst.dtype:  # out is less aligned than the field: copy bytes
        src, dst = src.view(torch.uint8), dst.view(torch.uint8)
    words = src.shape[1]
    _gather_kernel[(pages.numel(), cdiv(words, _BLOCK))](src, pages, dst, field.shape[0], words, BLOCK=_BLOCK)
    return out
