"""The plan of a routed read as one kernel: the frame pages of the selected shards and the always-read (sink /
recent) pages, compacted to the front of each (row, KV head)'s plan.

Programs ``(b * H + h, j)`` each plan block ``j`` of ``BLOCK`` frame pages of one (row, KV head), so that a long frame
is planned by many programs at once (one program per (row, head) walked 32k pages serially: 0.8 ms per layer on an
H100). A program finds the frame pages of the row's special entries still read (the store's sink and recent-window
slots, ``pikv_hf.store.special``) and counts the needed pages before its block: the selected shards' pages of the
blocks before it plus the special pages there that are not a selected shard's (each page once). A page is *full*
when its shard is selected, *needed* when full or special; the block's needed pages go to ``before + prefix sum -
1``, and the last block's program pads the rest of the plan with ``-1`` (H100, 32k pages x 8 rows x 8 KV heads:
0.26-0.33 ms per call, from 0.8). Special entries are matched against a tile's pages ``_ENTRIES`` at a time, and
only in the tiles that hold one: the match of a whole tile against every entry at once held 254 registers a thread
at sm_90 (2 programs of 4 warps per SM), this kernel 63 (8 per SM; ``tests/sm90.registers``; not yet timed on a
GPU). Output ``pages`` (``[B, H, W]`` local page indices, ``-1`` padded, as ``pikv_hf.read.plan.compact``),
``page_full`` (``[B, H, W]`` bool, True for a selected shard's page) and ``lengths`` (``[B, H]``, each row's needed
pages: the decode kernel's splits divide those, not the frame). The operator is
``torch.ops.pikv.routed_plan`` (the torch reference on the CPU, a fake implementation for tracing); it reads no
value back to the host.

Eager code on the CPU, where nothing needs to stay on a device, takes :func:`routed_plan_trimmed` instead: the same
plan built no wider than its longest row (the width read back once), in about half the reference's time at 8k
tokens in pages of one (fewer passes over the frame: the shard lookup indexes with the stored int16 ids, and the
compaction writes only the entries in use).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pikv_hf.kernels._host import cdiv, next_power_of_2
from pikv_hf.kernels._triton import check_launchable, eager_direct, jit, tl
from pikv_hf.read.plan import arange, compact
from pikv_hf.store.special import special_page_mask

_BLOCK = 2048  # frame pages per program
_TILE = 128  # pages per step within a program's block
_ENTRIES = 16  # special entries matched against a tile's pages at a time


@jit
def _special_pages(slot_ptr, spos_ptr, reach_ptr, qpos, start, r, NS, P, e):
    """``[len(e)]`` int32: the frame page of each special entry ``e`` of row ``r`` that a query at ``qpos`` still reads
    (a sink, or a recent token within the window), ``-1`` for the others."""
    e_ok = e < NS
    slot = tl.load(slot_ptr + r * NS + e, mask=e_ok, other=-1)
    spos = tl.load(spos_ptr + r * NS + e, mask=e_ok, other=0)
    read = e_ok & (slot >= 0) & (spos > qpos - tl.load(reach_ptr + e, mask=e_ok, other=0))
    return tl.where(read, slot // P - start, -1).to(tl.int32)


@jit
def _routed_plan_kernel(
    chosen_ptr, shard_ptr, slot_ptr, spos_ptr, reach_ptr, qpos_ptr, start_ptr, pages_ptr, full_ptr, len_ptr, S, W,
    NS, P,
    BLOCK: tl.constexpr, TILE: tl.constexpr, BLOCK_NS: tl.constexpr, ENTRIES: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * BLOCK
    qpos = tl.load(qpos_ptr).to(tl.int64)
    start = tl.load(start_ptr + r)
    e = tl.arange(0, BLOCK_NS)
    at_special = _special_pages(slot_ptr, spos_ptr, reach_ptr, qpos, start, r, NS, P, e)
    # the pages needed only as special ones: each counted once, and not where its shard is selected (a full page);
    # entries are compared ENTRIES at a time (a [BLOCK_NS, BLOCK_NS] match held 254 registers a thread at sm_90)
    inside = (at_special >= 0) & (at_special < W)
    sp_shard = tl.load(shard_ptr + r * W + at_special, mask=inside, other=-1)
    sp_full = tl.load(chosen_ptr + r * S + sp_shard, mask=inside & (sp_shard >= 0), other=0) != 0
    seen = e < 0
    for e0 in range(0, NS, ENTRIES):
        f = e0 + tl.arange(0, ENTRIES)
        other = _special_pages(slot_ptr, spos_ptr, reach_ptr, qpos, start, r, NS, P, f)
        earlier = (other[None, :] == at_special[:, None]) & (f[None, :] < e[:, None])
        seen = seen | (tl.max(earlier.to(tl.int32), 1) > 0)
    extra = inside & ~sp_full & ~seen
    # where this block's pages go: the needed pages of the blocks before it (full ones counted block by block)
    carry = tl.sum((extra & (at_special < lo)).to(tl.int32), 0)
    for w0 in range(0, lo, BLOCK):
        ws = w0 + tl.arange(0, BLOCK)
        shard = tl.load(shard_ptr + r * W + ws)  # every page of a block before this one is in the frame
        carry += tl.sum((tl.load(chosen_ptr + r * S + shard, mask=shard >= 0, other=0) != 0).to(tl.int32), 0)
    # this block: a page is needed when full or special; its needed pages go to carry + prefix sum - 1. A tile is
    # matched against the special entries only when one of them lies in it (a few tiles of a long frame)
    for w0 in range(lo, lo + BLOCK, TILE):
        ws = w0 + tl.arange(0, TILE)
        w_ok = ws < W
        shard = tl.load(shard_ptr + r * W + ws, mask=w_ok, other=-1)
        full = tl.load(chosen_ptr + r * S + shard, mask=w_ok & (shard >= 0), other=0) != 0
        special = ws < 0
        if tl.sum(((at_special >= w0) & (at_special < w0 + TILE)).to(tl.int32), 0) > 0:
            for e0 in range(0, NS, ENTRIES):
                f = e0 + tl.arange(0, ENTRIES)
                other = _special_pages(slot_ptr, spos_ptr, reach_ptr, qpos, start, r, NS, P, f)
                special = special | (tl.max((other[None, :] == ws[:, None]).to(tl.int32), 1) > 0)
        need = (full | special) & w_ok
        at = carry + tl.cumsum(need.to(tl.int32), 0) - 1
        tl.store(pages_ptr + r * W + at, ws.to(tl.int64), mask=need)
        tl.store(full_ptr + r * W + at, full.to(tl.uint8), mask=need)
        carry += tl.sum(need.to(tl.int32), 0)
    if lo + BLOCK >= W:  # the last block: carry is the row's needed pages; the rest of its plan is padding
        tl.store(len_ptr + r, carry)
        for w0 in range((carry // TILE) * TILE, W, TILE):
            ws = w0 + tl.arange(0, TILE)
            rest = (ws >= carry) & (ws < W)
            tl.store(pages_ptr + r * W + ws, tl.full([TILE], -1, tl.int64), mask=rest)
            tl.store(full_ptr + r * W + ws, tl.zeros([TILE], tl.uint8), mask=rest)


def routed_plan_reference(
    chosen: torch.Tensor,
    shard: torch.Tensor,
    slots: torch.Tensor,
    spos: torch.Tensor,
    reach: torch.Tensor,
    qpos: torch.Tensor,
    start: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of ``torch.ops.pikv.routed_plan``.

    Parameters
    ----------
    chosen : torch.Tensor
        ``[B, H, S]`` bool, the selected shards.
    shard : torch.Tensor
        ``[B, H, W]`` integer shard of every frame page (``-1``: unused page).
    slots, spos : torch.Tensor
        ``[B, H, E]`` int64 flat pool slots (``-1``: none) and positions of the row's sink and recent-window tokens
        (``pikv_hf.store.special.SpecialSlots``); their pages are always read.
    reach : torch.Tensor
        ``[E]`` int64: how far before the query each entry may lie and still be read.
    qpos : torch.Tensor
        ``[1]`` position of the query.
    start : torch.Tensor
        ``[B, H]`` int64 first pool page of each (row, head)'s run (``PageTable.start``).
    page_size : int
        Slots per page.

    Returns
    -------
    tuple of torch.Tensor
        ``pages`` ``[B, H, W]`` int64 local indices of the needed pages (a selected shard's, or one holding a special
        entry still read) in frame order, ``-1`` padded; ``page_full`` ``[B, H, W]`` bool, True for the entries
        that are pages of a selected shard; ``lengths`` ``[B, H]`` int32, each row's needed pages (its plan entries
        past them are padding).
    """
    s, w = chosen.shape[-1], shard.shape[-1]
    special = special_page_mask(slots, spos, reach, qpos, start, w, page_size)
    full = F.pad(chosen, (0, 1)).gather(2, shard.long() % (s + 1))  # an unused page (-1) reads column S: False
    need = full | special
    pages = compact(need, w)
    return pages, full.gather(2, pages.clamp(min=0)) & (pages >= 0), need.sum(-1, dtype=torch.int32)


def _launch(chosen, shard, slots, spos, reach, qpos, start, page_size):
    """The kernel (the operator's CUDA implementation; also CPU under ``TRITON_INTERPRET``)."""
    b, h, w = shard.shape
    dev = shard.device
    pages = torch.empty(b, h, w, dtype=torch.int64, device=dev)
    full = torch.empty(b, h, w, dtype=torch.bool, device=dev)
    lengths = torch.empty(b, h, dtype=torch.int32, device=dev)  # each row's last block writes its count
    if b * h * w == 0:
        return pages, full, lengths.zero_()
    check_launchable(_routed_plan_kernel, dev)
    ns = slots.shape[-1]
    _routed_plan_kernel[(b * h, cdiv(w, _BLOCK))](
        chosen.contiguous().view(torch.uint8), shard.contiguous(), slots.contiguous(), spos.contiguous(),
        reach.contiguous(), qpos, start.contiguous(), pages, full.view(torch.uint8), lengths, chosen.shape[-1], w, ns,
        page_size, BLOCK=_BLOCK, TILE=_TILE, BLOCK_NS=max(16, next_power_of_2(ns)), ENTRIES=_ENTRIES,
    )  # fmt: skip
    return pages, full, lengths


routed_plan_op = torch.library.custom_op(
    "pikv::routed_plan", _launch, mutates_args=(), device_types="cuda",
    schema="(Tensor chosen, Tensor shard, Tensor slots, Tensor spos, Tensor reach, Tensor qpos, Tensor start, "
    "int page_size) -> (Tensor, Tensor, Tensor)",
)  # fmt: skip


@routed_plan_op.register_kernel("cpu")
def _routed_plan_cpu(*args):
    pages, full, lengths = routed_plan_reference(*args)  # pages: a view past a scratch column; returned as its own
    return pages.clone(memory_format=torch.contiguous_format), full, lengths


_routed_plan_eager = eager_direct(routed_plan_op, _launch, _routed_plan_cpu)


@routed_plan_op.register_fake
def _routed_plan_fake(chosen, shard, *rest):
    return (
        shard.new_empty(shard.shape, dtype=torch.int64), shard.new_empty(shard.shape, dtype=torch.bool),
        shard.new_empty(shard.shape[:2], dtype=torch.int32),
    )  # fmt: skip


def routed_plan_trimmed(
    chosen: torch.Tensor,
    shard: torch.Tensor,
    slots: torch.Tensor,
    spos: torch.Tensor,
    reach: torch.Tensor,
    qpos: torch.Tensor,
    start: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The plan of :func:`routed_plan` without its padding past the longest row, for eager code on the CPU (it reads
    that width back to the host): ``pages`` ``[B, H, n]`` (``n``: the largest ``lengths`` of :func:`routed_plan`) and
    ``page_full`` ``[B, H, n]``, None for pages of one token (a special entry's page then holds just that token, so
    every planned page is read whole). Arguments and checks as :func:`routed_plan`."""
    _check(chosen, shard, slots, spos, reach, qpos, start, page_size)
    b, h, s = chosen.shape
    w = shard.shape[-1]
    # each (row, head)'s chosen row, an unused page (shard -1) reading the False column in front of it
    table = F.pad(chosen, (1, 0)).view(-1)
    ahead = torch.arange(1, b * h * (s + 1), s + 1, dtype=torch.int32, device=shard.device).view(b * h, 1)
    full = table.index_select(0, (shard.reshape(b * h, w) + ahead).view(-1)).view(b * h, w)
    special = special_page_mask(slots, spos, reach, qpos.reshape(1), start, w, page_size).view(b * h, w)
    need = full | special if page_size > 1 else full.logical_or_(special)
    at = need.cumsum(-1)
    used = int(at[:, -1].max()) if need.numel() else 0
    out = torch.full((b * h, used + 1), -1, dtype=torch.int64, device=need.device)  # column 0 takes what is not needed
    pages = out.scatter_(1, at.mul_(need), arange(w, need.device).expand(b * h, w))[:, 1:].view(b, h, used)
    if page_size == 1:
        return pages, None
    return pages, full.view(b, h, w).gather(2, pages.clamp(min=0)) & (pages >= 0)


def _check(chosen, shard, slots, spos, reach, qpos, start, page_size) -> None:
    b, h, w = shard.shape
    if chosen.dim() != 3 or tuple(chosen.shape[:2]) != (b, h) or chosen.dtype != torch.bool:
        raise ValueError(f"chosen must be bool [B={b}, H={h}, S]; got {chosen.dtype} {list(chosen.shape)}")
    e = slots.shape[-1]
    for name, t, shape in (("slots", slots, (b, h, e)), ("spos", spos, (b, h, e)), ("reach", reach, (e,)),
                           ("start", start, (b, h))):  # fmt: skip
        if tuple(t.shape) != shape or t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64 {list(shape)}; got {t.dtype} {list(t.shape)}")
    if qpos.numel() != 1:
        raise ValueError(f"qpos must hold one position; got shape {list(qpos.shape)}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1; got {page_size}")


def routed_plan(
    chosen: torch.Tensor,
    shard: torch.Tensor,
    slots: torch.Tensor,
    spos: torch.Tensor,
    reach: torch.Tensor,
    qpos: torch.Tensor,
    start: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pages, page_full, lengths)`` of a routed read (arguments and results of :func:`routed_plan_reference`), one
    operator (one kernel on CUDA). Checks shapes only (no host read)."""
    _check(chosen, shard, slots, spos, reach, qpos, start, page_size)
    return _routed_plan_eager(chosen, shard, slots, spos, reach, qpos.reshape(1), start, int(page_size))
