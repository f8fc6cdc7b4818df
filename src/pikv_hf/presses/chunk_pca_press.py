"""``ChunkPCAPress``: block PCA of each chunk of tokens (the PiKV paper's chunk-wise low-rank compression)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pikv_hf.checks import check_int_at_least
from pikv_hf.codecs.chunk_pca import ChunkPCACodec
from pikv_hf.presses.compress_base import CompressorPress, kv_head_dims
from pikv_hf.presses.projection_base import check_rank


@dataclass
class ChunkPCAPress(CompressorPress):
    """Each chunk of ``chunk_size`` tokens of a KV head (one compressed page) keeps the mean and top-``rank``
    principal directions of its keys and of its values; every token keeps ``rank`` coefficients per side
    (:class:`pikv_hf.codecs.ChunkPCACodec`). No calibration: the bases are fitted to the chunk itself.

    Bytes per token and side: ``rank + (D + rank * D) / chunk_size`` elements of the model dtype (``D`` for a dense
    cache).

    Parameters
    ----------
    rank : int
        Principal directions per chunk, in ``[1, head_dim]``.
    chunk_size : int
        Tokens per chunk (>= 1).
    window : int
        Recent positions kept exact (default 128).
    """

    rank: int = 16
    chunk_size: int = 64

    def check(self) -> None:
        check_rank(self.rank)
        check_int_at_least("chunk_size", self.chunk_size, 1)

    @property
    def page_size(self) -> int:
        return self.chunk_size

    def setup(self, model: nn.Module) -> None:
        check_rank(self.rank, min(kv_head_dims(model)))

    def build_codec(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> ChunkPCACodec:
        check_rank(self.rank, min(keys.shape[-1], values.shape[-1]))
        return ChunkPCACodec(self.rank)
