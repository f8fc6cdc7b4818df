"""``FastVCropPress``: keep the first ``d'`` channels of keys and values (the PiKV paper's FastV-style crop)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pikv_hf.codecs.projection import AffineMap, ProjectionCodec
from pikv_hf.presses.compress_base import CompressorPress, kv_head_dims


def check_channels(channels: int, head_dim: int | None = None) -> None:
    top = "head_dim" if head_dim is None else f"head_dim = {head_dim}"
    bad = isinstance(channels, bool) or not isinstance(channels, int) or channels < 1
    if bad or (head_dim is not None and channels > head_dim):
        raise ValueError(f"channels must be an integer in [1, {top}], got {channels!r}")


@dataclass
class FastVCropPress(CompressorPress):
    """Tokens older than ``window`` keep only channels ``0 .. channels - 1`` of their keys and values (the others
    read as zero): a crop of the head dim, stored as ``channels`` values per token and side.

    Parameters
    ----------
    channels : int
        ``d'``, channels kept, in ``[1, head_dim]``.
    window : int
        Recent positions kept exact (default 128).
    """

    channels: int = 48

    def check(self) -> None:
        check_channels(self.channels)

    def setup(self, model: nn.Module) -> None:
        check_channels(self.channels, min(kv_head_dims(model)))

    def build_codec(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> ProjectionCodec:
        maps = []
        for x in (keys, values):
            check_channels(self.channels, x.shape[-1])
            first = torch.arange(self.channels).expand(x.shape[1], -1)
            maps.append(AffineMap.select(first, x.shape[-1]))
        return ProjectionCodec(*maps)
