"""AdaKV: adaptive per-head budgets, real per-head eviction in a PiKVCache."""

from __future__ import annotations

from dataclasses import dataclass

import kvpress
import torch
from torch import nn

from pikv_hf.layer import PiKVLayer
from pikv_hf.presses.base import (
    PiKVPress,
    PiKVScorerPress,
    check_offload,
    drop_or_offload,
    kvpress_scores,
    prefill_layer,
    row_budgets,
)
from pikv_hf.routing.scores import descending_rank
from pikv_hf.view import DenseView


def adaptive_keep(scores: torch.Tensor, view: DenseView, n_kept: torch.Tensor, alpha: float) -> torch.Tensor:
    """``[B, H, T]`` keep mask over ``view``'s entries with ``sum_h n_kept[b, h]`` entries per row ``b`` (``n_kept``:
    ``[B, H]``, each head's share of its own tokens) spread over heads by score: each head first keeps its
    ``max(1, int(alpha * n_kept))`` best (the safeguard), the rest of the row's budget goes to the best remaining
    entries of any head (AdaKV's allocation). Nothing is forced in beyond what ``scores`` rank first, as kvpress's
    AdaKVPress on a DynamicCache."""
    b, h, t = scores.shape
    present = view.valid
    ranked = scores.masked_fill(~present, float("-inf"))
    n_safe = torch.where(n_kept > 0, (n_kept.double() * alpha).floor().long().clamp(min=1), 0) if alpha > 0 else None
    if n_safe is not None:
        ranked = torch.where(descending_rank(ranked) < n_safe.unsqueeze(-1), float("inf"), ranked)
    total = n_kept.sum(-1).minimum(present.sum(dim=(1, 2)))  # [B]
    keep = descending_rank(ranked.reshape(b, h * t)) < total.unsqueeze(-1)
    return keep.view(b, h, t) & present


@dataclass
class AdaKVPress(PiKVPress, kvpress.AdaKVPress):
    """AdaKV (Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM
    Inference", 2024): the layer's budget of ``H * compute_n_kept(T, compression_ratio)`` tokens per row goes to
    the best-scored tokens of any head (``press`` scores them), each head keeping at least ``alpha_safeguard`` of its
    share. kvpress's own AdaKVPress only masks the dropped keys (a fake key per step) and frees nothing; on a
    ``PiKVCache`` this press evicts them, so every head holds only its own budget (``T`` counts a row's own tokens:
    left padding takes none).

    On a ``DynamicCache`` it is kvpress's ``AdaKVPress``. During decoding (``DecodingBudgetPress``) in a PiKVCache the
    same allocation ranks tokens with the inner press's cache-statistics scores (a PiKV press).

    Parameters
    ----------
    press : kvpress.ScorerPress
        Scores the tokens (``[B, H, T]``).
    alpha_safeguard : float
        Minimum share of its budget every head keeps.
    offload : str or None
        PiKVCache only: move dropped tokens to the offload tier (``"cpu"`` / ``"disk"``) instead of dropping them.
    """

    offload: str | None = None
    masks_keys = True
    budget_per_row = True  # decode-time budgets count a row's tokens over all its heads

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        super().validate()
        a = self.alpha_safeguard
        if not isinstance(a, (int, float)) or isinstance(a, bool) or not 0 <= a <= 1:
            raise ValueError(f"alpha_safeguard must be a number in [0, 1], got {a!r}")
        if not isinstance(self.press, kvpress.ScorerPress):
            raise TypeError(f"press must be a kvpress ScorerPress (it scores tokens), got {type(self.press).__name__}")
        check_offload(self.offload)

    @property
    def decode_stats(self) -> tuple[str, ...]:
        """The base press's: AdaKV under a decoding budget ranks tokens as its base press does."""
        return getattr(self.press, "decode_stats", ())

    def press_layer(self, module: nn.Module, layer: PiKVLayer, kwargs: dict, output: list) -> None:
        layer = prefill_layer(module, kwargs, self.compression_ratio)
        if layer is None:
            return
        view = layer.view()
        if isinstance(self.press, PiKVScorerPress):
            scores = self.press.score_view(module, kwargs, view, output[1])
        else:
            scores = kvpress_scores(self.press, module, kwargs, view, output[1])
        n_kept = row_budgets(view.count, self.compression_ratio)
        drop_or_offload(layer, view, adaptive_keep(scores, view, n_kept, self.alpha_safeguard), self.offload)

    def decode_keep(self, layer: PiKVLayer, view: DenseView, n_kept: int) -> torch.Tensor:
        if not isinstance(self.press, PiKVScorerPress):
            raise ValueError("AdaKVPress ranks decoding tokens with its inner press's decode_scores: use a PiKV press")
        scores = self.press.decode_scores(layer, view, n_kept)
        budget = torch.full(view.count.shape, n_kept, device=view.pos.device)
        return adaptive_keep(scores, view, budget, self.alpha_safeguard)
