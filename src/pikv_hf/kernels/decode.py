"""Fused paged decode attention: a few query tokens attend to the pages a page table names, reading K/V in place.

One program reads one (batch row, KV head) and one split of its table: every query head of that KV head (GQA) and
every query token share each K/V block it loads (``rows = G * q``, tiled by ``BLOCK_R`` when many). A slot ``j``
of the split is local page ``j // P`` at offset ``j % P``; its global page comes from the table, so pages of 1 and
partly read pages need no gather. A slot may be read when

    ``valid & page_exists & (page_full | sink | recent)``   (``sink``: ``0 <= pos - row_start[b] < n_sink``,
                                                              ``recent``: ``pos > qpos[-1] - window``)

and query ``i`` attends it when also ``pos <= qpos[i]`` (and ``qpos[i] - pos < sliding_window``): the rule of
``TorchBackend`` (``pikv_hf.attention.backend``). K/V of slots that may not be read are not loaded. Each split
writes a partial ``(o, lse)``; a second kernel merges the splits and the GPT-OSS sink logits with the exact
log-sum-exp merge of ``pikv_hf.attention.merge``. Logits and the softmax are float32; ``q . k`` of 16-bit inputs
accumulates in float32 and ``p @ v`` runs in float32 (``tf32x3`` on tensor cores, ``ieee`` for float32 models).

The host wrapper reads only shapes (the table width ``n``, the page size): no ``.item()``, so a decode step that
calls it can be captured in a CUDA graph. ``decode_quant.py`` runs the same kernel with dequantising loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from pikv_hf.attention.reference import masked_attention
from pikv_hf.kernels._host import cdiv, check_pages_in_range, expect, next_power_of_2
from pikv_hf.kernels._triton import check_launchable, jit, tl
from pikv_hf.kernels.gather import gather_pages_reference
from pikv_hf.read.plan import sink_or_recent

_INT = (torch.int32, torch.int64)
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
_MAX_BLOCK_R = 64  # query rows per program (more rows: more row tiles)
_MAX_BLOCK_N = 64  # slots per K/V block


# ---------------------------------------------------------------------------------------------- device helpers
@jit
def _split_bounds(len_ptr, bh, n_table, num_splits, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEN: tl.constexpr):
    """Slots ``[lo, hi)`` of this program's split: the row's table entries in use, cut into ``num_splits`` runs of
    whole blocks."""
    if HAS_LEN:
        n_slots = tl.load(len_ptr + bh).to(tl.int32) * PAGE
    else:
        n_slots = n_table * PAGE
    per_split = tl.cdiv(tl.cdiv(n_slots, num_splits), BLOCK_N) * BLOCK_N
    lo = tl.program_id(1) * per_split
    return lo, tl.minimum(lo + per_split, n_slots)


@jit
def _slot_block(
    start,
    hi,
    bh,
    table_ptr,
    full_ptr,
    pos_ptr,
    valid_ptr,
    n_table,
    row_start,
    qpos_last,
    n_sink,
    window,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_FULL: tl.constexpr,
):
    """Slots ``[start, start + BLOCK_N)`` of a table row: global page and flat pool slot (int64), position and
    whether the plan lets the slot be read."""
    j = start + tl.arange(0, BLOCK_N)
    in_split = j < hi
    local = bh * n_table + j // PAGE
    page = tl.load(table_ptr + local, mask=in_split, other=-1).to(tl.int64)
    slot = page * PAGE + j % PAGE
    ok = in_split & (page >= 0)
    ok = ok & (tl.load(valid_ptr + slot, mask=ok, other=0) != 0)
    pos = tl.load(pos_ptr + slot, mask=ok, other=0)
    if HAS_FULL:
        full = tl.load(full_ptr + local, mask=in_split, other=0) != 0
        rel = pos - row_start
        ok = ok & (full | ((rel >= 0) & (rel < n_sink)) | (pos > qpos_last - window))
    return page, slot, pos, ok


@jit
def _attend_block(
    q,
    k,
    v,
    pos,
    ok,
    qpos_rows,
    m_i,
    l_i,
    acc,
    scale,
    sliding_window,
    HAS_SLIDING: tl.constexpr,
    QK_PRECISION: tl.constexpr,
    PV_PRECISION: tl.constexpr,
):
    """Online-softmax update of rows ``(m_i, l_i, acc)`` with one K/V block (masked slots: ``-inf`` logits); ``q``
    and ``k`` are float32."""
    s = tl.dot(q, tl.trans(k), input_precision=QK_PRECISION) * scale
    allowed = ok[None, :] & (pos[None, :] <= qpos_rows[:, None])
    if HAS_SLIDING:
        allowed = allowed & (qpos_rows[:, None] - pos[None, :] < sliding_window)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PV_PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@jit
def _count_last(pos, ok, qpos_last, sliding_window, HAS_SLIDING: tl.constexpr):
    """``[BLOCK_N]`` int32: slots of the block the last query token attends (the read statistics)."""
    last = ok & (pos <= qpos_last)
    if HAS_SLIDING:
        last = last & (qpos_last - pos < sliding_window)
    return last.to(tl.int32)


@jit
def _store_split(
    o_ptr, lse_ptr, count_ptr, rows, row_ok, dv, dv_ok, m_i, l_i, acc, count, R: tl.constexpr, DV: tl.constexpr
):
    """Write the split's partial rows ``(o, lse)`` (``[B * H, splits, R, Dv]``, ``[B * H, splits, R]``) and, from
    the first row tile, the split's attended count (``[B * H, splits]``)."""
    bh, split, num_splits = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    lse = tl.where(l_i > 0, m_safe + tl.log(tl.maximum(l_i, 1e-30)), float("-inf"))
    part = (bh * num_splits + split).to(tl.int64) * R + rows
    tl.store(o_ptr + part[:, None] * DV + dv[None, :], o, mask=row_ok[:, None] & dv_ok[None, :])
    tl.store(lse_ptr + part, lse, mask=row_ok)
    if tl.program_id(2) == 0:
        tl.store(count_ptr + bh * num_splits + split, tl.sum(count, 0))


# ---------------------------------------------------------------------------------------------- kernels
@jit
def load_kv(
    kv,
    page,
    slot,
    dk,
    dv,
    k_mask,
    v_mask,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
):
    """The ``LOAD_KV`` of identity pages ``kv = (keys [N, P, Dk], values [N, P, Dv])``: the block's keys
    (``[BLOCK_N, BLOCK_DK]`` float32) and values (``[BLOCK_N, BLOCK_DV]``) at flat slots ``slot``."""
    k = tl.load(kv[0] + slot[:, None] * DK + dk[None, :], mask=k_mask, other=0.0)
    return k.to(tl.float32), tl.load(kv[1] + slot[:, None] * DV + dv[None, :], mask=v_mask, other=0.0)


@jit
def _split_kernel(
    q_ptr,
    kv,
    pos_ptr,
    valid_ptr,
    table_ptr,
    len_ptr,
    full_ptr,
    row_start_ptr,
    qpos_ptr,
    o_ptr,
    lse_ptr,
    count_ptr,
    stride_qb,
    stride_qh,
    stride_qt,
    H,
    n_table,
    num_splits,
    n_sink,
    window,
    sliding_window,
    scale,
    G: tl.constexpr,
    Q: tl.constexpr,
    PAGE: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_LEN: tl.constexpr,
    HAS_FULL: tl.constexpr,
    HAS_SLIDING: tl.constexpr,
    QK_PRECISION: tl.constexpr,
    PV_PRECISION: tl.constexpr,
    LOAD_KV: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
):
    """Program ``(b * H + h, split, row tile)``: the split's partial attention of rows ``r`` of KV head ``h``
    (query head ``h * G + r // Q``, token ``r % Q``) over the pages of table row ``(b, h)``, whose K/V the jitted
    ``LOAD_KV`` reads from the tuple ``kv`` (identity pages: :func:`load_kv`; quantised: ``decode_quant``)."""
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    rows = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < G * Q
    qi = rows % Q
    qpos_rows = tl.load(qpos_ptr + qi)
    qpos_last = tl.load(qpos_ptr + Q - 1)
    dk, dv = tl.arange(0, BLOCK_DK), tl.arange(0, BLOCK_DV)
    dk_ok, dv_ok = dk < DK, dv < DV
    q_rows = b.to(tl.int64) * stride_qb + (h * G + rows // Q) * stride_qh + qi * stride_qt
    q = tl.load(q_ptr + q_rows[:, None] + dk[None, :], mask=row_ok[:, None] & dk_ok[None, :], other=0.0)
    q = q.to(tl.float32)
    row_start = tl.load(row_start_ptr + b) if HAS_FULL else 0
    lo, hi = _split_bounds(len_ptr, bh, n_table, num_splits, PAGE, BLOCK_N, HAS_LEN)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    count = tl.zeros([BLOCK_N], tl.int32)
    for start in range(lo, hi, BLOCK_N):
        page, slot, pos, ok = _slot_block(
            start, hi, bh, table_ptr, full_ptr, pos_ptr, valid_ptr, n_table, row_start, qpos_last, n_sink, window,
            PAGE, BLOCK_N, HAS_FULL,
        )  # fmt: skip
        k_mask, v_mask = ok[:, None] & dk_ok[None, :], ok[:, None] & dv_ok[None, :]
        k, v = LOAD_KV(kv, page, slot, dk, dv, k_mask, v_mask, DK, DV, BITS, GROUP)
        m_i, l_i, acc = _attend_block(
            q, k, v, pos, ok, qpos_rows, m_i, l_i, acc, scale, sliding_window, HAS_SLIDING, QK_PRECISION, PV_PRECISION
        )
        count += _count_last(pos, ok, qpos_last, sliding_window, HAS_SLIDING)
    _store_split(o_ptr, lse_ptr, count_ptr, rows, row_ok, dv, dv_ok, m_i, l_i, acc, count, G * Q, DV)


@jit
def _merge_kernel(
    o_part_ptr,
    lse_part_ptr,
    sinks_ptr,
    o_ptr,
    lse_ptr,
    H,
    num_splits,
    R: tl.constexpr,
    G: tl.constexpr,
    Q: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Program ``row`` (of ``B * H * R``): the exact log-sum-exp merge of its splits' partials and its query head's
    sink logit (a value-less key), as ``merge_partials``; rows with nothing to attend get ``o = 0``,
    ``lse = -inf``."""
    row = tl.program_id(0)
    bh, r = row // R, row % R
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    part = (bh * num_splits + s).to(tl.int64) * R + r
    lse = tl.load(lse_part_ptr + part, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + (bh % H) * G + r // Q).to(tl.float32)
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)
    total = tl.sum(w, 0)
    if HAS_SINKS:
        total += tl.exp(sink - m_safe)
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < DV
    o = tl.load(o_part_ptr + part[:, None] * DV + dv[None, :], mask=s_ok[:, None] & dv_ok[None, :], other=0.0)
    o = tl.sum(w[:, None] * o, 0) / tl.maximum(total, 1e-30)
    tl.store(o_ptr + row.to(tl.int64) * DV + dv, o, mask=dv_ok)
    tl.store(lse_ptr + row, tl.where(total > 0, m_safe + tl.log(tl.maximum(total, 1e-30)), float("-inf")))


# ---------------------------------------------------------------------------------------------- host
@lru_cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@dataclass
class SplitLaunch:
    """A validated decode launch, identity or quantised pages alike: the split kernel's arguments after the K/V
    tuple (``args``, ``constexprs``), its grid and the partial buffers the merge reads."""

    query: torch.Tensor
    shape: tuple[int, int, int, int, int]  # B, H, G, q, Dv
    grid: tuple[int, int, int]
    args: tuple
    constexprs: dict
    o_part: torch.Tensor
    lse_part: torch.Tensor
    counts: torch.Tensor
    empty: bool  # no table entries: the split kernel has nothing to read

    def launch(self, kv: tuple[torch.Tensor, ...], load_kv, bits: int = 0, group: int = 1) -> None:
        """Run the split kernel with K/V tensors ``kv`` read by the jitted ``load_kv`` (``bits``, ``group``: its
        layout constants), or fill empty partials when there is nothing to read."""
        if self.empty:
            self.o_part.zero_()
            self.lse_part.fill_(float("-inf"))
            self.counts.zero_()
            return
        check_launchable(_split_kernel, self.query.device)
        _split_kernel[self.grid](self.query, kv, *self.args, **self.constexprs, LOAD_KV=load_kv, BITS=bits, GROUP=group)

    def merge(self, sinks: torch.Tensor | None, attended: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge the splits (and sinks) into ``o [B, Hq, q, Dv]`` and ``lse [B, Hq, q]``; fill ``attended``."""
        b, h, g, q, dv = self.shape
        splits, rows = self.grid[1], g * q
        dev = self.query.device
        o = torch.empty(b, h * g, q, dv, dtype=torch.float32, device=dev)
        lse = torch.empty(b, h * g, q, dtype=torch.float32, device=dev)
        check_launchable(_merge_kernel, dev)
        _merge_kernel[(b * h * rows,)](
            self.o_part, self.lse_part, self.lse_part if sinks is None else sinks, o, lse, h, splits,
            R=rows, G=g, Q=q, DV=dv, BLOCK_S=next_power_of_2(splits), BLOCK_DV=max(16, next_power_of_2(dv)),
            HAS_SINKS=sinks is not None,
        )  # fmt: skip
        if attended is not None:
            torch.sum(self.counts.view(b, h, splits), dim=-1, out=attended)
        return o, lse


def prepare_split_launch(
    query: torch.Tensor,
    pos: torch.Tensor,
    valid: torch.Tensor,
    pages: torch.Tensor,
    qpos: torch.Tensor,
    scale: float,
    v_dim: int,
    page_full: torch.Tensor | None,
    n_sink: int,
    window: int,
    row_start: torch.Tensor | None,
    lengths: torch.Tensor | None,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    attended: torch.Tensor | None,
    num_splits: int | None,
    check: bool,
    keys_16bit: bool,
) -> SplitLaunch:
    """Check the arguments every decode kernel shares (see :func:`decode_attention`) and size the launch from their
    shapes alone. Dot precision: ``ieee`` for float32 models; else ``q . k`` in ``tf32`` when the keys are 16-bit
    floats (exact: their products fit) and ``tf32x3`` when they are dequantised, ``p @ v`` in ``tf32x3``."""
    dev = query.device
    expect("query", query, (None,) * 4, _FLOAT, dev, contiguous=False)
    if query.stride(-1) != 1:
        raise ValueError(f"query [B, Hq, q, Dk] must have a unit stride on its last dim; got strides {query.stride()}")
    b, hq, q, dk = query.shape
    expect("pages", pages, (b, None, None), _INT, dev)
    h, n = pages.shape[1], pages.shape[2]
    if h == 0 or hq % h:
        raise ValueError(f"query heads ({hq}) must be a multiple of the page table's KV heads ({h})")
    expect("pos", pos, (None, None), (torch.int32,), dev)
    num_pages, page = pos.shape
    expect("valid", valid, (num_pages, page), (torch.bool,), dev)
    expect("qpos", qpos, (q,), _INT, dev)
    if page_full is not None:
        expect("page_full", page_full, (b, h, n), (torch.bool,), dev)
    if row_start is not None:
        expect("row_start", row_start, (b,), _INT, dev)
    if lengths is not None:
        expect("lengths", lengths, (b, h), _INT, dev)
    if sinks is not None:
        expect("sinks", sinks, (hq,), _FLOAT, dev)
    if attended is not None:
        expect("attended", attended, (b, h), (torch.int64,), dev)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if check:
        check_pages_in_range(pages, num_pages, "page table ids")
        if lengths is not None and lengths.numel() and bool(((lengths < 0) | (lengths > n)).any()):
            raise IndexError(f"lengths must be in [0, {n}] (the table width)")
    g, rows = hq // h, hq // h * q
    block_r = min(_MAX_BLOCK_R, max(16, next_power_of_2(rows)))
    block_n = min(_MAX_BLOCK_N, max(16, next_power_of_2(n * page)))
    row_tiles = cdiv(rows, block_r)
    if num_splits is None:  # two programs per SM on CUDA; the interpreter runs programs one by one
        num_splits = 1
        if dev.type == "cuda":
            sms = _sm_count(dev.index if dev.index is not None else torch.cuda.current_device())
            num_splits = cdiv(2 * sms, b * h * row_tiles)
    splits = max(1, min(num_splits, cdiv(n * page, block_n)))
    if row_start is None and page_full is not None:
        row_start = torch.zeros(b, dtype=torch.int64, device=dev)
    o_part = torch.empty(b * h, splits, rows, v_dim, dtype=torch.float32, device=dev)
    lse_part = torch.empty(b * h, splits, rows, dtype=torch.float32, device=dev)
    counts = torch.empty(b * h, splits, dtype=torch.int32, device=dev)
    fp32 = query.dtype == torch.float32
    unused = pages  # pointer of an absent optional input (its constexpr switch keeps it unread)
    args = (
        pos, valid.view(torch.uint8), pages, unused if lengths is None else lengths,
        unused if page_full is None else page_full.view(torch.uint8), unused if row_start is None else row_start,
        qpos, o_part, lse_part, counts, query.stride(0), query.stride(1), query.stride(2), h, n, splits,
        int(n_sink), int(window), 0 if sliding_window is None else int(sliding_window), float(scale),
    )  # fmt: skip
    constexprs = dict(
        G=g, Q=q, PAGE=page, DK=dk, DV=v_dim, BLOCK_R=block_r, BLOCK_N=block_n,
        BLOCK_DK=max(16, next_power_of_2(dk)), BLOCK_DV=max(16, next_power_of_2(v_dim)),
        HAS_LEN=lengths is not None, HAS_FULL=page_full is not None, HAS_SLIDING=sliding_window is not None,
        QK_PRECISION="ieee" if fp32 else "tf32" if keys_16bit else "tf32x3", PV_PRECISION="ieee" if fp32 else "tf32x3",
    )  # fmt: skip
    return SplitLaunch(
        query, (b, h, g, q, v_dim), (b * h, splits, row_tiles), args, constexprs, o_part, lse_part, counts,
        empty=n * page == 0,
    )  # fmt: skip


def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor,
    valid: torch.Tensor,
    pages: torch.Tensor,
    qpos: torch.Tensor,
    scale: float,
    page_full: torch.Tensor | None = None,
    n_sink: int = 0,
    window: int = 0,
    row_start: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    attended: torch.Tensor | None = None,
    num_splits: int | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a few query tokens over the pool pages a page table names, read in place (Triton).

    Parameters
    ----------
    query : torch.Tensor
        ``[B, Hq, q, Dk]`` (any strides but a unit last one), the dtype of ``keys``; query head ``i`` reads KV head
        ``i // (Hq // H)``.
    keys, values : torch.Tensor
        Contiguous pool fields ``[N, P, Dk]`` and ``[N, P, Dv]``.
    pos, valid : torch.Tensor
        Contiguous ``[N, P]`` int32 positions and bool valid bits.
    pages : torch.Tensor
        Contiguous ``[B, H, n]`` int32 / int64 global page ids (``-1``: skip).
    qpos : torch.Tensor
        ``[q]`` integer positions of the query tokens (ascending; the last one is the plan's ``qpos_last``).
    scale : float
        Logit scale.
    page_full : torch.Tensor, optional
        ``[B, H, n]`` bool; a page that is not full contributes only its sink and recent tokens (``ReadPlan``).
    n_sink, window : int
        Sink count and recent window of non-full pages.
    row_start : torch.Tensor, optional
        ``[B]`` integer position of each row's first real token (default 0).
    lengths : torch.Tensor, optional
        ``[B, H]`` integer: only the first ``lengths[b, h]`` entries of a table row are read, and the splits divide
        those (default: all ``n``).
    sliding_window : int, optional
        Keys with ``qpos - pos >= sliding_window`` are masked.
    sinks : torch.Tensor, optional
        ``[Hq]`` attention-sink logits (GPT-OSS).
    attended : torch.Tensor, optional
        ``[B, H]`` int64 output: slots the last query token attends per (row, KV head), computed on the device.
    num_splits : int, optional
        Splits of each table row (default: enough programs for two per SM on CUDA, 1 elsewhere).
    check : bool
        Check that the table ids are in ``[-1, N)`` and ``lengths`` in ``[0, n]`` before launch; this reads them (a
        host sync on CUDA), so an asynchronous caller that built them itself passes False.

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``o [B, Hq, q, Dv]`` float32 (zeros for a query with nothing to attend) and ``lse [B, Hq, q]`` float32
        (``-inf`` there), equal to :func:`decode_attention_reference`.
    """
    launch = prepare_split_launch(
        query, pos, valid, pages, qpos, scale, values.shape[-1], page_full, n_sink,
        window, row_start, lengths, sliding_window, sinks, attended, num_splits, check, keys_16bit=True,
    )  # fmt: skip
    num_pages, page = pos.shape
    expect("keys", keys, (num_pages, page, query.shape[-1]), (query.dtype,), query.device)
    expect("values", values, (num_pages, page, None), (query.dtype,), query.device)
    launch.launch((keys, values), load_kv)
    return launch.merge(sinks, attended)


def decode_attention_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor,
    valid: torch.Tensor,
    pages: torch.Tensor,
    qpos: torch.Tensor,
    scale: float,
    page_full: torch.Tensor | None = None,
    n_sink: int = 0,
    window: int = 0,
    row_start: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`decode_attention` (same arguments): gathers the pages named into ``[B, H, n * P]``
    slots and runs the backend's :func:`masked_attention` on them in float32 (the kernel's arithmetic on the stored
    values).

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``o [B, Hq, q, Dv]`` and ``lse [B, Hq, q]``, float32.
    """
    ok, pos_s = _reference_slots(pos, valid, pages, qpos, page_full, n_sink, window, row_start, lengths)
    b, h, c = ok.shape
    k = gather_pages_reference(keys, pages).view(b, h, c, -1).float()
    v = gather_pages_reference(values, pages).view(b, h, c, -1).float()
    o, lse, _ = masked_attention(query.float(), k, v, ok, pos_s, qpos, scale, sliding_window, sinks)
    return o, lse


def _reference_slots(
    pos: torch.Tensor,
    valid: torch.Tensor,
    pages: torch.Tensor,
    qpos: torch.Tensor,
    page_full: torch.Tensor | None,
    n_sink: int,
    window: int,
    row_start: torch.Tensor | None,
    lengths: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots a decode read may attend, in torch: ``(ok, pos)`` ``[B, H, n * P]`` over the table's pages."""
    b, h, n = pages.shape
    p = pos.shape[1]
    if lengths is not None:
        pages = torch.where(torch.arange(n, device=pages.device) < lengths.unsqueeze(-1), pages, -1)
    pos_s = gather_pages_reference(pos, pages).view(b, h, n * p)
    ok = gather_pages_reference(valid, pages).view(b, h, n * p) & (pages >= 0).repeat_interleave(p, dim=-1)
    if page_full is not None:
        start = torch.zeros(b, dtype=torch.int64, device=pos.device) if row_start is None else row_start
        ok &= page_full.repeat_interleave(p, dim=-1) | sink_or_recent(pos_s, qpos[-1], n_sink, window, start)
    return ok, pos_s
