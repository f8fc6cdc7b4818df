"""LRU+: recency and frequency of use together."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pikv_hf.layer import PiKVLayer
from pikv_hf.presses.base import PiKVScorerPress, keep_newest
from pikv_hf.presses.lru_press import relative, view_statistics
from pikv_hf.presses.queries import attention_statistics
from pikv_hf.view import DenseView


def recency_frequency(last: torch.Tensor, hits: torch.Tensor, pos: torch.Tensor, weight: float) -> torch.Tensor:
    """``(1 - weight) * recency / now + weight * hits / max hits``, per (row, head); both terms in ``[0, 1]``, ties
    to the newer token (``pos``, ``last``: positions counted from the row's first real token)."""
    now = pos.amax(-1, keepdim=True).clamp(min=1).double()
    most = hits.amax(-1, keepdim=True).clamp(min=1).double()
    blend = (1 - weight) * torch.maximum(last, pos).double() / now + weight * hits.double() / most
    return blend + pos.double() * 1e-9 / now  # float64: the tie-break survives


@dataclass
class LRUPlusPress(PiKVScorerPress):
    """LRU+ (recency and frequency, in the spirit of LRFU, Lee et al., IEEE Trans. Computers 2001): a token's score
    blends how recently it was used with how often, ``(1 - frequency_weight) * recency + frequency_weight *
    frequency``, each normalised to ``[0, 1]`` within its (row, KV head); the ``compute_n_kept(T, compression_ratio)``
    best are kept. Uses are counted as in :class:`LRUPress` (prefill: recomputed; decoding in a PiKVCache: the
    ``hits`` and ``last_access`` its attention path records).

    Parameters
    ----------
    frequency_weight : float
        Weight of the frequency term, in ``[0, 1]`` (0 is LRU).
    """

    recomputes_queries = True
    decode_stats = ("last_access", "hits")

    frequency_weight: float = 0.5

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.frequency_weight <= 1:
            raise ValueError(f"frequency_weight must be a number in [0, 1], got {self.frequency_weight!r}")

    def score(self, module: nn.Module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        stats = attention_statistics(module, hidden_states, keys, kwargs)
        pos = torch.arange(keys.shape[2], device=keys.device).expand_as(stats.hits)
        return keep_newest(recency_frequency(stats.last_hit, stats.hits, pos, self.frequency_weight))

    def score_view(self, module: nn.Module, kwargs: dict, view: DenseView, attentions) -> torch.Tensor:
        stats = view_statistics(module, kwargs, view)
        scores = recency_frequency(relative(stats.last_hit, view), stats.hits, view.rel_pos, self.frequency_weight)
        return keep_newest(scores, view.pos)

    def decode_scores(self, layer: PiKVLayer, view: DenseView, n_kept: int) -> torch.Tensor:
        last = relative(layer.slot_stat("last_access", view).long(), view)
        hits = layer.slot_stat("hits", view).long().masked_fill(~view.valid, 0)
        return keep_newest(recency_frequency(last, hits, view.rel_pos, self.frequency_weight), view.pos)
