"""Codecs: how pool pages hold keys and values (identity, KIVI quantisation, low-rank projections, block PCA)."""

from pikv_hf.codecs.base import Codec, PageBatch
from pikv_hf.codecs.chunk_pca import ChunkPCACodec
from pikv_hf.codecs.identity import IdentityCodec
from pikv_hf.codecs.projection import AffineMap, ProjectionCodec
from pikv_hf.codecs.quant import QuantCodec

__all__ = ["AffineMap", "ChunkPCACodec", "Codec", "IdentityCodec", "PageBatch", "ProjectionCodec", "QuantCodec"]
