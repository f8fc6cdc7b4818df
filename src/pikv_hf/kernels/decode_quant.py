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
``scale = (max - min) / (2**b - 1)``). The kernel is ``decode.py``'s (``BITS > 0``): it reads the codes, dequantises
them in registers and rounds them to the query's dtype for the tensor-core dots (float32 models: float32); its torch
reference is ``decode_attention_reference(query, *dequantize_pages(quant), ...)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pikv_hf.kernels._host import expect
from pikv_hf.kernels.decode import check_decode_args, run_decode

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
    attended: torch.Tensor | None = None,
    num_splits: int | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pikv_hf.kernels.decode.decode_attention` over quantised pages ``quant`` (contiguous fields in the
    layout of the module docstring, on the query's device) in place of ``keys`` / ``values``; the other arguments
    and the result are the same."""
    _check_bits(quant.bits)
    check_decode_args(query, pos, valid, pages, qpos, page_full, row_start, lengths, sliding_window, sinks, attended,
                      check)  # fmt: skip
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
    return run_decode(
        query, fields, quant.bits, quant.group, pos, valid, pages, qpos, scale, page_full, n_sink, window, row_start,
        lengths, sliding_window, sinks, attended, num_splits,
    )  # fmt: skip
