"""Fused paged decode attention over quantised pages: int4 / int8 codes dequantised in registers, with the torch
``quantize_pages`` / ``dequantize_pages`` that define the layout.

Page layout (the compression codec stores exactly this), bits ``b`` in {2, 4, 8}, ``N`` pages of ``P`` slots:

==========  =========================  =======  ==========================================================
field       shape                      dtype    meaning
==========  =========================  =======  ==========================================================
kq          ``[N, P, Dk * b // 8]``    uint8    key codes: channel ``c`` of a slot in byte ``c // (8 // b)``
                                                at bit offset ``(c % (8 // b)) * b`` (low bits first)
k_scale     ``[N, Dk]``                float*   per page and channel (KIVI: keys per channel, the page's
k_zero      ``[N, Dk]``                float*   ``P`` tokens being the group)
vq          ``[N, P, Dv * b // 8]``    uint8    value codes, packed as the keys
v_scale     ``[N, P, Dv // G]``        float*   per token, groups of ``G`` channels
v_zero      ``[N, P, Dv // G]``        float*
==========  =========================  =======  ==========================================================

``float*``: float32, or float16 (KIVI's choice, which the compression codec stores by default: at 4 bits the
float32 scales and zeros of the values alone would cost 1/8 of the codes' bytes); the four scale / zero fields share
one dtype and the kernel dequantises in float32 either way.

Dequantised: ``k[n, t, c] = code * k_scale[n, c] + k_zero[n, c]`` and
``v[n, t, c] = code * v_scale[n, t, c // G] + v_zero[n, t, c // G]`` (asymmetric: ``zero`` is the range minimum,
``scale = (max - min) / (2**b - 1)``). The torch reference of every kernel here is
``decode_attention_reference(query, *dequantize_pages(quant), ...)``.

**4 bits: codes dotted as codes** (``torch.ops.pikv.paged_decode_q4``, used when ``Dk`` (>= 64) and ``Dv`` (>= 32)
are powers of two and a value group is a power of two >= 32 channels, at most 4 groups per head: every dot's dims
are then >= 16; other shapes and 2 / 8 bits take ``decode.py``'s kernel with ``BITS > 0``, which dequantises every
code and interleaves the fields in registers). Codes are integers in [0, 15], exact in 16-bit floats, so the tensor
cores take them as they are and the scales move out of the ``[BLOCK_N, D]`` tiles; no unpacked codes are joined,
reshaped or shuffled:

* keys are read as 16-bit words (``[BLOCK_N, Dk / 4]``), word ``i`` holding channels ``4i .. 4i + 3`` in its four
  nibbles (low bits first), so ``(word >> 4j) & 15`` is the code matrix of the channels ``4i + j``, dotted with those
  channels of the query (``q<j> = q[:, j::4]``, loaded once per program). ``s = q . (code * k_scale + k_zero) =
  sum_j (q<j> * ks<j>) @ code<j>^T + q . k_zero`` with one scale and zero per page and channel: when a tile lies in
  one page (``P % BLOCK_N == 0``) the scales are folded into the query, ``[BLOCK_R, Dk]`` products per tile instead of
  ``[BLOCK_N, Dk]`` (``BLOCK_R`` = 16 rows for a GQA group of 4 against tiles of 64-128 slots); smaller pages decode
  each field with its slots' page scales. Words rather than bytes: the dot operand of byte codes was read from shared
  memory a byte at a time (sm_90 SASS).
* values: ``o = sum_t p_t (code_t * vs_t + vz_t)`` with one scale and zero per slot and group of ``G`` channels, so
  per group ``o_g = (p * vs_g) @ code_g + (p . vz_g)``: the scale applied to the ``[BLOCK_R, BLOCK_N]`` probabilities
  after the softmax instead of to the ``[BLOCK_N, Dv]`` codes. The codes load as ``[groups, BLOCK_N, G / 2]`` bytes,
  byte ``i`` of a group holding its channels ``2i`` (low nibble) and ``2i + 1``, and the groups are the batch of two
  batched dots (even and odd channels) into ``[groups, BLOCK_R, G / 2]`` accumulators: each product is one the
  output needs (before, a pair of dots per group over the whole head, its other groups' columns masked off). Both
  changes together: 71.8 -> 61.1 warp instructions per slot at sm_90 (``benchmarks/kernel_resources.py``, best
  configuration; ``kernel_resources_sm90_bbdcaf6.json`` holds the kernel before).

The bytes read per slot and KV head are ``(Dk + Dv) / 2`` of codes, ``4 * Dv / G`` of value scales and zeros and
``4 * Dk / P`` of key scales and zeros (float16), against ``2 * (Dk + Dv)`` for bfloat16 K/V: 3.6x fewer at
``D = 128``, ``G = P = 64``; the per-element work is a mask or a shift and a logic op per code, and a packed
half-precision add per two (``_dot_codes``: the float is built from bits, no integer-to-float conversion, which
Hopper runs at an eighth of a float add's rate; ``benchmarks/kernel_resources.py`` counts both). The rest (tiles,
splits, plan masks, the log-sum-exp merge) is ``decode.py``'s (``_tile``, ``_geometry`` with ``auto_splits``,
``_partials``, ``_merge``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pikv_hf.kernels._host import expect
from pikv_hf.kernels._triton import HAVE_TRITON, check_launchable, interpreted, jit, tl, triton
from pikv_hf.kernels.decode import (
    _LOG2E,
    _TUNE_FROM_SLOTS,
    _dot_dtype,
    _exact_float,
    _geometry,
    _merge,
    _online_softmax,
    _partials,
    _program,
    _reference_op,
    _split_slots,
    _store_split,
    _tile,
    check_decode_args,
    launch_tuned,
    launches_directly,
    prune_to_chosen,
    run_decode,
    tuned_configs,
)

BITS = (2, 4, 8)
SCALE_DTYPES = (torch.float32, torch.float16)
QUANT_FIELDS = ("kq", "k_scale", "k_zero", "vq", "v_scale", "v_zero")


@dataclass
class QuantPages:
    """Quantised keys and values of ``N`` pages in the layout of the module docstring."""

    kq: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    vq: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    bits: int

    @property
    def v_dim(self) -> int:
        return self.vq.shape[-1] * 8 // self.bits

    @property
    def group(self) -> int:
        return self.v_dim // self.v_scale.shape[-1]

    def fields(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in QUANT_FIELDS)


# ---------------------------------------------------------------------------------------------- torch layout
def _check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., D]`` integer codes in ``[0, 2**bits)`` -> ``[..., D * bits // 8]`` uint8, low bits first."""
    per = 8 // bits
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    grouped = codes.to(torch.int32).view(*codes.shape[:-1], codes.shape[-1] // per, per)
    return (grouped << shifts).sum(-1).to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`_pack`: ``[..., B]`` uint8 -> ``[..., B * 8 // bits]`` float32 codes (shifts and masks on
    the bytes themselves, each code field converted to float as it is written into its interleaved place)."""
    per, mask = 8 // bits, (1 << bits) - 1
    out = torch.empty(*packed.shape, per, dtype=torch.float32, device=packed.device)
    for i in range(per):
        out[..., i] = (packed >> (i * bits)) & mask if i else packed & mask
    return out.flatten(-2)


def _affine(
    x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int, dim: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes of ``x`` on the ``2**bits`` levels spanning ``[lo, hi]`` (``x`` reduced over ``dim``), the level
    spacing and the zero (the shape of ``lo``, stored as ``dtype``; the codes round against the stored values)."""
    levels = (1 << bits) - 1
    zero = lo.to(dtype)
    scale = ((hi - zero.float()) / levels).to(dtype)
    step = torch.where(scale > 0, scale.float(), 1.0).unsqueeze(dim)
    return torch.round((x - zero.float().unsqueeze(dim)) / step).clamp(0, levels), scale, zero


def quantize_pages(
    keys: torch.Tensor,
    values: torch.Tensor,
    bits: int,
    group: int,
    valid: torch.Tensor | None = None,
    scale_dtype: torch.dtype = torch.float32,
) -> QuantPages:
    """Quantise pages of keys (per page and channel) and values (per token, groups of ``group`` channels).

    Parameters
    ----------
    keys, values : torch.Tensor
        ``[N, P, Dk]`` and ``[N, P, Dv]`` floats; ``Dk`` and ``Dv`` multiples of ``8 // bits``, ``Dv`` of
        ``group``.
    bits : int
        2, 4 or 8.
    group : int
        Value channels per scale.
    valid : torch.Tensor, optional
        ``[N, P]`` bool: only valid slots set a page's key range (empty slots then decode to the range minimum).
    scale_dtype : torch.dtype
        Dtype of the scales and zeros (float32 or float16). The codes are computed against the stored (rounded)
        zero and scale, so rounding them costs no more than one level.

    Returns
    -------
    QuantPages
        The fields of the module docstring.
    """
    _check_bits(bits)
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype!r}")
    n, p, dk = keys.shape
    dv = values.shape[-1]
    per = 8 // bits
    if dk % per or dv % per or dv % group:
        raise ValueError(f"Dk ({dk}) and Dv ({dv}) must be multiples of {per} and Dv of group ({group})")
    k = keys.float()
    ok = torch.ones(n, p, dtype=torch.bool, device=keys.device) if valid is None else valid
    lo = k.masked_fill(~ok.unsqueeze(-1), float("inf")).amin(1)
    hi = k.masked_fill(~ok.unsqueeze(-1), float("-inf")).amax(1)
    empty = ~ok.any(1, keepdim=True)  # pages with no valid slot: a zero range
    lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
    k_codes, k_scale, k_zero = _affine(k, lo, hi, bits, 1, scale_dtype)
    v = values.float().view(n, p, dv // group, group)
    v_codes, v_scale, v_zero = _affine(v, v.amin(-1), v.amax(-1), bits, -1, scale_dtype)
    return QuantPages(_pack(k_codes, bits), k_scale, k_zero, _pack(v_codes.view(n, p, dv), bits), v_scale, v_zero, bits)


def dequantize_pages(quant: QuantPages) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 keys ``[N, P, Dk]`` and values ``[N, P, Dv]`` of quantised pages (the kernel's loads, in torch)."""
    _check_bits(quant.bits)
    keys = torch.addcmul(
        quant.k_zero.float().unsqueeze(1), _unpack(quant.kq, quant.bits), quant.k_scale.float().unsqueeze(1)
    )
    n, p, _ = quant.vq.shape
    codes = _unpack(quant.vq, quant.bits).view(n, p, -1, quant.group)
    values = torch.addcmul(quant.v_zero.float().unsqueeze(-1), codes, quant.v_scale.float().unsqueeze(-1))
    return keys, values.view(n, p, quant.v_dim)


# ---------------------------------------------------------------------------------------------- 4-bit kernel
_Q4_BLOCK_N = 64  # slots per tile for small reads (large ones autotune it on CUDA)
_Q4_MAX_GROUPS = 4  # value groups per head the 4-bit kernel takes (one batch of dots: [groups, ...] tiles)
# (BLOCK_N, warps, stages) tried on CUDA: H100 / H200 at 16k-32k slots per row read 64-128-slot tiles; deeper pipelines
# hide the latency of the small code loads (a 128-slot tile of 4-bit K and V is 16 KiB at D = 128)
_Q4_CONFIGS = ((32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 2), (128, 4, 3), (128, 8, 3),
               (128, 8, 4))  # fmt: skip
_Q4_CAPPED = ((64, 4, 3), (64, 8, 3))  # again at most 128 registers a thread: 207-255 uncapped (2 programs per SM)
# what the autotuner chose on an H200 for heads of 128 channels, pages of 64 (decode._CHOSEN says where from)
_Q4_CHOSEN = frozenset({(64, 4, 2, None), (128, 4, 2, None), (128, 4, 3, None)})


def q4_fits(dk: int, dv: int, group: int) -> bool:
    """Whether the 4-bit kernel takes these head dims and value group (module docstring): each dot's dims are at least
    16 (``Dk / 4`` key words, ``G / 2`` bytes of a value group)."""

    def pow2(d: int, least: int) -> bool:
        return d >= least and d & (d - 1) == 0

    return pow2(dk, 64) and pow2(dv, 32) and pow2(group, 32) and dv % group == 0 and dv // group <= _Q4_MAX_GROUPS


@jit
def _dot_codes(x, DOT_DTYPE: tl.constexpr):
    """4-bit codes (integers in ``[0, 16)``) as ``DOT_DTYPE`` operands of a dot, exactly, built from bits rather than
    converted (``decode._exact_float``): for a 16-bit float the code as the low mantissa bits of the float whose ulp is
    1 (bfloat16 ``0x4300`` = 128, float16 ``0x6400`` = 1024), less that float, two codes per packed half-precision
    add; float32 through ``_exact_float``."""
    if DOT_DTYPE == tl.bfloat16:
        return (x.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True) - 128.0
    elif DOT_DTYPE == tl.float16:
        return (x.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    else:
        return _exact_float(x)


@jit
def _key_field(q, kw, ks_ptr, kz_ptr, at, has, s, qz, SHIFT: tl.constexpr, ONE_PAGE: tl.constexpr,
               DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """One key field of a tile: the codes at bits ``SHIFT`` of the 16-bit words ``kw`` (``[BLOCK_N, DK / 4]``,
    channels ``4i + SHIFT / 4``) dotted with ``q`` (``[BLOCK_R, DK / 4]``, the same channels of the query) into the
    logits ``s``, the channels' scales and zeros at ``ks_ptr`` / ``kz_ptr`` + ``at``. ``ONE_PAGE``: the tile's page's
    (``[DK / 4]``), the scales folded into the query and ``q * k_zero`` added to ``qz`` (``[BLOCK_R, DK / 4]``, summed
    once per tile); else each slot's page's (``[BLOCK_N, DK / 4]``), the codes decoded."""
    ks = tl.load(ks_ptr + at, mask=has, other=0.0).to(tl.float32)
    kz = tl.load(kz_ptr + at, mask=has, other=0.0).to(tl.float32)
    code = (kw >> SHIFT) & 15
    if ONE_PAGE:
        qk = (q * ks[None, :]).to(DOT_DTYPE)
        s = tl.dot(qk, tl.trans(_dot_codes(code, DOT_DTYPE)), s, input_precision=DOT_PRECISION)
        qz += q * kz[None, :]
    else:
        k = (_exact_float(code) * ks + kz).to(DOT_DTYPE)
        s = tl.dot(q.to(DOT_DTYPE), tl.trans(k), s, input_precision=DOT_PRECISION)
    return s, qz


def _split_q4_kernel_fn(
    q_ptr,
    kq_ptr,
    vq_ptr,
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
    HAS_LEN: tl.constexpr,
    HAS_FULL: tl.constexpr,
    HAS_SLIDING: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GROUP: tl.constexpr,
    TABLE: tl.constexpr,
    SPAN: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Program ``(b * H + h, split, row tile)`` of ``decode.py``'s stage 1 over 4-bit pages, the codes dotted as
    codes (module docstring: keys in four fields of 16-bit words, values per group in even / odd fields); same partial
    outputs, so the same merge follows. ``TABLE`` as there: global page ids (0), local ids of the run starting at
    ``start_ptr[bh]`` (1), or the run's pages in order (2, an exact read)."""
    WK: tl.constexpr = DK // 4  # 16-bit words of a slot's key codes: word i holds channels 4i .. 4i + 3
    HV: tl.constexpr = DV // 2  # bytes of a slot's value codes
    NG: tl.constexpr = DV // GROUP
    BG: tl.constexpr = GROUP // 2  # bytes of a value group
    bh, b, h, rows, row_ok, qi, qpos_rows, qpos_last = _program(qpos_ptr, H, G, Q, BLOCK_R)
    iw = tl.arange(0, WK)
    ib = tl.arange(0, BG)
    gi = tl.arange(0, NG)
    kq_words = kq_ptr.to(tl.pointer_type(tl.int16))
    q_at = q_ptr + (b.to(tl.int64) * stride_qb + (h * G + rows // Q) * stride_qh + qi * stride_qt)[:, None] + 4 * iw
    q0 = tl.load(q_at, mask=row_ok[:, None], other=0.0).to(tl.float32)  # channels 4i + j of the query: q<j>
    q1 = tl.load(q_at + 1, mask=row_ok[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(q_at + 2, mask=row_ok[:, None], other=0.0).to(tl.float32)
    q3 = tl.load(q_at + 3, mask=row_ok[:, None], other=0.0).to(tl.float32)
    row_start = tl.load(row_start_ptr + b).to(tl.int32) if HAS_FULL else 0
    lo, hi = _split_slots(len_ptr, bh, n_table, num_splits, PAGE, BLOCK_N, HAS_LEN)
    row_table = table_ptr + bh.to(tl.int64) * n_table
    run_first = tl.load(start_ptr + bh).to(tl.int64) if TABLE > 0 else 0
    full_row = full_ptr + bh.to(tl.int64) * n_table
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc_e = tl.zeros([NG, BLOCK_R, BG], tl.float32)  # per value group: its even and odd channels
    acc_o = tl.zeros([NG, BLOCK_R, BG], tl.float32)
    count = tl.zeros([BLOCK_N], tl.int32)
    for start in range(lo, hi, BLOCK_N):
        page, slot, load, ok, pos = _tile(
            start, hi, row_table, run_first, full_row, pos_ptr, valid_ptr, row_start, qpos_last, n_sink, window,
            PAGE, BLOCK_N, HAS_FULL, TABLE,
        )  # fmt: skip
        kw = tl.load(kq_words + slot[:, None] * WK + iw[None, :], mask=load[:, None], other=0)
        ONE_PAGE: tl.constexpr = PAGE % BLOCK_N == 0  # the tile's page's scales folded into the query
        if ONE_PAGE:
            at = page.to(tl.int64) * DK + 4 * iw
            has = tl.zeros_like(iw) + page >= 0
        else:  # slots of several pages: each code scaled by its page's channel scale
            at = page.to(tl.int64)[:, None] * DK + 4 * iw[None, :]
            has = load[:, None]
        s = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)
        qz = tl.zeros([BLOCK_R, WK], tl.float32)
        s, qz = _key_field(q0, kw, ks_ptr, kz_ptr, at, has, s, qz, 0, ONE_PAGE, DOT_DTYPE, DOT_PRECISION)
        s, qz = _key_field(q1, kw, ks_ptr, kz_ptr, at + 1, has, s, qz, 4, ONE_PAGE, DOT_DTYPE, DOT_PRECISION)
        s, qz = _key_field(q2, kw, ks_ptr, kz_ptr, at + 2, has, s, qz, 8, ONE_PAGE, DOT_DTYPE, DOT_PRECISION)
        s, qz = _key_field(q3, kw, ks_ptr, kz_ptr, at + 3, has, s, qz, 12, ONE_PAGE, DOT_DTYPE, DOT_PRECISION)
        if ONE_PAGE:
            s += tl.sum(qz, 1)[:, None]
        p, alpha, m_i, count = _online_softmax(
            s * qk_scale, ok, pos, qpos_rows, qpos_last, m_i, count, sliding_window, HAS_SLIDING
        )  # fmt: skip
        # values, one batch of dots per group: [NG, BLOCK_R, BLOCK_N] scaled probabilities against [NG, BLOCK_N, BG]
        # codes; scales / zeros of slots not read count as 0 (they may hold NaN)
        vb = tl.load(vq_ptr + slot[None, :, None] * HV + gi[:, None, None] * BG + ib[None, None, :],
                     mask=load[None, :, None], other=0)  # fmt: skip
        vs = tl.load(vs_ptr + slot[None, :] * NG + gi[:, None], mask=load[None, :], other=0.0).to(tl.float32)
        vz = tl.load(vz_ptr + slot[None, :] * NG + gi[:, None], mask=load[None, :], other=0.0).to(tl.float32)
        pv = (p[None, :, :] * tl.where(ok[None, :], vs, 0.0)[:, None, :]).to(DOT_DTYPE)
        zero = tl.sum(p[None, :, :] * tl.where(ok[None, :], vz, 0.0)[:, None, :], 2)[:, :, None]
        acc_e = acc_e * alpha[None, :, None] + zero
        acc_o = acc_o * alpha[None, :, None] + zero
        acc_e = tl.dot(pv, _dot_codes(vb & 15, DOT_DTYPE), acc_e, input_precision=DOT_PRECISION)
        acc_o = tl.dot(pv, _dot_codes(vb >> 4, DOT_DTYPE), acc_o, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
    part, inv = _store_split(lse_ptr, count_ptr, bh, rows, row_ok, m_i, l_i, count, G, Q)
    out = o_ptr + part[None, :, None] * DV + gi[:, None, None] * GROUP + 2 * ib[None, None, :]
    tl.store(out, acc_e * inv[None, :, None], mask=row_ok[None, :, None])
    tl.store(out + 1, acc_o * inv[None, :, None], mask=row_ok[None, :, None])


_split_q4_kernel = jit(_split_q4_kernel_fn)
_split_q4_kernel_tuned = None  # on CUDA: autotuned over tile sizes, warps and pipeline stages (H100 / H200 shapes)
if HAVE_TRITON and not interpreted(_split_q4_kernel):
    _split_q4_kernel_tuned = triton.autotune(
        configs=tuned_configs(_Q4_CONFIGS, _Q4_CAPPED),
        prune_configs_by={"early_config_prune": prune_to_chosen(_Q4_CHOSEN)},
        key=["PAGE", "DK", "DV", "BLOCK_R", "GROUP", "HAS_FULL", "HAS_LEN", "SPAN", "TABLE"],
    )(triton.jit(_split_q4_kernel_fn))


def _launch_q4(
    query, kq, vq, k_scale, k_zero, v_scale, v_zero, pos, valid, pages, qpos, page_full, row_start, lengths, sinks,
    scale, n_sink, window, sliding_window, group, num_splits, run_start, width,
):  # fmt: skip
    """Both stages over 4-bit pages (the 4-bit split kernel, then ``decode.py``'s merge) on checked tensors:
    ``(o, lse, attended)`` as ``torch.ops.pikv.paged_decode`` (tables made contiguous, ``run_start`` / ``width``
    read, as there)."""
    pages, page_full, lengths, run_start = (
        None if t is None else t.contiguous() for t in (pages, page_full, lengths, run_start)
    )  # fmt: skip
    h, n = (pages.shape[1], pages.shape[2]) if pages is not None else (run_start.shape[1], width)
    geo = _geometry(query, pos.shape[1], h, n, vq.shape[-1] * 2, num_splits)
    dev = query.device
    o_part, lse_part, counts = _partials(geo, dev)
    if geo.reads:
        check_launchable(_split_q4_kernel, dev)
        if page_full is not None and row_start is None:
            row_start = torch.zeros(geo.b, dtype=torch.int64, device=dev)
        unused = qpos  # pointer of an absent optional input (its constexpr switch keeps it unread)
        tuned = _split_q4_kernel_tuned is not None and geo.n_slots >= _TUNE_FROM_SLOTS
        dot_dtype = _dot_dtype(query.dtype, interpreted(_split_q4_kernel))
        grid = (geo.b * geo.h, geo.splits, geo.row_tiles)
        args = (
            query, kq, vq, k_scale, k_zero, v_scale, v_zero, pos, valid.view(torch.uint8),
            unused if pages is None else pages, unused if run_start is None else run_start,
            unused if lengths is None else lengths, unused if page_full is None else page_full.view(torch.uint8),
            unused if row_start is None else row_start, qpos, o_part, lse_part, counts,
            query.stride(0), query.stride(1), query.stride(2), geo.h, geo.n, geo.splits, n_sink, window,
            sliding_window, scale * _LOG2E,
        )  # fmt: skip
        consts = dict(
            G=geo.g, Q=geo.q, PAGE=geo.page, DK=geo.dk, DV=geo.dv, BLOCK_R=geo.block_r, HAS_LEN=lengths is not None,
            HAS_FULL=page_full is not None, HAS_SLIDING=sliding_window > 0, DOT_DTYPE=dot_dtype,
            DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32", GROUP=group,
            TABLE=0 if run_start is None else 1 if pages is not None else 2, SPAN=geo.span if tuned else 1,
        )  # fmt: skip
        if tuned:
            launch_tuned(_split_q4_kernel_tuned, grid, args, consts)
        else:
            _split_q4_kernel[grid](*args, **consts, BLOCK_N=_Q4_BLOCK_N, num_warps=4, num_stages=2)
    return _merge(geo, o_part, lse_part, counts, sinks)


_Q4_SCHEMA = (
    "(Tensor query, Tensor kq, Tensor vq, Tensor k_scale, Tensor k_zero, Tensor v_scale, Tensor v_zero, Tensor pos, "
    "Tensor valid, Tensor? pages, Tensor qpos, Tensor? page_full, Tensor? row_start, Tensor? lengths, Tensor? sinks, "
    "float scale, int n_sink, int window, int sliding_window, int group, int num_splits, Tensor? run_start, "
    "int width) -> (Tensor, Tensor, Tensor)"
)
paged_decode_q4 = torch.library.custom_op("pikv::paged_decode_q4", _launch_q4, mutates_args=(), device_types="cuda",
                                          schema=_Q4_SCHEMA)  # fmt: skip
paged_decode_q4.__doc__ = """``torch.ops.pikv.paged_decode_q4``: ``torch.ops.pikv.paged_decode`` over 4-bit pages
read by the 4-bit kernel (module docstring), the same arguments less ``bits``; nothing is checked here."""


def _q4_as_generic(args: tuple) -> tuple:
    """The operator's arguments in the order of ``paged_decode`` (``bits = 4`` before ``group``)."""
    return (*args[:-4], 4, *args[-4:])


@paged_decode_q4.register_kernel("cpu")
def _paged_decode_q4_cpu(*args):
    if interpreted(_split_q4_kernel):
        return _launch_q4(*args)
    return _reference_op(*_q4_as_generic(args))


@paged_decode_q4.register_fake
def _paged_decode_q4_fake(query, kq, vq, *rest):
    b, hq, q, _ = query.shape
    pages, run_start = rest[6], rest[-2]
    return (
        query.new_empty(b, hq, q, vq.shape[-1] * 2, dtype=torch.float32),
        query.new_empty(b, hq, q, dtype=torch.float32),
        query.new_empty(b, (pages if pages is not None else run_start).shape[1], dtype=torch.int64),
    )


# ---------------------------------------------------------------------------------------------- kernel
def decode_attention_quant(
    query: torch.Tensor,
    quant: QuantPages,
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
    """:func:`pikv_hf.kernels.decode.decode_attention` over quantised pages ``quant`` (contiguous fields in the
    layout of the module docstring, on the query's device) in place of ``keys`` / ``values``; the other arguments
    (``run_start`` / ``width``: local page ids, or none for an exact read) and the result are the same."""
    _check_bits(quant.bits)
    check_decode_args(query, pos, valid, pages, qpos, page_full, row_start, lengths, sliding_window, sinks, check,
                      run_start, width)  # fmt: skip
    n, p = pos.shape
    dk, dv, dev = query.shape[-1], quant.v_dim, query.device
    f32 = (quant.k_scale.dtype,) if quant.k_scale.dtype in SCALE_DTYPES else SCALE_DTYPES
    expect("kq", quant.kq, (n, p, dk * quant.bits // 8), (torch.uint8,), dev)
    expect("k_scale", quant.k_scale, (n, dk), f32, dev)
    expect("k_zero", quant.k_zero, (n, dk), f32, dev)
    expect("vq", quant.vq, (n, p, None), (torch.uint8,), dev)
    if not quant.v_scale.dim() or not quant.v_scale.shape[-1] or dv % quant.v_scale.shape[-1]:
        raise ValueError(f"v_scale must be [N, P, Dv // G] with G dividing Dv = {dv}; got {list(quant.v_scale.shape)}")
    expect("v_scale", quant.v_scale, (n, p, dv // quant.group), f32, dev)
    expect("v_zero", quant.v_zero, (n, p, dv // quant.group), f32, dev)
    fields = (quant.kq, quant.vq, quant.k_scale, quant.k_zero, quant.v_scale, quant.v_zero)
    if quant.bits == 4 and q4_fits(dk, dv, quant.group):
        out = (_launch_q4 if launches_directly(query, _split_q4_kernel) else paged_decode_q4)(
            query, *fields, pos, valid, pages, qpos, page_full, row_start, lengths, sinks, float(scale), int(n_sink),
            int(window), int(sliding_window or 0), quant.group, int(num_splits or 0), run_start, int(width or 0),
        )  # fmt: skip
    else:
        out = run_decode(
            query, fields, quant.bits, quant.group, pos, valid, pages, qpos, scale, page_full, n_sink, window,
            row_start, lengths, sliding_window, sinks, num_splits, run_start, width,
        )  # fmt: skip
    return out if count else out[:2]
