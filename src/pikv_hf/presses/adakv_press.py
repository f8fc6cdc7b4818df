"""AdaKV: adaptive per-head budgets, real per-head eviction in a PiKVCache."""

from __future__ import annotations

from dataclasses import dataclass

import kvpress
import torch
from kvpress.utils import compute_n_kept
from torch import nn

from pikv_hf.cache import PiKVCache
from pikv_hf.layer import PiKVLayer
from pikv_hf.presses.base import PiKVScorerPress, check_offload, drop_or_offload, prefill_layer, to_frame
from pikv_hf.routing.scores import descending_rank


def adaptive_keep(scores: torch.Tensor, pos: torch.Tensor, n_kept: int, alpha: float) -> torch.Tensor:
    """``[B, H, T]`` keep mask over entries at positions ``pos`` (``-1``: padding) with ``H * n_kept`` entries per
    row spread over heads by score: each head first keeps its ``max(1, int(alpha * n_kept))`` best (the safeguard),
    the rest of the row's budget goes to the best remaining entries of any head (AdaKV's allocation). Every head
    keeps its newest token."""
    b, h, t = scores.shape
    present = pos >= 0
    ranked = scores.masked_fill(~present, float("-inf"))
    ranked = ranked.scatter(2, pos.argmax(-1, keepdim=True), float("inf"))
    n_safe = max(1, int(n_kept * alpha)) if alpha > 0 and n_kept > 0 else 0
    if n_safe:
        top = ranked.topk(min(n_safe, t), dim=-1).indices
        ranked = ranked.scatter(2, top, float("inf"))
    total = present.sum(dim=(1, 2)).clamp(max=h * n_kept)  # [B]: a row of fewer tokens (padding) keeps them all
    keep = descending_rank(ranked.reshape(b, h * t)) < total.unsqueeze(-1)
    return keep.view(b, h, t) & present


@dataclass
class AdaKVPress(kvpress.AdaKVPress):
    """AdaKV (Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM
    Inference", 2024): the layer's budget of ``H * compute_n_kept(T, compression_ratio)`` tokens per row goes to
    the best-scored tokens of any head (``press`` scores them), each head keeping at least ``alpha_safeguard`` of its
    share. kvpress's own AdaKVPress only masks the dropped keys (a fake key per step) and frees nothing; on a
    ``PiKVCache`` this press evicts them, so every head holds only its own budget.

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
    replays_prefill = True
    budget_per_row = True  # decode-time budgets count a row's tokens over all its heads

    def __post_init__(self) -> None:
        super().__post_init__()
        check_offload(self.offload)

    def forward_hook(self, module: nn.Module, input: list[torch.Tensor], kwargs: dict, output: list):
        if not isinstance(kwargs["past_key_values"], PiKVCache):
            return super().forward_hook(module, input, kwargs, output)
        layer = prefill_layer(module, kwargs, self.compression_ratio)
        if layer is None:
            return output
        view = layer.view()
        scores = self.press.score(module, kwargs["hidden_states"], view.keys, view.values, output[1], kwargs)
        n_kept = compute_n_kept(view.pos.shape[-1], self.compression_ratio)
        keep_view = adaptive_keep(scores, view.pos, n_kept, self.alpha_safeguard)
        drop_or_offload(layer, to_frame(layer, view, keep_view), self.offload)
        return output

    def decode_keep(self, layer: PiKVLayer, n_kept: int) -> torch.Tensor:
        if not isinstance(self.press, PiKVScorerPress):
            raise ValueError("AdaKVPress ranks decoding tokens with its inner press's decode_scores: use a PiKV press")
        view = layer.view_index()
        keep_view = adaptive_keep(self.press.decode_scores(layer, n_kept), view.pos, n_kept, self.alpha_safeguard)
        return to_frame(layer, view, keep_view)
