"""``ChannelPrunePress``: structured pruning of low-magnitude key channels (ThinK, Xu et al. 2024, with the
channel magnitude as the criterion)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pikv_hf.codecs.projection import AffineMap, ProjectionCodec
from pikv_hf.presses.base import check_ratio
from pikv_hf.presses.compress_base import CompressorPress


@dataclass
class ChannelPrunePress(CompressorPress):
    """Prune, per layer and KV head, the ``int(channel_ratio * Dk)`` key channels of smallest L2 norm over the first
    tokens the layer compresses (its prefill); the tokens older than ``window`` keep only the other channels. The
    norms sum over the batch's rows: the rows of a batch share one choice of channels per (layer, head), so a row's
    result depends on the rows it is batched with (a press per row would need a map per row and head).

    The query side: a pruned channel decodes to zero, so ``q . k^`` sums over the kept channels only, exactly as if
    the query's pruned channels were dropped as well; attention stays consistent with no change to the queries (and
    the recent window, unpruned, keeps every channel). Values are stored as they are.

    Parameters
    ----------
    channel_ratio : float
        Fraction of key channels pruned, in ``[0, 1)``.
    window : int
        Recent positions kept exact (default 128).
    """

    channel_ratio: float = 0.25

    def check(self) -> None:
        check_ratio("channel_ratio", self.channel_ratio)

    def build_codec(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> ProjectionCodec:
        d = keys.shape[-1]
        kept = d - int(self.channel_ratio * d)
        norms = keys.float().square().sum(dim=(0, 2))  # [H, D]
        channels = norms.topk(kept, dim=-1).indices.sort(dim=-1).values.cpu()
        return ProjectionCodec(AffineMap.select(channels, d), None)
