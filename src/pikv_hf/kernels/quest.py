"""Quest page selection as two operators: page scores, then the top pages of each (row, KV head) in order.

``torch.ops.pikv.quest_scores``, program ``(b * H + h, page block)``: the Quest bound of each frame page,
``max_g sum_d max(q_gd * min_d, q_gd * max_d)`` (Tang et al., ICML 2024) from the pages' kept key min / max, counts a
page's valid slots (``-inf`` for an empty page) and marks the pages that hold a sink or recent-window token
(``+inf``: always read) from the store's special slots (``pikv_hf.store.special``), so one launch replaces the
bound's matmuls, the valid count and the special-page scatter.

``torch.ops.pikv.quest_select``, program ``b * H + h``: a stable descending sort of the row's scores (one key per
page: the score's bits in an order-preserving integer, then the page index, so ties go to the earlier page), of which
the first ``width`` entries are kept, ``-1`` past the row's budget of ``ceil(fraction * n_pages)`` pages and for empty
pages, and the count of the row's pages kept (what the decode kernel's splits divide). A frame of more than
``_MAX_SORT`` pages sorts with ``torch.sort`` inside the operator instead (one sort, one masking kernel).

Both are torch custom operators (a fake implementation for tracing; CPU: the torch reference, ``_scores_reference`` /
``_select_reference``, which are the policy's former torch code), so eager steps dispatch one operator each and
``torch.compile(fullgraph=True)`` takes them. Nothing here reads a tensor back to the host.
"""

from __future__ import annotations

import math

import torch

from pikv_hf.kernels._host import next_power_of_2
from pikv_hf.kernels._triton import check_launchable, eager_direct, jit, tl
from pikv_hf.routing.scores import upper_bounds
from pikv_hf.store.special import special_page_mask

_MAX_SORT = 8192  # pages of a frame sorted in registers by one program (more: torch.sort inside the operator)
_BLOCK_W = 64  # pages per program of the score kernel
# its warps: 4 held 254 registers a thread at sm_90 (the [64, 128] float32 key min / max tiles; 2 programs per SM),
# 8 hold 128 over float32 bounds, 101 over bfloat16 ones (16 warps per SM; tests/sm90.registers)
_SCORES_WARPS = 8


@jit
def _scores_kernel(
    q_ptr, kmin_ptr, kmax_ptr, valid_ptr, slot_ptr, spos_ptr, reach_ptr, qpos_ptr, start_ptr, out_ptr, W, S,
    G: tl.constexpr, D: tl.constexpr, P: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    d = tl.arange(0, BLOCK_D)
    in_w = w < W
    p = tl.arange(0, BLOCK_P)
    valid = tl.load(
        valid_ptr + bh * W * P + w[:, None] * P + p[None, :], mask=in_w[:, None] & (p[None, :] < P), other=0
    )
    count = tl.sum(valid.to(tl.int32), axis=1)
    tile = bh * W * D + w[:, None] * D + d[None, :]
    tile_ok = (count > 0)[:, None] & (d[None, :] < D)  # an empty page's +-inf bounds are not read
    kmin = tl.load(kmin_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
    kmax = tl.load(kmax_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
    bound = tl.full((BLOCK_W,), float("-inf"), tl.float32)
    for g in tl.static_range(G):
        q = tl.load(q_ptr + (bh * G + g) * D + d, mask=d < D, other=0.0).to(tl.float32)
        dot = tl.sum(tl.maximum(q, 0.0)[None, :] * kmax + tl.minimum(q, 0.0)[None, :] * kmin, axis=1)
        bound = tl.maximum(bound, dot)
    # special pages: an entry's page, when its token is still read (a sink, or a recent one within the window)
    s = tl.arange(0, BLOCK_S)
    in_s = s < S
    slot = tl.load(slot_ptr + bh * S + s, mask=in_s, other=-1)
    spos = tl.load(spos_ptr + bh * S + s, mask=in_s, other=0)
    reach = tl.load(reach_ptr + s, mask=in_s, other=0)
    read = in_s & (slot >= 0) & (spos > tl.load(qpos_ptr) - reach)
    at = tl.where(read, slot // P - tl.load(start_ptr + bh), -1)
    special = tl.max((at[None, :] == w[:, None]).to(tl.int32), axis=1) > 0
    score = tl.where(count == 0, float("-inf"), bound)
    score = tl.where(special, float("inf"), score)
    tl.store(out_ptr + bh * W + w, score, mask=in_w)


@jit
def _select_kernel(score_ptr, n_pages_ptr, out_ptr, len_ptr, W, width, fraction, BLOCK: tl.constexpr):
    bh = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    x = tl.load(score_ptr + bh * W + i, mask=i < W, other=float("-inf"))
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ties with 0.0, as in torch.sort
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # integer order of the floats
    ranked = tl.sort((key.to(tl.int64) << 32) + (2147483647 - i), descending=True)
    page = 2147483647 - (ranked & 0xFFFFFFFF)
    empty = (ranked >> 32) == -2139095041  # the key of -inf (bits 0xFF800000 ^ 0x7FFFFFFF)
    special = (ranked >> 32) == 2139095040  # the key of +inf (bits 0x7F800000): sink / window pages, always read
    budget = tl.load(n_pages_ptr + bh).to(tl.float32) * fraction
    page = tl.where(empty | ((i.to(tl.float32) >= budget) & ~special), -1, page)
    tl.store(out_ptr + bh * width + i, page, mask=i < width)
    tl.store(len_ptr + bh, tl.sum(((page >= 0) & (i < width)).to(tl.int32), 0))


def _scores_reference(qg, key_min, key_max, valid, slots, spos, reach, qpos, start, page_size):
    b, h, w = key_min.shape[:3]
    special = special_page_mask(slots, spos, reach, qpos, start, w, page_size)
    count = valid.view(b, h, w, page_size).sum(-1)
    return upper_bounds(qg, key_min, key_max, count).masked_fill_(special, float("inf"))


def _scores_launch(qg, key_min, key_max, valid, slots, spos, reach, qpos, start, page_size):
    b, h, w, d = key_min.shape
    g, n_special = qg.shape[2], slots.shape[-1]
    out = torch.empty(b, h, w, dtype=torch.float32, device=key_min.device)
    if out.numel():
        check_launchable(_scores_kernel, out.device)
        _scores_kernel[(b * h, -(-w // _BLOCK_W))](
            qg.contiguous(), key_min.contiguous(), key_max.contiguous(),
            valid.contiguous().view(torch.uint8), slots.contiguous(), spos.contiguous(), reach, qpos,
            start.contiguous(), out, w, n_special, G=g, D=d, P=page_size, BLOCK_W=_BLOCK_W, BLOCK_D=next_power_of_2(d),
            BLOCK_P=next_power_of_2(page_size), BLOCK_S=max(16, next_power_of_2(n_special)), num_warps=_SCORES_WARPS,
        )  # fmt: skip
    return out


_SCORES_SCHEMA = (
    "(Tensor qg, Tensor key_min, Tensor key_max, Tensor valid, Tensor slots, Tensor spos, Tensor reach, Tensor qpos, "
    "Tensor start, int page_size) -> Tensor"
)
quest_scores = torch.library.custom_op(
    "pikv::quest_scores", _scores_launch, mutates_args=(), device_types="cuda", schema=_SCORES_SCHEMA
)
quest_scores.__doc__ = """``torch.ops.pikv.quest_scores(qg [B, H, G, D], key_min, key_max [B, H, W, D] (float32
or the keys' dtype), valid [B, H, W * P] bool, slots, spos [B, H, S] int64, reach [S] int64, qpos [1] int64, start
[B, H] int64, page_size)`` -> ``[B, H, W]`` float32: the Quest bound of every frame page of a store, ``-inf`` for an
empty page, ``+inf`` for a page holding a special slot (flat pool slot ``slots``, at position ``spos``) that a query
at ``qpos`` still reads (``spos > qpos - reach``); ``start`` is each run's first pool page."""


@quest_scores.register_kernel("cpu")
def _quest_scores_cpu(*args):
    return _scores_reference(*args)


scores = eager_direct(quest_scores, _scores_launch, _quest_scores_cpu)  # what library code calls


@quest_scores.register_fake
def _quest_scores_fake(qg, key_min, *rest):
    return key_min.new_empty(key_min.shape[:3], dtype=torch.float32)


def _select_reference(score, n_pages, fraction, width):
    top, order = score.sort(dim=-1, descending=True, stable=True)  # ties to the earlier page
    # past the (row, head)'s budget of ceil(fraction * n_pages) pages (i < ceil(x) iff i < x) and no sink / window
    # page (+inf: always read, even past the budget), or empty
    top = top[..., :width]
    over = (torch.arange(width, device=score.device) >= (n_pages * fraction).unsqueeze(-1)) & (top < math.inf)
    pages = order[..., :width].masked_fill(over | torch.isneginf(top), -1)
    return pages, (pages >= 0).sum(-1, dtype=torch.int32)  # the kept pages lead each row


def _select_launch(score, n_pages, fraction, width):
    b, h, w = score.shape
    if w > _MAX_SORT or not score.numel():
        return _select_reference(score, n_pages, fraction, width)
    out = torch.empty(b, h, width, dtype=torch.int64, device=score.device)
    lengths = torch.empty(b, h, dtype=torch.int32, device=score.device)
    check_launchable(_select_kernel, out.device)
    _select_kernel[(b * h,)](score.contiguous(), n_pages.contiguous(), out, lengths, w, width, fraction,
                             BLOCK=max(16, next_power_of_2(w)))  # fmt: skip
    return out, lengths


quest_select = torch.library.custom_op(
    "pikv::quest_select", _select_launch, mutates_args=(), device_types="cuda",
    schema="(Tensor score, Tensor n_pages, float fraction, int width) -> (Tensor, Tensor)",
)  # fmt: skip
quest_select.__doc__ = """``torch.ops.pikv.quest_select(score [B, H, W] float32, n_pages [B, H], fraction, width)``
-> ``(pages [B, H, width] int64, lengths [B, H] int32)``: the pages of each (row, head) by descending score (ties to
the earlier page), ``-1`` at rank ``i >= fraction * n_pages`` and for ``-inf`` scores, and how many each row keeps
(they lead it). ``width <= W``."""


@quest_select.register_kernel("cpu")
def _quest_select_cpu(*args):
    return _select_reference(*args)


select = eager_direct(quest_select, _select_launch, _quest_select_cpu)


@quest_select.register_fake
def _quest_select_fake(score, n_pages, fraction, width):
    b, h = score.shape[:2]
    return score.new_empty(b, h, width, dtype=torch.int64), score.new_empty(b, h, dtype=torch.int32)


_GROUP_STORES = 4  # stores one launch of the group kernel takes (their offsets and page sizes are scalar arguments)


@jit
def _nth(n: tl.constexpr, a, b, c, d, e):
    """The ``n``-th of five scalars (``n`` a compile-time index: the stores' offsets and sizes are no tensor, so a
    launch inside a CUDA graph capture copies nothing from the host)."""
    v = e
    if n == 0:
        v = a
    if n == 1:
        v = b
    if n == 2:
        v = c
    if n == 3:
        v = d
    return v


@jit
def _group_kernel(
    score_ptr, n_pages_ptr, out_ptr, len_ptr, W, BH, fraction, O1, O2, O3, P0, P1, P2, P3, NS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    x = tl.load(score_ptr + bh * W + i, mask=i < W, other=float("-inf"))
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ties with 0.0, as in torch.sort
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # integer order of the floats
    ranked = tl.sort((key.to(tl.int64) << 32) + (2147483647 - i), descending=True)
    page = 2147483647 - (ranked & 0xFFFFFFFF).to(tl.int32)  # index over the stores' frames, back to back
    top = (ranked >> 32).to(tl.int32)
    size = tl.zeros((BLOCK,), tl.int32)
    slots = tl.zeros((1,), tl.float32)
    for s in tl.static_range(NS):
        p_s = _nth(s, P0, P1, P2, P3, 1)
        size = tl.where(page >= _nth(s, 0, O1, O2, O3, W), p_s, size)
        slots += (tl.load(n_pages_ptr + s * BH + bh) * p_s).to(tl.float32)
    before = (tl.cumsum(size, 0) - size).to(tl.float32)  # slots of the pages ranked ahead
    # the keys of +inf (bits 0x7F800000) and -inf (0xFF800000 ^ 0x7FFFFFFF)
    chosen = ((before < slots * fraction) | (top == 2139095040)) & (top != -2139095041) & (i < W)
    for s in tl.static_range(NS):
        lo = _nth(s, 0, O1, O2, O3, W)
        w_s = _nth(s + 1, 0, O1, O2, O3, W) - lo
        mine = chosen & (page >= lo) & (page < lo + w_s)
        rank = tl.cumsum(mine.to(tl.int32), 0) - 1  # the store's pages keep their order: a prefix of its ranking
        base = out_ptr + BH * lo + bh * w_s
        n = tl.sum(mine.to(tl.int32), 0)
        tl.store(base + rank, (page - lo).to(tl.int64), mask=mine)
        tl.store(base + i, tl.full((BLOCK,), -1, tl.int64), mask=(i >= n) & (i < w_s))
        tl.store(len_ptr + s * BH + bh, n)


def _group_reference(scores, n_pages, page_sizes, fraction):
    d = scores[0].device
    score = torch.cat(scores, -1)  # [B, H, sum of W]
    size = torch.cat([torch.full((x.shape[-1],), p, device=d) for x, p in zip(scores, page_sizes, strict=True)])
    slots = sum(n.to(d) * p for n, p in zip(n_pages, page_sizes, strict=True))  # [B, H] slots of every stored page
    order = score.argsort(dim=-1, descending=True, stable=True)
    ranked = score.gather(2, order)
    before = size[order].cumsum(-1) - size[order]  # slots of the pages ranked ahead
    chosen = ((before < slots.unsqueeze(-1) * fraction) | (ranked == math.inf)) & (ranked > -math.inf)
    taken = torch.zeros_like(chosen).scatter_(2, order, chosen)
    plans, counts, start = [], [], 0
    for x in scores:
        w = x.shape[-1]
        n = taken[..., start : start + w].sum(-1, dtype=torch.int32)  # this store's pages lead its own ranking
        own = x.argsort(dim=-1, descending=True, stable=True)
        plans.append(torch.where(torch.arange(w, device=d) < n.unsqueeze(-1), own, -1).reshape(-1))
        counts.append(n)
        start += w
    return torch.cat(plans), torch.stack(counts)


def _group_launch(scores, n_pages, page_sizes, fraction):
    b, h = scores[0].shape[:2]
    widths = [x.shape[-1] for x in scores]
    w = sum(widths)
    if w > _MAX_SORT or not b * h * w or len(scores) > _GROUP_STORES:
        return _group_reference(scores, n_pages, page_sizes, fraction)
    d = scores[0].device
    out = torch.empty(b * h * w, dtype=torch.int64, device=d)
    lengths = torch.empty(len(scores), b, h, dtype=torch.int32, device=d)
    off = [sum(widths[: i + 1]) for i in range(_GROUP_STORES - 1)]  # where stores 1.. start (past the last: W)
    size = list(page_sizes) + [1] * (_GROUP_STORES - len(page_sizes))
    check_launchable(_group_kernel, d)
    _group_kernel[(b * h,)](
        torch.cat(scores, -1).contiguous(), torch.stack(n_pages).contiguous(), out, lengths, w, b * h, fraction, *off,
        *size, NS=len(scores), BLOCK=max(16, next_power_of_2(w)),
    )  # fmt: skip
    return out, lengths


quest_group_select = torch.library.custom_op(
    "pikv::quest_group_select", _group_launch, mutates_args=(), device_types="cuda",
    schema="(Tensor[] scores, Tensor[] n_pages, int[] page_sizes, float fraction) -> (Tensor, Tensor)",
)  # fmt: skip
quest_group_select.__doc__ = """``torch.ops.pikv.quest_group_select(scores, n_pages, page_sizes, fraction)``: one
Quest budget over several stores (``scores[s]`` ``[B, H, W_s]`` float32 from ``quest_scores``, ``n_pages[s]``
``[B, H]`` pages in use, ``page_sizes[s]`` slots per page): pages are taken by descending score over all stores (ties
to the earlier store, then page) while the slots of the pages ranked ahead stay under ``fraction`` of the slots of
every stored page, ``+inf`` pages always, ``-inf`` never. -> ``(plans, lengths)``: flat int64
``[sum_s B * H * W_s]``, store ``s``'s plan ``[B, H, W_s]`` (its taken pages in its own descending order, ``-1``
after) at offset ``B * H * sum_{r<s} W_r``, and ``[S, B, H]`` int32, the pages each row takes from each store (they
lead its plan)."""


@quest_group_select.register_kernel("cpu")
def _quest_group_select_cpu(*args):
    return _group_reference(*args)


group_select = eager_direct(quest_group_select, _group_launch, _quest_group_select_cpu)


@quest_group_select.register_fake
def _quest_group_select_fake(scores, n_pages, page_sizes, fraction):
    b, h = scores[0].shape[:2]
    x = scores[0]
    return (
        x.new_empty(b * h * sum(s.shape[-1] for s in scores), dtype=torch.int64),
        x.new_empty(len(scores), b, h, dtype=torch.int32),
    )  # fmt: skip
