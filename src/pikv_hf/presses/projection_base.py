"""Presses whose codec is a per-head low-rank projection fitted offline (SVD, LoRA, LoRA++, distilled)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from pikv_hf.codecs import fit
from pikv_hf.codecs.projection import AffineMap, ProjectionCodec
from pikv_hf.presses.compress_base import CompressorPress, kv_head_dims


def check_rank(rank: int, head_dim: int | None = None) -> None:
    """``ValueError`` unless ``rank`` is an integer in ``[1, head_dim]`` (``>= 1`` while the head dim is unknown)."""
    top = "head_dim" if head_dim is None else f"head_dim = {head_dim}"
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1 or (head_dim is not None and rank > head_dim):
        raise ValueError(f"rank must be an integer in [1, {top}], got {rank!r}")


@dataclass
class FittedProjectionPress(CompressorPress):
    """Keys and values older than ``window`` stored as ``rank`` coefficients of a projection fitted offline
    (:mod:`pikv_hf.codecs.fit`) for this very model; loaded when the press is applied to the model.

    Parameters
    ----------
    rank : int
        Coefficients per token, KV head and side, in ``[1, head_dim]``.
    path : str, optional
        The safetensors file of the fitted projection (default: ``fit.default_path(model, method, rank)``, under
        ``$PIKV_HF_CACHE/projections``). A file fitted for another model is refused.
    window : int
        Recent positions kept exact (default 128).
    """

    rank: int = 32
    path: str | None = None
    method: ClassVar[str] = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._maps: list[tuple[AffineMap, AffineMap]] | None = None  # loaded by setup (post_init_from_model)

    def check(self) -> None:
        check_rank(self.rank)

    def setup(self, model: nn.Module) -> None:
        check_rank(self.rank, min(kv_head_dims(model)))
        path = self.path or fit.default_path(model, self.method, self.rank)
        self._maps = fit.load(path, model, self.method, self.rank)

    def build_codec(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> ProjectionCodec:
        if self._maps is None:
            raise RuntimeError(
                f"{type(self).__name__}: its fitted projection is loaded when the press is applied to a model "
                "(`with press(model):` or press.post_init_from_model(model))"
            )
        return ProjectionCodec(*self._maps[layer_idx])
