"""The identity codec: keys and values stored in the model dtype, exactly as the model produced them."""

from __future__ import annotations

import torch

from pikv_hf.codecs.base import Codec
from pikv_hf.store.pool import FieldSpec, PagePool


class IdentityCodec(Codec):
    """Keys ``[P, Dk]`` and values ``[P, Dv]`` per page in the model dtype; decoding returns them unchanged."""

    name = "identity"
    lossless = True

    def fields(self, k_dim: int, v_dim: int, dtype: torch.dtype) -> dict[str, FieldSpec]:
        return {"keys": FieldSpec((k_dim,), dtype), "values": FieldSpec((v_dim,), dtype)}

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"keys": keys, "values": values}

    def decode(self, fields: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return fields["keys"], fields["values"]

    def slot_keys(self, pool: PagePool, slots: torch.Tensor, names: tuple[str, ...]) -> torch.Tensor:
        return pool.flat("keys").index_select(0, slots)
