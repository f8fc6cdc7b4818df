"""LRU: evict the least recently used tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pikv_hf.layer import PiKVLayer
from pikv_hf.presses.base import PiKVScorerPress, keep_newest
from pikv_hf.presses.queries import AttentionStatistics, KeyLayout, attention_statistics
from pikv_hf.view import DenseView


def recency(last_hit: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """When each token was last used: the position of the last query that hit it, or its own position (its
    insertion) when none did or it was inserted later; ties go to the newer token (``+ pos / (2 * (max pos + 1))``,
    less than one step), so that every cache keeps the same tokens."""
    span = 2.0 * (pos.amax(-1, keepdim=True).clamp(min=0) + 1).double()
    return torch.maximum(last_hit, pos).double() + pos.double() / span


def relative(positions: torch.Tensor, view: DenseView) -> torch.Tensor:
    """Positions (``[B, H, T]``, ``-1``: none) counted from each row's first real token, as ``view.rel_pos`` counts
    the entries' own."""
    return torch.where(positions >= 0, positions - view.row_start.view(-1, 1, 1), -1)


def view_statistics(module: nn.Module, kwargs: dict, view: DenseView) -> AttentionStatistics:
    """Prefill attention statistics of a PiKVCache layer's view (padding queries and entries take no part)."""
    layer = kwargs["past_key_values"].layers[module.layer_idx]
    return attention_statistics(module, kwargs["hidden_states"], view.keys, kwargs, True, KeyLayout.of(layer, view))


@dataclass
class LRUPress(PiKVScorerPress):
    """Least-recently-used eviction (the cache policy of operating systems, applied to KV pairs as in the PiKV
    paper's scheduler table): keep the ``compute_n_kept(T, compression_ratio)`` tokens of each (row, KV head) that were
    used most recently. A token is *used* by a query that gives it more than a uniform share of its attention
    (summed over the query heads of the KV head), and when it is inserted.

    At prefill the uses are recomputed from the model's own queries (``presses.queries``); during decoding in a
    ``PiKVCache`` they are the ``last_access`` its attention path records (tracked once this press sees the cache).
    """

    recomputes_queries = True
    decode_stats = ("last_access",)

    def score(self, module: nn.Module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        stats = attention_statistics(module, hidden_states, keys, kwargs)
        pos = torch.arange(keys.shape[2], device=keys.device).expand_as(stats.last_hit)
        return keep_newest(recency(stats.last_hit, pos))

    def score_view(self, module: nn.Module, kwargs: dict, view: DenseView, attentions) -> torch.Tensor:
        stats = view_statistics(module, kwargs, view)
        return keep_newest(recency(relative(stats.last_hit, view), view.rel_pos), view.pos)

    def decode_scores(self, layer: PiKVLayer, view: DenseView, n_kept: int) -> torch.Tensor:
        return keep_newest(recency(relative(layer.slot_stat("last_access", view).long(), view), view.rel_pos), view.pos)
