"""KIVI-style quantised pages (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache").

Keys are quantised per channel over the tokens of a page (the page is KIVI's token group), values per token over
groups of ``G`` channels, both asymmetric (``x = code * scale + zero``) with ``b`` in {2, 4, 8} bits. The fields are
exactly the layout of :mod:`pikv_hf.kernels.decode_quant` (``quantize_pages`` / ``dequantize_pages``), so the fused
Triton kernel can read a quantised tier's pages in place; a read that needs dense K/V decodes them with one operator
(:func:`pikv_hf.kernels.dequant.dequantize`).
"""

from __future__ import annotations

import torch

from pikv_hf.codecs.base import Codec, PageBatch, as_pages
from pikv_hf.kernels.decode_quant import BITS, SCALE_DTYPES, QuantPages, quantize_pages
from pikv_hf.kernels.dequant import dequantize
from pikv_hf.store.pool import FieldSpec


def check_quant_args(bits: int, group_size: int, head_dim: int | None = None) -> None:
    """``ValueError`` naming the parameter unless ``bits`` is in {2, 4, 8} and ``group_size`` (value channels per scale,
    and tokens per key group) is a positive integer whose codes fill whole bytes (``group_size * bits`` a multiple of
    8: the packed codes of a value group are read as bytes) dividing ``head_dim`` (when known)."""
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    if group_size * bits % 8:
        raise ValueError(
            f"group_size must be a multiple of {8 // bits} at bits={bits} (a group's codes fill whole bytes), "
            f"got {group_size}"
        )
    if head_dim is not None and head_dim % group_size:
        raise ValueError(f"group_size must divide head_dim = {head_dim}, got {group_size}")


class QuantCodec(Codec):
    """Quantised keys (per page and channel) and values (per token and group of ``group`` channels).

    Parameters
    ----------
    bits : int
        2, 4 or 8.
    group : int
        Value channels per scale; must divide the value head dim.
    scale_dtype : torch.dtype
        Dtype of scales and zeros: float16 (default, as KIVI) or float32.
    """

    name = "quant"
    page_level = True

    def __init__(self, bits: int, group: int, scale_dtype: torch.dtype = torch.float16) -> None:
        check_quant_args(bits, group)
        if scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype!r}")
        self.bits, self.group, self.scale_dtype = bits, group, scale_dtype
        self.dtype = torch.float32

    @property
    def code_bits(self) -> int:
        """A CPU decode reads the pages as codes (``pikv_hf.attention.codes``)."""
        return self.bits

    def fields(self, k_dim: int, v_dim: int, dtype: torch.dtype) -> dict[str, FieldSpec]:
        check_quant_args(self.bits, self.group, v_dim)
        per = 8 // self.bits
        if k_dim % per:
            raise ValueError(f"the key head dim ({k_dim}) must be a multiple of {per} for {self.bits}-bit codes")
        self.dtype = dtype
        u8, sd = torch.uint8, self.scale_dtype
        return {
            "kq": FieldSpec((k_dim // per,), u8),
            "k_scale": FieldSpec((k_dim,), sd, per_page=True),
            "k_zero": FieldSpec((k_dim,), sd, per_page=True),
            "vq": FieldSpec((v_dim // per,), u8),
            "v_scale": FieldSpec((v_dim // self.group,), sd),
            "v_zero": FieldSpec((v_dim // self.group,), sd),
        }

    def encode_pages(self, batch: PageBatch) -> dict[str, torch.Tensor]:
        q = quantize_pages(batch.keys, batch.values, self.bits, self.group, batch.valid, self.scale_dtype)
        # keys: the page's range over every token it holds now; values: only the tokens that arrive are quantised
        return {
            "kq": q.kq,
            "k_scale": q.k_scale,
            "k_zero": q.k_zero,
            "vq": batch.keep_old("vq", q.vq),
            "v_scale": batch.keep_old("v_scale", q.v_scale),
            "v_zero": batch.keep_old("v_zero", q.v_zero),
        }

    def decode(self, fields: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        lead = fields["kq"].shape[:-1]
        kq, k_scale, p = as_pages(fields["kq"], fields["k_scale"])
        n = kq.shape[0]
        quant = QuantPages(
            kq,
            k_scale,
            fields["k_zero"].reshape(n, -1),
            *(fields[name].reshape(n, p, -1) for name in ("vq", "v_scale", "v_zero")),
            bits=self.bits,
        )
        keys, values = dequantize(quant, self.dtype)  # one operator (torch.ops.pikv.dequant_pages) in eager code
        return keys.reshape(*lead, -1), values.reshape(*lead, -1)
