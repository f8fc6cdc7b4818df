"""Quantised pages to dense keys and values in one operator, ``torch.ops.pikv.dequant_pages``: the read of a 4-bit
(or 2 / 8-bit) tier by a path that needs dense K/V (the torch backend's gather + attention, kvpress scoring).

In torch the dequantisation is about sixteen small operators (shifts and masks per code field, scale casts, two
``addcmul``), each a kernel launch on a GPU. On CUDA the operator is one Triton kernel: program ``(n, t)`` reads
slots ``[t * BLOCK_P, (t + 1) * BLOCK_P)`` of page ``n`` as packed bytes, and for each code field ``j`` of a byte
(``8 // bits`` of them, low bits first) writes channel ``per * i + j`` of the output directly (strided stores: no
interleave of the fields in registers), ``code * scale + zero`` in float32, rounded to the output dtype. On the CPU
the operator runs the torch reference :func:`pikv_hf.kernels.decode_quant.dequantize_pages` (same arithmetic), and
a fake implementation gives shapes for tracing.
"""

from __future__ import annotations

import torch

from pikv_hf.kernels._host import cdiv, next_power_of_2
from pikv_hf.kernels._triton import check_launchable, eager_direct, jit, tl
from pikv_hf.kernels.decode import _exact_float
from pikv_hf.kernels.decode_quant import QuantPages, _check_bits, dequantize_pages

_BLOCK_P = 16  # slots per program


@jit
def _dequant_rows(
    codes_ptr,
    scale_ptr,
    zero_ptr,
    out_ptr,
    n,
    t,
    t_ok,
    P: tl.constexpr,
    D: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    PER_PAGE: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """Slots ``t`` (``[BLOCK_P]``) of page ``n``: ``D`` channels from ``D * BITS // 8`` packed bytes per slot.
    ``PER_PAGE``: one scale / zero per page and channel (keys), else per slot and group of ``GROUP`` channels."""
    PER: tl.constexpr = 8 // BITS
    NB: tl.constexpr = D // PER
    i = tl.arange(0, BLOCK_B)
    ok = t_ok[:, None] & (i < NB)[None, :]
    slot = n * P + t
    byte = tl.load(codes_ptr + slot[:, None] * NB + i[None, :], mask=ok, other=0).to(tl.int32)
    for j in tl.static_range(PER):
        c = i * PER + j
        code = _exact_float((byte >> (j * BITS)) & ((1 << BITS) - 1))
        if PER_PAGE:
            at = n * D + c[None, :]
            s_ok = (i < NB)[None, :]
        else:
            at = slot[:, None] * (D // GROUP) + (c // GROUP)[None, :]
            s_ok = ok
        scale = tl.load(scale_ptr + at, mask=s_ok, other=0.0).to(tl.float32)
        zero = tl.load(zero_ptr + at, mask=s_ok, other=0.0).to(tl.float32)
        x = code * scale + zero
        tl.store(out_ptr + slot[:, None] * D + c[None, :], x.to(out_ptr.dtype.element_ty), mask=ok)


@jit
def _dequant_kernel(
    kq_ptr,
    ks_ptr,
    kz_ptr,
    vq_ptr,
    vs_ptr,
    vz_ptr,
    k_out_ptr,
    v_out_ptr,
    P: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_BK: tl.constexpr,
    BLOCK_BV: tl.constexpr,
):
    """Program ``(n, block)``: keys and values of slots ``[block * BLOCK_P, ...)`` of page ``n``."""
    n = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    t_ok = t < P
    _dequant_rows(kq_ptr, ks_ptr, kz_ptr, k_out_ptr, n, t, t_ok, P, DK, BITS, 1, True, BLOCK_BK)
    _dequant_rows(vq_ptr, vs_ptr, vz_ptr, v_out_ptr, n, t, t_ok, P, DV, BITS, GROUP, False, BLOCK_BV)


def _launch(kq, k_scale, k_zero, vq, v_scale, v_zero, bits, dtype):
    """The kernel on contiguous copies of the fields: ``(keys [N, P, Dk], values [N, P, Dv])`` of ``dtype``."""
    n, p, bk = kq.shape
    bv = vq.shape[-1]
    dk, dv = bk * 8 // bits, bv * 8 // bits
    keys = torch.empty(n, p, dk, dtype=dtype, device=kq.device)
    values = torch.empty(n, p, dv, dtype=dtype, device=kq.device)
    if not keys.numel() and not values.numel():
        return keys, values
    check_launchable(_dequant_kernel, kq.device)
    fields = [x.contiguous() for x in (kq, k_scale, k_zero, vq, v_scale, v_zero)]
    _dequant_kernel[(n, cdiv(p, _BLOCK_P))](
        *fields, keys, values, P=p, DK=dk, DV=dv, BITS=bits, GROUP=dv // v_scale.shape[-1], BLOCK_P=_BLOCK_P,
        BLOCK_BK=next_power_of_2(bk), BLOCK_BV=next_power_of_2(bv),
    )  # fmt: skip
    return keys, values


def _reference(kq, k_scale, k_zero, vq, v_scale, v_zero, bits, dtype):
    keys, values = dequantize_pages(QuantPages(kq, k_scale, k_zero, vq, v_scale, v_zero, bits))
    return keys.to(dtype), values.to(dtype)


dequant_pages = torch.library.custom_op(
    "pikv::dequant_pages",
    _launch,
    mutates_args=(),
    device_types="cuda",
    schema="(Tensor kq, Tensor k_scale, Tensor k_zero, Tensor vq, Tensor v_scale, Tensor v_zero, int bits, "
    "ScalarType dtype) -> (Tensor, Tensor)",
)
dequant_pages.__doc__ = """``torch.ops.pikv.dequant_pages``: the fields of :class:`QuantPages` (``kq [N, P, Bk]``,
``k_scale`` / ``k_zero [N, Dk]``, ``vq [N, P, Bv]``, ``v_scale`` / ``v_zero [N, P, Dv // G]``), ``bits`` and the
output dtype -> ``(keys [N, P, Dk], values [N, P, Dv])``. No argument is checked here: call :func:`dequantize`."""


@dequant_pages.register_kernel("cpu")
def _dequant_pages_cpu(*args):
    return _reference(*args)


_dequant_eager = eager_direct(dequant_pages, _launch, _dequant_pages_cpu, traced=_reference)


@dequant_pages.register_fake
def _dequant_pages_fake(kq, k_scale, k_zero, vq, v_scale, v_zero, bits, dtype):
    n, p, bk = kq.shape
    return (
        kq.new_empty(n, p, bk * 8 // bits, dtype=dtype),
        kq.new_empty(n, p, vq.shape[-1] * 8 // bits, dtype=dtype),
    )


def dequantize(quant: QuantPages, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[N, P, Dk]`` and values ``[N, P, Dv]`` of ``dtype`` from quantised pages: one operator in eager code
    (one kernel on CUDA), the torch reference in compiled code (which the compiler fuses with what reads it).

    Parameters
    ----------
    quant : QuantPages
        Fields ``[N, P, Dk * bits // 8]``, ``[N, Dk]``, ``[N, Dk]``, ``[N, P, Dv * bits // 8]``, ``[N, P, Dv // G]``,
        ``[N, P, Dv // G]`` on one device (any strides).
    dtype : torch.dtype
        Output dtype (the arithmetic is float32).

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        Equal to ``dequantize_pages(quant)`` cast to ``dtype``.
    """
    _check_bits(quant.bits)
    return _dequant_eager(*quant.fields(), quant.bits, dtype)
