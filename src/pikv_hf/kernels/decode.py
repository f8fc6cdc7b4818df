"""Fused paged decode attention: a few query tokens attend to the pages a page table names, reading K/V in place.

Stage 1, program ``(b * H + h, split, row tile)``: every query head of KV head ``h`` (GQA) and every query token
(``rows = G * q``, padded to ``BLOCK_R >= 16`` for the tensor cores) share each K/V tile it loads, so a tile is read
once for its whole group: ``q [BLOCK_R, D] @ k^T [D, BLOCK_N]``, then ``p [BLOCK_R, BLOCK_N] @ v [BLOCK_N, D]``,
16-bit inputs on the tensor cores with float32 accumulation (float32 models: ``ieee``). The table row's slots in use
(``lengths``) are cut into ``splits`` runs of whole tiles, the number of splits chosen on the host from
``B * H`` and the SM count, so a sparse plan (a narrower table) costs in proportion to what it reads. A slot ``j``
is local page ``j // P`` at offset ``j % P``: when a page is a whole number of tiles (``P % BLOCK_N == 0``; tiles
start at multiples of ``BLOCK_N``) the tile is one table entry and ``BLOCK_N`` contiguous slots; other pages (down
to one token, or a tile crossing a page boundary) read one table entry per slot, each slot a contiguous ``D`` row.
A slot may be read when

    ``valid & page_exists & (page_full | sink | recent)``   (``sink``: ``0 <= pos - row_start[b] < n_sink``,
                                                              ``recent``: ``pos > qpos[-1] - window``)

and query ``i`` attends it when also ``pos <= qpos[i]`` (and ``qpos[i] - pos < sliding_window``): the rule of
``TorchBackend`` (``pikv_hf.attention.backend``). Each split writes a partial ``(o, lse)``; stage 2 merges the
splits and the GPT-OSS sink logits with the exact log-sum-exp merge of ``pikv_hf.attention.merge``. With ``BITS > 0``
the tiles are read as codes and dequantised in registers (``decode_quant.py`` defines the layout).

Both stages run inside one torch custom operator, ``torch.ops.pikv.paged_decode`` (plain tensor / int / float
arguments, a fake implementation for tracing, CPU: the kernels under ``TRITON_INTERPRET=1``, else the torch
reference), so ``torch.compile(fullgraph=True)`` and CUDA graphs take a decode step that calls it. The host code
reads only shapes (no ``.item()``): the step does not synchronise.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

import torch

from pikv_hf.attention.reference import allowed_mask, masked_attention
from pikv_hf.kernels._host import cdiv, check_pages_in_range, expect, next_power_of_2
from pikv_hf.kernels._triton import HAVE_TRITON, check_launchable, interpreted, jit, runs_eagerly, tl, triton
from pikv_hf.kernels.gather import gather_pages_reference

_INT = (torch.int32, torch.int64)
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
_MAX_BLOCK_R = 64  # query rows per program (more rows: more row tiles)
_BLOCK_N = 64  # slots per tile for small reads (large ones autotune it on CUDA)
_PROGRAMS_PER_SM = 4  # stage-1 programs the host aims for per SM
_MIN_SPLIT_SLOTS = 256  # fewest slots worth a split of their own
_MAX_SPLITS = 64
_TUNE_FROM_SLOTS = 1024  # table rows of at least this many slots launch the autotuned kernel (CUDA)
_LOG2E = 1.4426950408889634
# (BLOCK_N, warps, stages) the autotuned kernel tries on CUDA
_CONFIGS = ((32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2), (128, 8, 3))
# tried once more with at most 128 registers a thread: at sm_90 the 64- and 128-slot tiles of 16-bit pages take
# 160-201 uncapped (12 warps per SM), capped 16 warps with a few registers spilled (tests/sm90.registers); the
# tuner decides
_REG_CAP, _CAPPED = 128, ((64, 4, 3), (128, 8, 3))


# (BLOCK_N, warps, stages, register cap) the autotuner chose on an H200 for heads of 128 channels (Llama / Qwen3
# shapes, pages of 16 and of 1, 16k-32k tokens x batch 1-8, exact and sparse reads: the "tuned" lists of
# benchmarks/results/gpu_nvidia_h200*.json and kernels_nvidia_h200.json); it never chose 8 warps
_CHOSEN = frozenset({(32, 4, 3, None), (64, 4, 3, None), (64, 4, 3, _REG_CAP), (128, 4, 2, None)})
_MEASURED_DIM = 128  # heads of at most this many channels try only the chosen configurations


def tuned_configs(configs: tuple, capped: tuple) -> list:
    """Autotune configurations of a split kernel: ``(BLOCK_N, warps, stages)`` each, then ``capped`` again with at
    most ``_REG_CAP`` registers a thread."""
    return [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=st) for n, w, st in configs] + [
        triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=st, maxnreg=_REG_CAP) for n, w, st in capped
    ]


def prune_to_chosen(chosen: frozenset):
    """The autotuner's ``early_config_prune`` for a split kernel: a launch of the shapes a GPU run measured (heads of
    at most ``_MEASURED_DIM`` channels, 16-bit pages: ``BITS`` 0 or absent) tries only the configurations ``chosen``
    there, ``(BLOCK_N, warps, stages, register cap)``; other shapes (wider heads such as MLA's, codes dequantised by
    the 16-bit kernel) try every configuration. Each configuration tried is compiled and timed on the first call of
    its key: ten took 10-32 s of a way's first decode step on an H200."""

    def prune(configs: list, named_args: dict, **kwargs: Any) -> list:
        if max(kwargs["DK"], kwargs["DV"]) > _MEASURED_DIM or kwargs.get("BITS", 0):
            return configs
        kept = [c for c in configs if (c.kwargs["BLOCK_N"], c.num_warps, c.num_stages, c.maxnreg) in chosen]
        return kept or configs

    return prune


# ---------------------------------------------------------------------------------------------- device helpers
@jit
def _tile(
    start,
    hi,
    row_table,
    run_first,
    full_row,
    pos_ptr,
    valid_ptr,
    row_start,
    qpos_last,
    n_sink,
    window,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_FULL: tl.constexpr,
    TABLE: tl.constexpr,
):
    """Slots ``[start, start + BLOCK_N)`` of a table row: global page (a scalar when the tile lies in one page),
    flat pool slot (int64), whether the slot's page exists (``load``: K/V are loaded), whether the plan lets it be
    read (``ok``) and its position. ``TABLE``: 0 the row holds global page ids, 1 local ids of the run that starts
    at global page ``run_first``, 2 no table (the run's pages in order)."""
    offs = tl.arange(0, BLOCK_N)
    in_split = start + offs < hi
    if PAGE % BLOCK_N == 0:  # one page holds the whole tile: one table entry, contiguous slots
        if TABLE == 2:
            page = run_first + start // PAGE
        else:
            page = tl.load(row_table + start // PAGE).to(tl.int64)
            if TABLE == 1:
                page = tl.where(page >= 0, page + run_first, -1)
        slot = page * PAGE + (start % PAGE + offs)
        load = in_split & (tl.zeros_like(offs) + page >= 0)  # a block mask (the interpreter refuses scalar & block)
        if HAS_FULL:
            full = tl.load(full_row + start // PAGE) != 0
    else:
        j = start + offs
        if TABLE == 2:
            page = tl.where(in_split, run_first + j // PAGE, -1)
        else:
            page = tl.load(row_table + j // PAGE, mask=in_split, other=-1).to(tl.int64)
            if TABLE == 1:
                page = tl.where(page >= 0, page + run_first, -1)
        slot = page * PAGE + j % PAGE
        load = in_split & (page >= 0)
        if HAS_FULL:
            full = tl.load(full_row + j // PAGE, mask=in_split, other=0) != 0
    ok = load & (tl.load(valid_ptr + slot, mask=load, other=0) != 0)
    pos = tl.load(pos_ptr + slot, mask=load, other=0)
    if HAS_FULL:
        rel = pos - row_start
        ok = ok & (full | ((rel >= 0) & (rel < n_sink)) | (pos > qpos_last - window))
    return page, slot, load, ok, pos


@jit
def _program(qpos_ptr, H, G: tl.constexpr, Q: tl.constexpr, BLOCK_R: tl.constexpr):
    """A split program's place: ``(b * H + h, split, row tile)`` -> ``bh``, ``b``, ``h``, its query rows ``rows``
    (row ``r``: query head ``h * G + r // Q``, token ``r % Q``), which exist, their token ``qi``, that token's
    position and the last token's position."""
    bh = tl.program_id(0)
    rows = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    qi = rows % Q
    qpos_rows = tl.load(qpos_ptr + qi).to(tl.int32)
    qpos_last = tl.load(qpos_ptr + Q - 1).to(tl.int32)
    return bh, bh // H, bh % H, rows, rows < G * Q, qi, qpos_rows, qpos_last


@jit
def _split_slots(len_ptr, bh, n_table, num_splits, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEN: tl.constexpr):
    """The slots ``[lo, hi)`` of table row ``bh`` this program's split reads (whole tiles per split)."""
    if HAS_LEN:
        n_slots = tl.load(len_ptr + bh).to(tl.int32) * PAGE
    else:
        n_slots = n_table * PAGE
    per_split = tl.cdiv(tl.cdiv(n_slots, num_splits), BLOCK_N) * BLOCK_N
    lo = tl.program_id(1) * per_split
    return lo, tl.minimum(lo + per_split, n_slots)


@jit
def _online_softmax(s, ok, pos, qpos_rows, qpos_last, m_i, count, sliding_window, HAS_SLIDING: tl.constexpr):
    """One tile of the online softmax (base 2): logits ``s`` ``[BLOCK_R, BLOCK_N]`` masked to the slots the plan
    reads at or before each row's position (and within the sliding window) -> the tile's probabilities ``p``, the
    rescale ``alpha`` of what came before, the new running max, and ``count`` plus the slots the last token
    attends."""
    attend = ok[None, :] & (pos[None, :] <= qpos_rows[:, None])
    last = ok & (pos <= qpos_last)
    if HAS_SLIDING:
        attend = attend & (qpos_rows[:, None] - pos[None, :] < sliding_window)
        last = last & (qpos_last - pos < sliding_window)
    s = tl.where(attend, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return tl.exp2(s - m_safe[:, None]), tl.exp2(m_i - m_safe), m_new, count + last.to(tl.int32)


@jit
def _store_split(lse_ptr, count_ptr, bh, rows, row_ok, m_i, l_i, count, G: tl.constexpr, Q: tl.constexpr):
    """Store a split's ``lse`` (natural log; ``-inf`` where nothing was read) and attended count; returns the
    partial's row ids (for its ``o``) and ``1 / l`` per row."""
    split, num = tl.program_id(1), tl.num_programs(1)
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(l_i > 0, (m_safe + tl.log2(tl.maximum(l_i, 1e-30))) * 0.6931471805599453, float("-inf"))
    part = (bh * num + split).to(tl.int64) * (G * Q) + rows
    tl.store(lse_ptr + part, lse, mask=row_ok)
    if tl.program_id(2) == 0:
        tl.store(count_ptr + bh * num + split, tl.sum(count, 0))
    return part, 1.0 / tl.maximum(l_i, 1e-30)


@jit
def _exact_float(x):
    """Integers in ``[0, 2**23)`` as float32, exactly, without an integer-to-float conversion: the integer as the
    mantissa of ``2**23`` (bits ``0x4B000000``), less ``2**23``: one logic op and one float add. A conversion (``I2F``)
    issues at 16 results per clock and SM on Ampere and Hopper against 128 for a float add (CUDA C++ Programming Guide,
    arithmetic instruction throughput), and a kernel reading 4-bit codes converts one per code."""
    return (x.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@jit
def _codes(codes_ptr, slot, c, mask, BYTES: tl.constexpr, BITS: tl.constexpr):
    """``[BLOCK_N, BLOCK_D]`` float32 codes of channels ``c`` of flat slots ``slot`` (``decode_quant`` layout)."""
    byte = tl.load(codes_ptr + slot[:, None] * BYTES + (c // (8 // BITS))[None, :], mask=mask, other=0)
    return _exact_float((byte.to(tl.int32) >> ((c % (8 // BITS)) * BITS)[None, :]) & ((1 << BITS) - 1))


@jit
def _row_codes(codes_ptr, slot, rows, BLOCK_N: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """``[BLOCK_N, D]`` float32 codes of whole rows (``D`` a power of two): each slot's packed bytes loaded once as a
    contiguous row, then split into their fields in registers (low bits first)."""
    byte = tl.load(codes_ptr + slot[:, None] * (D * BITS // 8) + tl.arange(0, D * BITS // 8)[None, :], mask=rows,
                   other=0).to(tl.int32)  # fmt: skip
    # one return after the constexpr branches: Triton's code generator also compiles the statements after a return
    # inside a constexpr ``if`` (an early 8-bit return let the 2-bit reshape of [BLOCK_N, D, 2, 2] fail on CUDA)
    if BITS == 8:
        codes = byte
    elif BITS == 4:
        codes = tl.reshape(tl.join(byte & 15, byte >> 4), [BLOCK_N, D])  # [.., i, a]: channel 2i + a
    else:  # channel 4i + 2a + b at [.., i, a, b]
        fields = tl.join(tl.join(byte & 3, (byte >> 4) & 3), tl.join((byte >> 2) & 3, byte >> 6))
        codes = tl.reshape(fields, [BLOCK_N, D])
    return _exact_float(codes)


@jit
def _load_kv(
    k_ptr,
    v_ptr,
    ks_ptr,
    kz_ptr,
    vs_ptr,
    vz_ptr,
    page,
    slot,
    load,
    dk,
    dv,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
):
    """Keys ``[BLOCK_N, BLOCK_DK]`` and values ``[BLOCK_N, BLOCK_DV]`` of the tile's slots whose page exists: the
    stored ones (``BITS == 0``) or float32 dequantised codes (keys per page and channel, values per slot and group of
    ``GROUP`` channels)."""
    if BLOCK_DK == DK:  # no padded channel: the mask is constant along a row, loads stay vectorised
        k_mask = load[:, None]
    else:
        k_mask = load[:, None] & (dk < DK)[None, :]
    if BLOCK_DV == DV:
        v_mask = load[:, None]
    else:
        v_mask = load[:, None] & (dv < DV)[None, :]
    if BITS == 0:
        k = tl.load(k_ptr + slot[:, None] * DK + dk[None, :], mask=k_mask, other=0.0)
        v = tl.load(v_ptr + slot[:, None] * DV + dv[None, :], mask=v_mask, other=0.0)
    else:
        if BLOCK_DK == DK:
            k = _row_codes(k_ptr, slot, k_mask, BLOCK_N, DK, BITS)
        else:
            k = _codes(k_ptr, slot, dk, k_mask, DK * BITS // 8, BITS)
        if PAGE % BLOCK_N == 0:  # one page: one scale / zero row for the tile
            at = page.to(tl.int64) * DK + dk
            row_ok = (dk < DK) & (tl.zeros_like(dk) + page >= 0)
            k_scale = tl.load(ks_ptr + at, mask=row_ok, other=0.0).to(tl.float32)
            k = k * k_scale[None, :] + tl.load(kz_ptr + at, mask=row_ok, other=0.0).to(tl.float32)[None, :]
        else:
            at = page.to(tl.int64)[:, None] * DK + dk[None, :]
            k_scale = tl.load(ks_ptr + at, mask=k_mask, other=0.0).to(tl.float32)
            k = k * k_scale + tl.load(kz_ptr + at, mask=k_mask, other=0.0).to(tl.float32)
        if BLOCK_DV == DV:  # DV and GROUP powers of two: one scale / zero load per slot and group, broadcast
            NG: tl.constexpr = DV // GROUP
            g_at = slot[:, None] * NG + tl.arange(0, NG)[None, :]
            v_scale = tl.load(vs_ptr + g_at, mask=load[:, None], other=0.0).to(tl.float32)
            v_zero = tl.load(vz_ptr + g_at, mask=load[:, None], other=0.0).to(tl.float32)
            v = tl.reshape(_row_codes(v_ptr, slot, v_mask, BLOCK_N, DV, BITS), [BLOCK_N, NG, GROUP])
            v = tl.reshape(v * v_scale[:, :, None] + v_zero[:, :, None], [BLOCK_N, DV])
        else:
            v_at = slot[:, None] * (DV // GROUP) + (dv // GROUP)[None, :]
            v_scale = tl.load(vs_ptr + v_at, mask=v_mask, other=0.0).to(tl.float32)
            v = _codes(v_ptr, slot, dv, v_mask, DV * BITS // 8, BITS) * v_scale
            v = v + tl.load(vz_ptr + v_at, mask=v_mask, other=0.0).to(tl.float32)
    return k, v


# ---------------------------------------------------------------------------------------------- kernels
def _split_kernel_fn(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    kz_ptr,
    vs_ptr,
    vz_ptr,
    pos_ptr,
    valid_ptr,
    table_ptr,
    start_ptr,
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
    qk_scale,
    G: tl.constexpr,
    Q: tl.constexpr,
    PAGE: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_LEN: tl.constexpr,
    HAS_FULL: tl.constexpr,
    HAS_SLIDING: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    TABLE: tl.constexpr,
    SPAN: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Program ``(b * H + h, split, row tile)``: the split's partial attention of rows ``r`` of KV head ``h``
    (query head ``h * G + r // Q``, token ``r % Q``) over the slots of table row ``(b, h)``; ``qk_scale`` is the
    logit scale times ``log2(e)`` (the softmax runs in base 2). ``SPAN`` (the power of two above the slots of one
    split of the table's width) is read by the autotuner only: a key, so that a short read (a sparse plan's
    narrow table, fewer tokens) gets its own tile / warp / stage choice instead of the one tuned on the first
    shape."""
    bh, b, h, rows, row_ok, qi, qpos_rows, qpos_last = _program(qpos_ptr, H, G, Q, BLOCK_R)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q_rows = b.to(tl.int64) * stride_qb + (h * G + rows // Q) * stride_qh + qi * stride_qt
    q = tl.load(q_ptr + q_rows[:, None] + dk[None, :], mask=row_ok[:, None] & (dk < DK)[None, :], other=0.0)
    q = q.to(DOT_DTYPE)
    row_start = tl.load(row_start_ptr + b).to(tl.int32) if HAS_FULL else 0
    lo, hi = _split_slots(len_ptr, bh, n_table, num_splits, PAGE, BLOCK_N, HAS_LEN)
    row_table = table_ptr + bh.to(tl.int64) * n_table
    run_first = tl.load(start_ptr + bh).to(tl.int64) if TABLE > 0 else 0
    full_row = full_ptr + bh.to(tl.int64) * n_table
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    count = tl.zeros([BLOCK_N], tl.int32)
    for start in range(lo, hi, BLOCK_N):
        page, slot, load, ok, pos = _tile(
            start, hi, row_table, run_first, full_row, pos_ptr, valid_ptr, row_start, qpos_last, n_sink, window,
            PAGE, BLOCK_N, HAS_FULL, TABLE,
        )  # fmt: skip
        k, v = _load_kv(
            k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, page, slot, load, dk, dv,
            DK, DV, BLOCK_DK, BLOCK_DV, PAGE, BLOCK_N, BITS, GROUP,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
        p, alpha, m_i, count = _online_softmax(
            s, ok, pos, qpos_rows, qpos_last, m_i, count, sliding_window, HAS_SLIDING
        )  # fmt: skip
        v = tl.where(ok[:, None], v.to(DOT_DTYPE), 0.0)  # slots not read may hold anything, even NaN
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
    part, inv = _store_split(lse_ptr, count_ptr, bh, rows, row_ok, m_i, l_i, count, G, Q)
    tl.store(o_ptr + part[:, None] * DV + dv[None, :], acc * inv[:, None], mask=row_ok[:, None] & (dv < DV)[None, :])


_split_kernel = jit(_split_kernel_fn)
_split_kernel_tuned = None  # on CUDA: the same kernel autotuned over tile sizes, warps and pipeline stages
if HAVE_TRITON and not interpreted(_split_kernel):
    _split_kernel_tuned = triton.autotune(
        configs=tuned_configs(_CONFIGS, _CAPPED),
        key=["PAGE", "DK", "DV", "BLOCK_R", "BITS", "HAS_FULL", "HAS_LEN", "SPAN", "TABLE"],
        prune_configs_by={"early_config_prune": prune_to_chosen(_CHOSEN)},
    )(triton.jit(_split_kernel_fn))
# (autotuned kernel, its key's values, the argument dtypes) -> the best configuration's launch options, filled by the
# first call of each key (launch_tuned)
_TUNED: dict[tuple, dict] = {}


def launch_tuned(kernel, grid: tuple, args: tuple, consts: dict) -> None:
    """Launch the autotuned ``kernel`` (a ``triton.autotune`` object whose key names are all in ``consts``) on
    ``grid``: the first call of a key (its values and the argument dtypes) lets the autotuner pick and compile a
    configuration; later calls launch the jitted kernel with it directly, without the autotuner's own per-call work
    (a few dicts over ~40 arguments: host time on every eager decode call)."""
    key = (kernel, *(consts[name] for name in kernel.keys), *(getattr(a, "dtype", None) for a in args))
    config = _TUNED.get(key)
    if config is None:
        kernel[grid](*args, **consts)
        _TUNED[key] = kernel.best_config.all_kwargs()
    else:
        kernel.fn[grid](*args, **consts, **config)


def tuned_choices() -> list[dict]:
    """The configurations the autotuner chose in this process, one per key of :func:`launch_tuned`: the kernel's
    name, its key's values and the launch options (tile, warps, stages, register cap), for a benchmark to record."""
    return [
        {
            "kernel": key[0].fn.fn.__name__,
            "key": dict(zip(key[0].keys, (str(v) for v in key[1 : 1 + len(key[0].keys)]), strict=True)),
            "config": {k: v for k, v in config.items() if isinstance(v, (int, float, str, bool)) or v is None},
        }
        for key, config in _TUNED.items()
    ]


@jit
def _merge_kernel(
    o_part_ptr,
    lse_part_ptr,
    sinks_ptr,
    count_ptr,
    o_ptr,
    lse_ptr,
    attended_ptr,
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
    ``lse = -inf``. The first row of each ``b * H + h`` also sums its splits' slot counts into ``attended``."""
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
    if r == 0:
        counts = tl.load(count_ptr + bh * num_splits + s, mask=s_ok, other=0)
        tl.store(attended_ptr + bh, tl.sum(counts.to(tl.int64), 0))


# ---------------------------------------------------------------------------------------------- host
@lru_cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def auto_splits(device: torch.device, programs: int, n_slots: int) -> int:
    """Splits of each table row of ``n_slots`` slots (a sparse plan's width, not the store's frame): enough stage-1
    programs for ``_PROGRAMS_PER_SM`` per SM on CUDA (``programs``: those of one split), each reading at least
    ``_MIN_SPLIT_SLOTS`` slots; a short read that this leaves with fewer programs than SMs takes splits of down to
    one tile (``_BLOCK_N`` slots) until every SM has a program. 1 elsewhere (the interpreter runs programs one by
    one)."""
    if device.type != "cuda" or programs == 0:
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    wide = min(cdiv(_PROGRAMS_PER_SM * sms, programs), cdiv(n_slots, _MIN_SPLIT_SLOTS))
    fill = min(cdiv(sms, programs), cdiv(n_slots, _BLOCK_N))
    return max(1, min(max(wide, fill), _MAX_SPLITS))


def _dot_dtype(dtype: torch.dtype, interpreter: bool):
    """Operand dtype of the kernel's dots: the model's 16-bit dtype (tensor cores, float32 accumulation), float32 for
    float32 models and for bfloat16 under the interpreter (whose bfloat16 dot is wrong in triton 3.9)."""
    if dtype == torch.float16:
        return tl.float16
    return tl.bfloat16 if dtype == torch.bfloat16 and not interpreter else tl.float32


def v_dim_of(v: torch.Tensor, bits: int) -> int:
    """Value head dim of the value field ``v`` (codes of ``bits`` bits when ``bits > 0``)."""
    return v.shape[-1] * 8 // bits if bits else v.shape[-1]


class _Geometry(NamedTuple):
    """Shape numbers of one decode launch: the query ``[b, hq, q, dk]``, value dim ``dv``, a table of ``h`` KV heads
    and ``n`` pages of ``page`` slots (``n_slots`` per row, in ``splits`` splits, ``span`` the power of two above one
    split's slots), ``rows = g * q`` query rows per KV head in ``row_tiles`` tiles of ``block_r``; ``reads``: some
    slot to read (else no split kernel runs)."""

    b: int
    hq: int
    q: int
    dk: int
    dv: int
    h: int
    n: int
    page: int
    g: int
    rows: int
    block_r: int
    row_tiles: int
    n_slots: int
    splits: int
    span: int
    reads: bool


def _geometry(query: torch.Tensor, page: int, h: int, n: int, dv: int, num_splits: int) -> _Geometry:
    """The :class:`_Geometry` of a launch (shapes only; ``num_splits <= 0``: :func:`auto_splits`)."""
    b, hq, q, dk = query.shape
    g, rows = hq // h, hq // h * q
    block_r = min(_MAX_BLOCK_R, max(16, next_power_of_2(rows)))
    row_tiles = cdiv(rows, block_r)
    n_slots = n * page
    if num_splits <= 0:
        num_splits = auto_splits(query.device, b * h * row_tiles, n_slots)
    splits = max(1, min(num_splits, cdiv(n_slots, 16)))
    span = next_power_of_2(cdiv(n_slots, splits))
    reads = n_slots > 0 and b * h > 0
    return _Geometry(b, hq, q, dk, dv, h, n, page, g, rows, block_r, row_tiles, n_slots, splits, span, reads)


def _partials(geo: _Geometry, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1's outputs ``(o [B * H, splits, rows, Dv], lse [B * H, splits, rows], counts [B * H, splits])``:
    uninitialised for the split kernel to write, or the empty partials when there is nothing to read."""
    o_part = torch.empty(geo.b * geo.h, geo.splits, geo.rows, geo.dv, dtype=torch.float32, device=dev)
    lse_part = torch.empty(geo.b * geo.h, geo.splits, geo.rows, dtype=torch.float32, device=dev)
    counts = torch.empty(geo.b * geo.h, geo.splits, dtype=torch.int32, device=dev)
    if not geo.reads:  # nothing to read: empty partials (the sinks still merge)
        o_part.zero_()
        lse_part.fill_(float("-inf"))
        counts.zero_()
    return o_part, lse_part, counts


def _merge(
    geo: _Geometry, o_part: torch.Tensor, lse_part: torch.Tensor, counts: torch.Tensor, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 2 (``_merge_kernel``) on the partials of :func:`_partials`: ``(o, lse, attended)`` of the operator."""
    b, h, rows, splits, dev = geo.b, geo.h, geo.rows, geo.splits, o_part.device
    o = torch.empty(b, geo.hq, geo.q, geo.dv, dtype=torch.float32, device=dev)
    lse = torch.empty(b, geo.hq, geo.q, dtype=torch.float32, device=dev)
    attended = torch.empty(b, h, dtype=torch.int64, device=dev)
    check_launchable(_merge_kernel, dev)
    _merge_kernel[(b * h * rows,)](
        o_part, lse_part, lse_part if sinks is None else sinks, counts, o, lse, attended, h, splits,
        R=rows, G=geo.g, Q=geo.q, DV=geo.dv, BLOCK_S=next_power_of_2(splits), BLOCK_DV=max(16, next_power_of_2(geo.dv)),
        HAS_SINKS=sinks is not None,
    )  # fmt: skip
    if rows == 0:  # no merge program ran
        attended.copy_(counts.view(b, h, splits).sum(-1))
    return o, lse, attended


def _launch(
    query, k, v, k_scale, k_zero, v_scale, v_zero, pos, valid, pages, qpos, page_full, row_start, lengths, sinks,
    scale, n_sink, window, sliding_window, bits, group, num_splits, run_start, width,
):  # fmt: skip
    """Both stages on tensors already checked by the public wrappers: ``(o, lse, attended)``. The tables are indexed
    as contiguous rows: under ``torch.compile`` the operator may be handed a strided view even where the traced
    wrapper asked for a contiguous one (a no-op ``contiguous()`` on the traced tensor), so they are made so here (no
    copy when they are)."""
    pages, page_full, lengths, run_start = (
        None if t is None else t.contiguous() for t in (pages, page_full, lengths, run_start)
    )
    h, n = (pages.shape[1], pages.shape[2]) if pages is not None else (run_start.shape[1], width)
    geo = _geometry(query, pos.shape[1], h, n, v_dim_of(v, bits), num_splits)
    dev = query.device
    o_part, lse_part, counts = _partials(geo, dev)
    if geo.reads:
        check_launchable(_split_kernel, dev)
        if page_full is not None and row_start is None:
            row_start = torch.zeros(geo.b, dtype=torch.int64, device=dev)
        unused = qpos  # pointer of an absent optional input (its constexpr switch keeps it unread)
        tuned = _split_kernel_tuned is not None and geo.n_slots >= _TUNE_FROM_SLOTS
        dot_dtype = _dot_dtype(query.dtype, interpreted(_split_kernel))
        tensors = (
            query, k, v, *(unused if t is None else t for t in (k_scale, k_zero, v_scale, v_zero)), pos,
            valid.view(torch.uint8), unused if pages is None else pages, unused if run_start is None else run_start,
            unused if lengths is None else lengths, unused if page_full is None else page_full.view(torch.uint8),
            unused if row_start is None else row_start, qpos, o_part, lse_part, counts,
        )  # fmt: skip
        table = 0 if run_start is None else 1 if pages is not None else 2
        consts = dict(
            G=geo.g, Q=geo.q, PAGE=geo.page, DK=geo.dk, DV=geo.dv, BLOCK_R=geo.block_r,
            BLOCK_DK=max(16, next_power_of_2(geo.dk)), BLOCK_DV=max(16, next_power_of_2(geo.dv)),
            HAS_LEN=lengths is not None, HAS_FULL=page_full is not None, HAS_SLIDING=sliding_window > 0,
            DOT_DTYPE=dot_dtype, DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32", BITS=bits,
            GROUP=max(group, 1), TABLE=table, SPAN=geo.span if tuned else 1,
        )  # fmt: skip
        grid = (geo.b * h, geo.splits, geo.row_tiles)
        scalars = (query.stride(0), query.stride(1), query.stride(2), h, n, geo.splits, n_sink, window, sliding_window,
                   scale * _LOG2E)  # fmt: skip
        if not tuned:
            _split_kernel[grid](*tensors, *scalars, **consts, BLOCK_N=_BLOCK_N, num_warps=4, num_stages=2)
        else:
            launch_tuned(_split_kernel_tuned, grid, (*tensors, *scalars), consts)
    return _merge(geo, o_part, lse_part, counts, sinks)


def global_pages(
    pages: torch.Tensor | None, run_start: torch.Tensor | None, width: int, lengths: torch.Tensor | None
) -> torch.Tensor:
    """``[B, H, n]`` global page ids (``-1``: none) of a read's table: ``pages`` itself (global ids), the local ids
    ``pages`` of the runs starting at ``run_start`` (``[B, H]``), or with ``pages`` None each run's first
    ``lengths`` pages in a frame of ``width``."""
    if run_start is None:
        return pages
    if pages is None:
        local = torch.arange(width, device=run_start.device)
        return torch.where(local < lengths.unsqueeze(-1), run_start.unsqueeze(-1) + local, -1)
    return torch.where(pages >= 0, run_start.unsqueeze(-1) + pages, -1)


def _reference_op(
    query, k, v, k_scale, k_zero, v_scale, v_zero, pos, valid, pages, qpos, page_full, row_start, lengths, sinks,
    scale, n_sink, window, sliding_window, bits, group, num_splits, run_start, width,
):  # fmt: skip
    """The operator in torch (CPU without the Triton interpreter): :func:`decode_attention_reference` on the stored
    or dequantised pages, and the slots the last query attends."""
    if bits:
        from pikv_hf.kernels.decode_quant import QuantPages, dequantize_pages

        k, v = dequantize_pages(QuantPages(k, k_scale, k_zero, v, v_scale, v_zero, bits))
    pages = global_pages(pages, run_start, width, lengths)
    window_arg = sliding_window if sliding_window > 0 else None
    ok, pos_s = _reference_slots(pos, valid, pages, qpos, page_full, n_sink, window, row_start, lengths)
    o, lse = decode_attention_reference(
        query, k, v, pos, valid, pages, qpos, scale, page_full, n_sink, window, row_start, lengths, window_arg, sinks
    )
    attended = allowed_mask(ok, pos_s, qpos[-1:], window_arg)[:, :, 0].sum(-1)
    return o, lse, attended


_SCHEMA = (
    "(Tensor query, Tensor k, Tensor v, Tensor? k_scale, Tensor? k_zero, Tensor? v_scale, Tensor? v_zero, "
    "Tensor pos, Tensor valid, Tensor? pages, Tensor qpos, Tensor? page_full, Tensor? row_start, Tensor? lengths, "
    "Tensor? sinks, float scale, int n_sink, int window, int sliding_window, int bits, int group, int num_splits, "
    "Tensor? run_start, int width) "
    "-> (Tensor, Tensor, Tensor)"
)
paged_decode = torch.library.custom_op("pikv::paged_decode", _launch, mutates_args=(), device_types="cuda",
                                       schema=_SCHEMA)  # fmt: skip
paged_decode.__doc__ = """``torch.ops.pikv.paged_decode``: both stages of the fused decode as one operator (the
arguments of :func:`decode_attention`, ``k`` / ``v`` the stored fields or, with ``bits > 0``, the codes of
``decode_quant`` with their scales and zeros; ``sliding_window`` 0: none; ``num_splits`` 0: chosen on the host;
``run_start`` / ``width``: see :func:`global_pages`) ->
``(o [B, Hq, q, Dv], lse [B, Hq, q], attended [B, H])``. No argument is checked here: call the wrappers."""


@paged_decode.register_kernel("cpu")
def _paged_decode_cpu(*args):
    return (_launch if interpreted(_split_kernel) else _reference_op)(*args)


@paged_decode.register_fake
def _paged_decode_fake(query, k, v, k_scale, k_zero, v_scale, v_zero, pos, valid, pages, *rest):
    bits, run_start = rest[-5], rest[-2]
    b, hq, q, _ = query.shape
    dv = v_dim_of(v, bits)
    return (
        query.new_empty(b, hq, q, dv, dtype=torch.float32),
        query.new_empty(b, hq, q, dtype=torch.float32),
        query.new_empty(b, (pages if pages is not None else run_start).shape[1], dtype=torch.int64),
    )


def check_decode_args(
    query: torch.Tensor,
    pos: torch.Tensor,
    valid: torch.Tensor,
    pages: torch.Tensor,
    qpos: torch.Tensor,
    page_full: torch.Tensor | None,
    row_start: torch.Tensor | None,
    lengths: torch.Tensor | None,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    check: bool,
    run_start: torch.Tensor | None = None,
    width: int | None = None,
) -> None:
    """Check the arguments every decode kernel shares (see :func:`decode_attention`); shapes, dtypes and strides only,
    except the id checks of ``check``."""
    dev = query.device
    expect("query", query, (None,) * 4, _FLOAT, dev, contiguous=False)
    if query.stride(-1) != 1:
        raise ValueError(f"query [B, Hq, q, Dk] must have a unit stride on its last dim; got strides {query.stride()}")
    b, hq, q, _ = query.shape
    if pages is None:
        if run_start is None or lengths is None or width is None or width < 0:
            raise ValueError("pages=None (read each run's first pages) needs run_start, lengths and width >= 0")
        expect("run_start", run_start, (b, None), _INT, dev)
        h, n = run_start.shape[1], width
    else:
        expect("pages", pages, (b, None, None), _INT, dev)
        h, n = pages.shape[1], pages.shape[2]
        if run_start is not None:
            expect("run_start", run_start, (b, h), _INT, dev)
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
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if check:
        check_pages_in_range(global_pages(pages, run_start, n, lengths), num_pages, "page table ids")
        if lengths is not None and lengths.numel() and bool(((lengths < 0) | (lengths > n)).any()):
            raise IndexError(f"lengths must be in [0, {n}] (the table width)")


def launches_directly(query: torch.Tensor, kernel: Any) -> bool:
    """Whether an eager call launches ``kernel`` itself rather than through its operator: nothing traces the call
    (``runs_eagerly``: no ``torch.compile``, no dispatch mode such as fake tensors) and the kernel runs on the query's
    tensors (CUDA, or the interpreter)."""
    return runs_eagerly(query) and (query.is_cuda or interpreted(kernel))


def run_decode(
    query: torch.Tensor,
    fields: tuple[torch.Tensor | None, ...],
    bits: int,
    group: int,
    pos: torch.Tensor,
    valid: torch.Tensor,
    pages: torch.Tensor | None,
    qpos: torch.Tensor,
    scale: float,
    page_full: torch.Tensor | None,
    n_sink: int,
    window: int,
    row_start: torch.Tensor | None,
    lengths: torch.Tensor | None,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    num_splits: int | None,
    run_start: torch.Tensor | None = None,
    width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Call the operator on checked arguments; ``fields = (k, v, k_scale, k_zero, v_scale, v_zero)`` (the last four
    None for stored pages) -> ``(o, lse, attended)``.

    An eager call whose implementation is the kernels (CUDA tensors, or the interpreter) launches them directly: the
    dispatcher's path through the custom operator (autograd and device keys, the dynamo-disabled Python kernel, the
    alias checks of its outputs) is host time that a decode step pays per layer. Traced code (``torch.compile``, a
    dispatch mode such as fake tensors) calls the operator."""
    k, v, k_scale, k_zero, v_scale, v_zero = fields
    args = (
        query, k, v, k_scale, k_zero, v_scale, v_zero, pos, valid, pages, qpos, page_full, row_start, lengths, sinks,
        float(scale), int(n_sink), int(window), int(sliding_window or 0), bits, group, int(num_splits or 0),
        run_start, int(width or 0),
    )  # fmt: skip
    return (_launch if launches_directly(query, _split_kernel) else paged_decode)(*args)


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
    count: bool = False,
    num_splits: int | None = None,
    check: bool = True,
    run_start: torch.Tensor | None = None,
    width: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """Attention of a few query tokens over the pool pages a page table names, read in place (Triton, through
    ``torch.ops.pikv.paged_decode``).

    Parameters
    ----------
    query : torch.Tensor
        ``[B, Hq, q, Dk]`` (any strides but a unit last one), the dtype of ``keys``; query head ``i`` reads KV head
        ``i // (Hq // H)``.
    keys, values : torch.Tensor
        Contiguous pool fields ``[N, P, Dk]`` and ``[N, P, Dv]``.
    pos, valid : torch.Tensor
        Contiguous ``[N, P]`` int32 positions and bool valid bits.
    pages : torch.Tensor or None
        Contiguous ``[B, H, n]`` int32 / int64 global page ids (``-1``: skip), or with ``run_start`` local ids of each
        (row, head)'s run of pool pages; None (with ``run_start``, ``lengths`` and ``width``): each run's first
        ``lengths[b, h]`` pages, with no table to read (the exact read of a ``PageTable``).
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
    count : bool
        Also return ``attended``: the slots the last query token attends per (row, KV head), counted by the kernel.
    num_splits : int, optional
        Splits of each table row (default: enough programs for a few per SM on CUDA, 1 elsewhere).
    check : bool
        Check that the table ids are in ``[-1, N)`` and ``lengths`` in ``[0, n]`` before launch; this reads them (a
        host sync on CUDA), so an asynchronous caller that built them itself passes False.
    run_start : torch.Tensor, optional
        ``[B, H]`` integer first global page of each (row, head)'s run (``PageTable.start``): ``pages`` then holds
        local ids, mapped to ``run_start + local`` in the kernel (no table gather on the host).
    width : int, optional
        ``n`` when ``pages`` is None: an upper bound of ``lengths`` (the frame width) that sizes the splits.

    Returns
    -------
    tuple of torch.Tensor
        ``o [B, Hq, q, Dv]`` float32 (zeros for a query with nothing to attend) and ``lse [B, Hq, q]`` float32
        (``-inf`` there), equal to :func:`decode_attention_reference`; with ``count``, also ``attended [B, H]`` int64.
    """
    check_decode_args(query, pos, valid, pages, qpos, page_full, row_start, lengths, sliding_window, sinks, check,
                      run_start, width)  # fmt: skip
    num_pages, page = pos.shape
    expect("keys", keys, (num_pages, page, query.shape[-1]), (query.dtype,), query.device)
    expect("values", values, (num_pages, page, None), (query.dtype,), query.device)
    out = run_decode(
        query, (keys, values, None, None, None, None), 0, 1, pos, valid, pages, qpos, scale, page_full, n_sink,
        window, row_start, lengths, sliding_window, sinks, num_splits, run_start, width,
    )  # fmt: skip
    return out if count else out[:2]


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
    k = gather_pages_reference(keys, pages).view(b, h, c, keys.shape[-1]).float()  # c may be 0: no -1
    v = gather_pages_reference(values, pages).view(b, h, c, values.shape[-1]).float()
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
        from pikv_hf.read.plan import sink_or_recent  # here: pikv_hf.read imports the codecs, which import kernels

        start = torch.zeros(b, dtype=torch.int64, device=pos.device) if row_start is None else row_start
        ok &= page_full.repeat_interleave(p, dim=-1) | sink_or_recent(pos_s, qpos[-1], n_sink, window, start)
    return ok, pos_s
