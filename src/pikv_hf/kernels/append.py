"""Append one decode token per (batch row, KV head) to a paged store: slot assignment and every write, one launch.

A decode step stores one new key / value per ``(row, head)``. Done with tensor operations that is some twenty
kernels per layer (find the shard's open page, open a new one when it is full, update the page table, write the
key, value, position, validity and mask bias of the slot, the page's shard, the shard's token count and, for a
routed cache, the shard's key sums / squares / min / max). Here it is one program per ``(row, head)``:

1. the token's shard ``s``: given (``shard`` ``[B, H]``), or, without one, the page-granular round robin of
   ``pikv_hf.routing.hash`` on the row's token ordinal ``t = max(pos - row_start[b], 0)``: ``(t // P) % S``;
2. its slot: the shard's open page ``open_page[b, h, s]`` when its fill ``open_fill[b, h, s] < P``, else a new
   page ``n_pages[b, h]`` at the end of the run (``n_pages`` += 1); the page table is updated in place; with a
   reserved capacity (``cap``, compiled caches) a run past it writes into its own last page (never another run's);
3. the writes: ``key`` / ``value`` rows (unless a codec stores them: ``key_pool`` None), ``pos``, ``valid = True``,
   ``bias = 0``, the page's ``page_shard``, ``count[b, h, s] += 1`` and, with ``key_sum`` given, the shard's key
   sums and squares in float32, and its min / max with ``key_min`` given, and with ``page_min`` given the key bounds
   of the slot's page (Quest's, in their own dtype; each program owns its ``(row, head)``'s shards and pages: no
   atomics), and with ``ring_slots`` given the token's entries among the store's special slots
   (``pikv_hf.store.special``): column ``n_sink + pos % window`` of ``ring_slots`` / ``ring_pos`` (the ring of recent
   tokens), and column ``t`` when the token is its row's ``t``-th real one, ``t < n_sink`` (a late sink: the row held
   fewer than ``n_sink`` tokens).

The flat slot id ``(start + local_page) * P + offset`` of every token is returned (``[B, H]`` int64).
:func:`append_one_reference` is the same in torch; it is the operator's CPU implementation (the kernel runs on CPU
only under ``TRITON_INTERPRET=1``, in its tests) and the path a compiled step traces (inductor fuses it).
``torch.ops.pikv.append_one`` wraps both, with the state tensors declared mutated, so an eager decode step on CUDA
spends one launch per layer on its append.
"""

from __future__ import annotations

import torch

from pikv_hf.kernels._host import next_power_of_2
from pikv_hf.kernels._triton import check_launchable, eager_direct, jit, tl
from pikv_hf.store.special import write_sinks


@jit
def _append_one_kernel(
    shard_ptr, row_start_ptr, pos_ptr, open_page_ptr, open_fill_ptr, n_pages_ptr, start_ptr, cap_ptr,
    key_ptr, value_ptr, k_sb, k_sh, v_sb, v_sh, key_pool_ptr, value_pool_ptr,
    pos_pool_ptr, valid_pool_ptr, bias_pool_ptr, page_shard_ptr, count_ptr, sum_ptr, sq_ptr, min_ptr, max_ptr,
    page_min_ptr, page_max_ptr, ring_slot_ptr, ring_pos_ptr, slot_ptr, H, S, P, DK, DV, N_SINK, WINDOW,
    HAS_SHARD: tl.constexpr, HAS_ROW_START: tl.constexpr, SATURATE: tl.constexpr, WRITE_KV: tl.constexpr,
    SUMMARY: tl.constexpr, BOUNDS: tl.constexpr, PAGE_BOUNDS: tl.constexpr, RING: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    pos = tl.load(pos_ptr)
    if HAS_SHARD:
        s = tl.load(shard_ptr + bh)
    else:
        t = pos.to(tl.int64)
        if HAS_ROW_START:
            t = t - tl.load(row_start_ptr + b)
        s = (tl.maximum(t, 0) // P) % S
    at = bh * S + s
    page = tl.load(open_page_ptr + at)
    fill = tl.load(open_fill_ptr + at)
    n = tl.load(n_pages_ptr + bh)
    new = fill >= P
    local = tl.where(new, n, page)
    offset = tl.where(new, 0, fill)
    tl.store(open_page_ptr + at, local)
    tl.store(open_fill_ptr + at, offset + 1)
    tl.store(n_pages_ptr + bh, n + new.to(tl.int64))
    if SATURATE:
        local = tl.minimum(local, tl.load(cap_ptr + bh) - 1)
    slot = (tl.load(start_ptr + bh) + local) * P + offset
    tl.store(slot_ptr + bh, slot)
    if RING:
        row = bh * (N_SINK + WINDOW)
        if WINDOW > 0:
            entry = row + N_SINK + pos.to(tl.int64) % WINDOW
            tl.store(ring_slot_ptr + entry, slot)
            tl.store(ring_pos_ptr + entry, pos.to(tl.int64))
        if N_SINK > 0:  # one of the row's first n_sink real tokens: its sink entry (empty: the row had fewer)
            rel = pos.to(tl.int64)
            if HAS_ROW_START:
                rel = rel - tl.load(row_start_ptr + b)
            sink = (rel >= 0) & (rel < N_SINK)
            entry = row + tl.minimum(tl.maximum(rel, 0), N_SINK - 1)
            tl.store(ring_slot_ptr + entry, slot, mask=sink)
            tl.store(ring_pos_ptr + entry, pos.to(tl.int64), mask=sink)
    tl.store(pos_pool_ptr + slot, pos.to(tl.int32))
    tl.store(valid_pool_ptr + slot, 1)
    tl.store(bias_pool_ptr + slot, 0.0)
    tl.store(page_shard_ptr + slot // P, s.to(page_shard_ptr.dtype.element_ty))
    tl.store(count_ptr + at, tl.load(count_ptr + at) + 1)
    dk = tl.arange(0, BLOCK_DK)
    mk = dk < DK
    k = tl.load(key_ptr + b * k_sb + h * k_sh + dk, mask=mk)
    if WRITE_KV:
        dv = tl.arange(0, BLOCK_DV)
        mv = dv < DV
        tl.store(key_pool_ptr + slot * DK + dk, k, mask=mk)
        v = tl.load(value_ptr + b * v_sb + h * v_sh + dv, mask=mv)
        tl.store(value_pool_ptr + slot * DV + dv, v, mask=mv)
    if SUMMARY:
        kf = k.to(tl.float32)
        row = at * DK + dk
        tl.store(sum_ptr + row, tl.load(sum_ptr + row, mask=mk) + kf, mask=mk)
        tl.store(sq_ptr + row, tl.load(sq_ptr + row, mask=mk) + kf * kf, mask=mk)
    if BOUNDS:
        kf = k.to(tl.float32)
        row = at * DK + dk
        tl.store(min_ptr + row, tl.minimum(tl.load(min_ptr + row, mask=mk), kf), mask=mk)
        tl.store(max_ptr + row, tl.maximum(tl.load(max_ptr + row, mask=mk), kf), mask=mk)
    if PAGE_BOUNDS:  # the page's bounds, stored in their dtype (the min / max of values of that dtype: exact)
        bound_ty = page_min_ptr.dtype.element_ty
        kb = k.to(bound_ty).to(tl.float32)
        row = (slot // P) * DK + dk
        low = tl.minimum(tl.load(page_min_ptr + row, mask=mk).to(tl.float32), kb)
        high = tl.maximum(tl.load(page_max_ptr + row, mask=mk).to(tl.float32), kb)
        tl.store(page_min_ptr + row, low.to(bound_ty), mask=mk)
        tl.store(page_max_ptr + row, high.to(bound_ty), mask=mk)


def round_robin_shard(row_index: torch.Tensor, page_size: int, num_shards: int) -> torch.Tensor:
    """Shard of tokens at ordinals ``row_index`` (within their row) under the page-granular round robin:
    ``(max(t, 0) // P) % S`` (``pikv_hf.routing.hash``; the kernel computes the same)."""
    return (row_index.clamp(min=0) // page_size) % num_shards


def append_one_reference(
    open_page: torch.Tensor,
    open_fill: torch.Tensor,
    n_pages: torch.Tensor,
    start: torch.Tensor,
    cap: torch.Tensor | None,
    shard: torch.Tensor | None,
    row_start: torch.Tensor | None,
    pos: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_pool: torch.Tensor | None,
    value_pool: torch.Tensor | None,
    pos_pool: torch.Tensor,
    valid_pool: torch.Tensor,
    bias_pool: torch.Tensor,
    page_shard: torch.Tensor,
    count: torch.Tensor,
    key_sum: torch.Tensor | None,
    key_sq: torch.Tensor | None,
    key_min: torch.Tensor | None,
    key_max: torch.Tensor | None,
    page_min: torch.Tensor | None = None,
    page_max: torch.Tensor | None = None,
    ring_slots: torch.Tensor | None = None,
    ring_pos: torch.Tensor | None = None,
    n_sink: int = 0,
    window: int = 0,
) -> torch.Tensor:
    """The kernel in torch (module docstring): ``open_page`` / ``open_fill`` / ``count`` ``[B, H, S]``, ``n_pages`` /
    ``start`` / ``cap`` ``[B, H]``, ``shard`` ``[B, H]`` or None, ``row_start`` ``[B]`` or None, ``key`` /
    ``value`` ``[B, H, Dk]`` / ``[B, H, Dv]``, pools ``[N, P, ...]``, ``page_shard`` ``[N]``, key statistics
    ``[B, H, S, Dk]`` float32 or None (the min / max may be None while the sums are given), page key bounds
    ``[N, Dk]`` (any float dtype) or None, the ring of recent tokens ``ring_slots`` / ``ring_pos`` ``[B, H, n_sink +
    window]`` int64 (contiguous) or None, ``pos`` ``[1]`` the tokens' position -> flat slots ``[B, H]``; every state
    tensor is updated in place."""
    b, h, n_shards = open_page.shape
    p = pos_pool.shape[1]
    if shard is None:
        t = pos.view(1, 1) if row_start is None else pos.view(1, 1) - row_start.view(b, 1)
        shard = round_robin_shard(t, p, n_shards).expand(b, h)
    s = shard.unsqueeze(-1)  # [B, H, 1]
    page, fill = open_page.gather(-1, s), open_fill.gather(-1, s)
    new = fill >= p  # the shard's open page is full, or it has none
    local = torch.where(new, n_pages.unsqueeze(-1), page)
    offset = fill.masked_fill(new, 0)
    open_page.scatter_(-1, s, local)
    open_fill.scatter_(-1, s, offset + 1)
    n_pages.add_(new.squeeze(-1))
    count.scatter_add_(-1, s, torch.ones_like(s))
    if cap is not None:  # a reserved run past its capacity overwrites its own last page
        local = torch.minimum(local, cap.unsqueeze(-1) - 1)
    slot = ((start.unsqueeze(-1) + local) * p + offset).squeeze(-1)  # [B, H]
    if ring_slots is not None:
        at = pos.view(1, 1, 1).to(torch.int64).expand(b, h, 1)
        if window:
            ring_slots.scatter_(2, n_sink + at % window, slot.unsqueeze(-1))
            ring_pos.scatter_(2, n_sink + at % window, at)
        if n_sink:  # one of the row's first n_sink real tokens: its sink entry (empty: the row had fewer)
            write_sinks(ring_slots, ring_pos, slot.unsqueeze(-1), at, row_start, n_sink)
    flat = slot.reshape(-1)
    if key_pool is not None:
        key_pool.view(-1, key_pool.shape[-1]).index_copy_(0, flat, key.reshape(-1, key.shape[-1]))
        value_pool.view(-1, value_pool.shape[-1]).index_copy_(0, flat, value.reshape(-1, value.shape[-1]))
    pos_pool.view(-1).index_fill_(0, flat, pos.view(()))
    valid_pool.view(-1).index_fill_(0, flat, True)
    bias_pool.view(-1).index_fill_(0, flat, 0.0)
    page = flat.div(p, rounding_mode="floor")
    page_shard.index_copy_(0, page, shard.reshape(-1).to(page_shard.dtype))
    if page_min is not None:  # no two (row, head)s share a page
        kb = key.reshape(-1, key.shape[-1]).to(page_min.dtype)
        at_page = page.unsqueeze(-1).expand_as(kb)
        page_min.scatter_reduce_(0, at_page, kb, "amin")
        page_max.scatter_reduce_(0, at_page, kb, "amax")
    if key_sum is not None:
        k = key.float().unsqueeze(2)  # [B, H, 1, Dk]
        at = s.unsqueeze(-1).expand(b, h, 1, k.shape[-1])
        key_sum.scatter_add_(2, at, k)
        key_sq.scatter_add_(2, at, k * k)
    if key_min is not None:
        key_min.scatter_reduce_(2, at, k, "amin")
        key_max.scatter_reduce_(2, at, k, "amax")
    return slot


def append_one_kernel(
    open_page, open_fill, n_pages, start, cap, shard, row_start, pos, key, value, key_pool, value_pool,
    pos_pool, valid_pool, bias_pool, page_shard, count, key_sum, key_sq, key_min, key_max, page_min=None, page_max=None,
    ring_slots=None, ring_pos=None, n_sink=0, window=0,
):  # fmt: skip
    """The Triton kernel with the arguments of :func:`append_one_reference` (shapes are the caller's: the operator's
    wrapper checks them). The kernel indexes ``shard`` as a contiguous ``[B, H]`` (the expert placement hands an
    expanded view: its heads share a row's element) and ``row_start`` as a contiguous ``[B]``."""
    shard = None if shard is None else shard.contiguous()
    row_start = None if row_start is None else row_start.contiguous()
    b, h, n_shards = open_page.shape
    p = pos_pool.shape[1]
    dk, dv = key.shape[-1], value.shape[-1]
    slot = torch.empty(b, h, dtype=torch.int64, device=open_page.device)
    check_launchable(_append_one_kernel, open_page.device)
    summary, bounds = key_sum is not None, key_min is not None
    page_bounds, ring = page_min is not None, ring_slots is not None
    _append_one_kernel[(b * h,)](
        shard if shard is not None else slot, row_start if row_start is not None else slot, pos,
        open_page, open_fill, n_pages, start, cap if cap is not None else slot,
        key, value, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_pool if key_pool is not None else key, value_pool if value_pool is not None else value,
        pos_pool, valid_pool, bias_pool, page_shard, count,
        *((key_sum, key_sq) if summary else (slot,) * 2), *((key_min, key_max) if bounds else (slot,) * 2),
        *((page_min, page_max) if page_bounds else (slot,) * 2), *((ring_slots, ring_pos) if ring else (slot,) * 2),
        slot, h, n_shards, p, dk, dv, n_sink, window,
        HAS_SHARD=shard is not None, HAS_ROW_START=row_start is not None, SATURATE=cap is not None,
        WRITE_KV=key_pool is not None, SUMMARY=summary, BOUNDS=bounds, PAGE_BOUNDS=page_bounds, RING=ring,
        BLOCK_DK=max(16, next_power_of_2(dk)), BLOCK_DV=max(16, next_power_of_2(dv)),
    )  # fmt: skip
    return slot


_MUTATED = ("open_page", "open_fill", "n_pages", "key_pool", "value_pool", "pos_pool", "valid_pool", "bias_pool",
            "page_shard", "count", "key_sum", "key_sq", "key_min", "key_max", "page_min", "page_max", "ring_slots",
            "ring_pos")  # fmt: skip
_SCHEMA = (
    "(Tensor(a!) open_page, Tensor(b!) open_fill, Tensor(c!) n_pages, Tensor start, Tensor? cap, Tensor? shard, "
    "Tensor? row_start, Tensor pos, Tensor key, Tensor value, Tensor(d!)? key_pool, Tensor(e!)? value_pool, "
    "Tensor(f!) pos_pool, Tensor(g!) valid_pool, Tensor(h!) bias_pool, Tensor(i!) page_shard, Tensor(j!) count, "
    "Tensor(k!)? key_sum, Tensor(l!)? key_sq, Tensor(m!)? key_min, Tensor(n!)? key_max, Tensor(o!)? page_min, "
    "Tensor(p!)? page_max, Tensor(q!)? ring_slots, Tensor(r!)? ring_pos, int n_sink, int window) -> Tensor"
)  # no defaults: torch 2.11's boxed call drops trailing arguments equal to their defaults, and its in-place version
# bump then indexed mutated arguments past the end (compiled steps failed on CUDA at "making fake tensor call")
append_one_op = torch.library.custom_op("pikv::append_one", append_one_kernel, mutates_args=_MUTATED,
                                        device_types="cuda", schema=_SCHEMA)  # fmt: skip


@append_one_op.register_kernel("cpu")
def _append_one_cpu(*args):
    return append_one_reference(*args)


@append_one_op.register_fake
def _append_one_fake(open_page, *rest):
    return open_page.new_empty(open_page.shape[:2])


# Append one token per (row, head) (arguments of :func:`append_one_reference`): ``torch.ops.pikv.append_one`` in eager
# code (one kernel launch on CUDA). Traced (``eager_direct`` asks ``_triton.traced_as_operator``): the operator on CUDA
# (its one kernel writes in place; inductor's code for the torch reference copied every layer's whole K and V pool
# twice per step on an H100: 5.7 of a compiled exact step's 8.8 GPU ms at 32k x batch 8), the torch reference on the
# CPU (inductor fuses it into the step and writes in place)
append_one = eager_direct(append_one_op, append_one_kernel, _append_one_cpu)
