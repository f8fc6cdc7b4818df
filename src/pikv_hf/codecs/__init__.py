"""Codecs: how pool pages hold keys and values (identity today; compressed codecs plug in at the same seam)."""

from pikv_hf.codecs.base import Codec
from pikv_hf.codecs.identity import IdentityCodec

__all__ = ["Codec", "IdentityCodec"]
