"""H2O: heavy hitters and recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvpress.utils import compute_n_kept
from torch import nn

from pikv_hf.layer import PiKVLayer
from pikv_hf.presses.base import PiKVScorerPress, keep_newest
from pikv_hf.presses.queries import attention_statistics


def protect_recent(scores: torch.Tensor, pos: torch.Tensor, n_recent: int) -> torch.Tensor:
    """``scores`` (``[B, H, T]``) with the ``n_recent`` most recent entries (by position ``pos``, ``-1``: padding)
    of every (row, head) raised above every other entry."""
    if n_recent <= 0:
        return scores
    newest = pos.amax(-1, keepdim=True)
    recent = (pos > newest - n_recent) & (pos >= 0)
    return torch.where(recent, scores.abs().amax() + 1 + pos.float(), scores)


@dataclass
class H2OPress(PiKVScorerPress):
    """H2O, the Heavy-Hitter Oracle (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of
    Large Language Models", NeurIPS 2023).

    Of each (row, KV head)'s budget of ``n_kept = compute_n_kept(T, compression_ratio)`` tokens, ``recent_ratio``
    goes to the most recent tokens and the rest to the *heavy hitters*: the tokens whose attention probability, summed
    over every query so far and over the query heads sharing the KV head, is largest.

    Scores are ``[B, H, T]`` over the cache's position-ordered keys ``[B, H, T, D]``. At prefill they are recomputed
    from the model's own queries (``presses.queries``: ``q_norm`` and RoPE as the model applies them); during
    decoding in a ``PiKVCache`` they are the accumulated attention mass its attention path keeps per slot
    (``PiKVCache(..., track_stats=True)``), not recomputed.

    Parameters
    ----------
    compression_ratio : float
        Fraction of the context's KV pairs removed per (row, KV head), in ``[0, 1)``.
    recent_ratio : float
        Share of the kept budget reserved for the most recent tokens, in ``[0, 1]`` (the paper splits it evenly).
    """

    recomputes_queries = True

    recent_ratio: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.recent_ratio, bool) or not 0 <= self.recent_ratio <= 1:
            raise ValueError(f"recent_ratio must be a number in [0, 1], got {self.recent_ratio!r}")

    def _with_recent(self, mass: torch.Tensor, pos: torch.Tensor, n_kept: int) -> torch.Tensor:
        return protect_recent(mass, pos, int(self.recent_ratio * n_kept))

    def score(self, module: nn.Module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        t = keys.shape[2]
        stats = attention_statistics(module, hidden_states, keys, kwargs, with_hits=False)
        pos = torch.arange(t, device=keys.device).expand_as(stats.mass)
        return keep_newest(self._with_recent(stats.mass, pos, compute_n_kept(t, self.compression_ratio)))

    def decode_scores(self, layer: PiKVLayer, n_kept: int) -> torch.Tensor:
        if "attn_mass" not in layer.store.pool.fields:
            raise ValueError("H2OPress scores decoding from accumulated attention: build PiKVCache(track_stats=True)")
        view = layer.view_index()
        return self._with_recent(layer.view_field("attn_mass", view), view.pos, n_kept)
