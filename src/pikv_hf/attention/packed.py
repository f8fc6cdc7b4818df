"""A decode token over planned one-token pages, each (row, KV head) reading just its own pages: the CPU read of a
routed plan.

A routed plan is as wide as the store's frame (``-1`` padded past each row's pages). Gathered packed, without the
padding, and attended one (row, KV head) at a time through PyTorch's CPU flash kernel (no mask), a read costs in
proportion to the pages it reads; a plan padded to its longest row would gather and attend the padding too (a third
of a routed read at 8k x batch 4), and under ``torch.compile`` (where the plan keeps the frame's width) every slot of
the frame.

``torch.ops.pikv.packed_read`` is the whole read as one CPU operator, what a compiled CPU step calls: the compiler
sees its fixed output shapes, and its implementation runs eagerly with the data-dependent ones. Eager code gathers
into the backend's workspace and calls :func:`packed_decode` itself (``TorchBackend._attend_packed``).
"""

from __future__ import annotations

import torch

FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def packed_decode(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token over packed slots.

    Parameters
    ----------
    query : torch.Tensor
        ``[B, Hq, 1, D]``; the ``Hq // H`` query heads of a KV head read its slots together (GQA).
    keys, values : torch.Tensor
        ``[M, D]`` and ``[M, Dv]``: the slots of every (row, KV head) in turn, row-major over ``[B, H]``.
    lengths : torch.Tensor
        ``[B, H]`` slots of each (row, KV head); they sum to ``M``.
    scale : float
        Softmax scale.

    Returns
    -------
    tuple of torch.Tensor
        ``o`` ``[B, Hq, 1, Dv]`` float32 and ``lse`` ``[B, Hq, 1]`` (``o = 0``, ``lse = -inf`` for a (row, head)
        with no slot).
    """
    b, hq, _, d = query.shape
    h = lengths.shape[1]
    assert hq % h == 0 and keys.shape[0] == values.shape[0], (query.shape, lengths.shape, keys.shape, values.shape)
    g, dv = hq // h, values.shape[-1]
    counts = lengths.view(-1).tolist()
    # one (row, head) a call, each on views (split, unbind): no per-call indexing or copy into the outputs
    queries = query.reshape(b * h, 1, 1, g, d).to(keys.dtype).unbind(0)
    none = None  # the partial of a (row, head) with nothing planned: o = 0, lse = -inf
    if 0 in counts:
        none = (query.new_zeros(1, 1, g, dv, dtype=keys.dtype), query.new_full((1, 1, g), float("-inf")))
    parts = [
        FLASH_CPU(qg, k.view(1, 1, n, -1), v.view(1, 1, n, -1), 0.0, False, scale=scale)[:2] if n else none
        for qg, k, v, n in zip(queries, keys.split(counts), values.split(counts), counts, strict=True)
    ]
    o = torch.cat([part[0] for part in parts]).float().reshape(b, hq, 1, dv)
    lse = torch.cat([part[1] for part in parts]).float().reshape(b, hq, 1)
    return o, lse


def packed_slots(start: torch.Tensor, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``lengths`` (``[B, H]``, entries of each row of ``pages`` that are pages) and their pool page ids ``[M]``,
    packed row-major, from local page ids ``pages`` (``[B, H, W]``, ``-1``: none) of runs starting at ``start``
    (``[B, H]``)."""
    present = pages >= 0
    return present.sum(-1), (start.unsqueeze(-1) + pages).masked_select(present)


def _packed_read(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: torch.Tensor,
    pages: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lengths, flat = packed_slots(start, pages)
    k, v = (field.index_select(0, flat).flatten(0, 1) for field in (keys, values))  # pages of one slot
    o, lse = packed_decode(query, k, v, lengths, scale)
    return o, lse, lengths


packed_read = torch.library.custom_op("pikv::packed_read", _packed_read, mutates_args=(), device_types="cpu")
packed_read.__doc__ = """``torch.ops.pikv.packed_read(query, keys, values, start, pages, scale)``: a decode token
(``query`` ``[B, Hq, 1, D]``) over the one-token pages ``pages`` (``[B, H, W]`` local ids, ``-1`` padded) of runs
starting at ``start`` (``[B, H]``) in a pool's ``keys`` / ``values`` fields (``[N, 1, D]``, ``[N, 1, Dv]``) ->
``(o [B, Hq, 1, Dv] float32, lse [B, Hq, 1], lengths [B, H])`` (``lengths``: pages read per (row, head)). CPU only;
nothing is checked here (``TorchBackend`` calls it)."""


@packed_read.register_fake
def _packed_read_fake(query, keys, values, start, pages, scale):
    b, hq, q, _ = query.shape
    dv = values.shape[-1]
    o = query.new_empty(b, hq, q, dv, dtype=torch.float32)
    return o, query.new_empty(b, hq, q, dtype=torch.float32), pages.new_empty(pages.shape[:2], dtype=torch.int64)
