"""LRU: evict the least recently used tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pikv_hf.layer import PiKVLayer
from pikv_hf.presses.base import PiKVScorerPress, keep_newest
from pikv_hf.presses.queries import attention_statistics


def recency(last_hit: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """When each token was last used: the position of the last query that hit it, or its own position (its
    insertion) when none did or it was inserted later; ties go to the newer token (``+ pos / (2 * (max pos + 1))``,
    less than one step), so that every cache keeps the same tokens."""
    span = 2.0 * (pos.amax(-1, keepdim=True).clamp(min=0) + 1).double()
    return torch.maximum(last_hit, pos).double() + pos.double() / span


@dataclass
class LRUPress(PiKVScorerPress):
    """Least-recently-used eviction (the cache policy of operating systems, applied to KV pairs as in the PiKV
    paper's scheduler table): keep the ``compute_n_kept(T, compression_ratio)`` tokens of each (row, KV head) that were
    used most recently. A token is *used* by a query that gives it more than a uniform share of its attention
    (summed over the query heads of the KV head), and when it is inserted.

    At prefill the uses are recomputed from the model's own queries (``presses.queries``); during decoding in a
    ``PiKVCache`` they are the ``last_access`` its attention path records (``track_stats=True``).
    """

    recomputes_queries = True

    def score(self, module: nn.Module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        stats = attention_statistics(module, hidden_states, keys, kwargs)
        pos = torch.arange(keys.shape[2], device=keys.device).expand_as(stats.last_hit)
        return keep_newest(recency(stats.last_hit, pos))

    def decode_scores(self, layer: PiKVLayer, n_kept: int) -> torch.Tensor:
        if "last_access" not in layer.store.pool.fields:
            name = type(self).__name__
            raise ValueError(f"{name} scores decoding from token uses: build PiKVCache(track_stats=True)")
        view = layer.view_index()
        return recency(layer.view_field("last_access", view).long(), view.pos)
