"""KIVI quantisation as a press (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache")."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pikv_hf.checks import check_int_at_least
from pikv_hf.codecs.quant import QuantCodec, check_quant_args
from pikv_hf.presses.compress_base import CompressorPress, kv_head_dims


@dataclass
class QuantPress(CompressorPress):
    """Asymmetric ``bits``-bit quantisation of the tokens older than ``window``: keys per channel over groups of
    ``key_group_size`` tokens (one compressed page), values per token over groups of ``group_size`` channels, packed
    integer codes plus float16 scales and zeros (:class:`pikv_hf.codecs.QuantCodec`, the layout of
    :mod:`pikv_hf.kernels.decode_quant`).

    Bytes per compressed token and KV head: ``(Dk + Dv) * bits / 8`` of codes, ``4 * Dv / G`` of value scales and
    zeros and ``4 * Dk / G_k`` of key scales and zeros (per page of ``G_k`` tokens): 72 B at 4 bits with
    ``D = G = G_k = 64``, 70 B with ``G_k = 128`` (fp16 K/V: 256 B).

    Parameters
    ----------
    bits : int
        2, 4 or 8.
    group_size : int
        ``G``: value channels per scale (and, by default, tokens per key group); must divide the head dim.
    key_group_size : int, optional
        ``G_k``: tokens per key scale, the compressed page (default ``group_size``, as KIVI).
    window : int
        Recent positions kept in full precision (KIVI's residual, default 128).
    """

    bits: int = 4
    group_size: int = 64
    key_group_size: int | None = None

    def check(self) -> None:
        check_quant_args(self.bits, self.group_size)
        if self.key_group_size is not None:
            check_int_at_least("key_group_size", self.key_group_size, 1)

    @property
    def page_size(self) -> int:
        return self.key_group_size or self.group_size

    def setup(self, model: nn.Module) -> None:
        check_quant_args(self.bits, self.group_size, kv_head_dims(model)[1])

    def build_codec(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> QuantCodec:
        check_quant_args(self.bits, self.group_size, values.shape[-1])
        return QuantCodec(self.bits, self.group_size)
