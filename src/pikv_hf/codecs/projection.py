"""Low-rank projection pages: every token's key (and / or value) stored as ``r`` coefficients of a per-KV-head
affine map, decoded on read.

One codec serves every linear compressor of the PiKV paper's table 2: a truncated SVD (``down = V_r``,
``up = V_r^T``), LoRA / LoRA++ (learned ``down`` / ``up``, LoRA++ with biases), a distilled projection, FastV's crop
(``down`` selects the first ``d'`` channels) and channel pruning (``down`` selects the kept channels; the pruned
channels decode to zero, so ``q . k`` sums over the kept channels only, exactly as if the query's pruned channels
were dropped too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pikv_hf.codecs.base import Codec, PageBatch, as_pages
from pikv_hf.store.pool import FieldSpec


@dataclass
class AffineMap:
    """Per-KV-head affine down / up maps of one layer's keys or values.

    ``c = x @ down[h] + down_bias[h]`` (``[r]`` per token) and ``x^ = c @ up[h] + up_bias[h]`` (``[D]``).

    Attributes
    ----------
    down : torch.Tensor
        ``[H, D, r]``.
    up : torch.Tensor
        ``[H, r, D]``.
    down_bias, up_bias : torch.Tensor
        ``[H, r]`` and ``[H, D]``.
    """

    down: torch.Tensor
    up: torch.Tensor
    down_bias: torch.Tensor
    up_bias: torch.Tensor

    @classmethod
    def linear(cls, down: torch.Tensor, up: torch.Tensor) -> AffineMap:
        """A map without biases."""
        h, d, r = down.shape
        return cls(down, up, down.new_zeros(h, r), up.new_zeros(h, d))

    @classmethod
    def select(cls, channels: torch.Tensor, dim: int) -> AffineMap:
        """Keep ``channels`` (``[H, r]`` int64 per head) of ``dim``: ``c`` holds them, the others decode to zero."""
        h, r = channels.shape
        down = torch.zeros(h, dim, r)
        down.scatter_(1, channels.unsqueeze(1), 1.0)
        return cls.linear(down, down.transpose(1, 2).contiguous())

    @property
    def rank(self) -> int:
        return self.down.shape[-1]

    @property
    def dim(self) -> int:
        return self.down.shape[1]

    @property
    def heads(self) -> int:
        return self.down.shape[0]

    def to(self, device: torch.device) -> AffineMap:
        return AffineMap(*(t.to(device=device, dtype=torch.float32) for t in self.tensors()))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.down, self.up, self.down_bias, self.up_bias

    def encode(self, x: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """``[N, P, D]`` -> ``[N, P, r]`` float32, page ``i`` through head ``heads[i]``'s map."""
        return torch.baddbmm(self.down_bias[heads].unsqueeze(1), x.float(), self.down[heads])

    def decode(self, c: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """``[N, P, r]`` -> ``[N, P, D]`` float32."""
        return torch.baddbmm(self.up_bias[heads].unsqueeze(1), c.float(), self.up[heads])


class ProjectionCodec(Codec):
    """Keys and / or values stored as ``r`` coefficients per token (model dtype) of per-head :class:`AffineMap` s;
    a side without a map is stored as it is. Each page also holds its KV head (int16), which picks the maps.

    Parameters
    ----------
    key_map, value_map : AffineMap or None
        This layer's maps (``None``: that side uncompressed).
    """

    name = "projection"
    page_level = True

    def __init__(self, key_map: AffineMap | None, value_map: AffineMap | None) -> None:
        self.maps = {"keys": key_map, "values": value_map}
        self.dtype = torch.float32

    def tensors(self) -> list[torch.Tensor]:
        return [t for m in self.maps.values() if m is not None for t in (m.down, m.up, m.down_bias, m.up_bias)]

    def fields(self, k_dim: int, v_dim: int, dtype: torch.dtype) -> dict[str, FieldSpec]:
        self.dtype = dtype
        out = {}
        for side, dim in (("keys", k_dim), ("values", v_dim)):
            m = self.maps[side]
            if m is not None and m.dim != dim:
                raise ValueError(f"the {side} map projects {m.dim} channels, the layer's head dim is {dim}")
            out[side] = FieldSpec((dim if m is None else m.rank,), dtype)
        out["head"] = FieldSpec((), torch.int16, per_page=True)
        return out

    def encode_pages(self, batch: PageBatch) -> dict[str, torch.Tensor]:
        out = {"head": batch.heads.to(torch.int16)}
        for side, x in (("keys", batch.keys), ("values", batch.values)):
            m = self.maps[side]
            coded = x if m is None else m.to(x.device).encode(x, batch.heads)
            out[side] = batch.keep_old(side, coded)
        return out

    def decode(self, fields: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for side in ("keys", "values"):
            c, m = fields[side], self.maps[side]
            if m is None:
                out.append(c)
                continue
            pages, heads, _ = as_pages(c, fields["head"], page_dims=0)
            x = m.to(c.device).decode(pages, heads.long())
            out.append(x.to(self.dtype).reshape(*c.shape[:-1], m.dim))
        return out[0], out[1]
