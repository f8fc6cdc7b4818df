"""H2O: heavy hitters and recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvpress.utils import compute_n_kept
from torch import nn

from pikv_hf.layer import PiKVLayer
from pikv_hf.presses.base import PiKVScorerPress, keep_newest
from pikv_hf.presses.queries import KeyLayout, attention_statistics
from pikv_hf.view import DenseView


def protect_recent(scores: torch.Tensor, pos: torch.Tensor, n_recent: torch.Tensor | int) -> torch.Tensor:
    """``scores`` (``[B, H, T]``) with the ``n_recent`` (an int or ``[B, H]``) most recent entries (by position
    ``pos``, ``-1``: padding) of every (row, head) raised above every other entry."""
    n_recent = torch.as_tensor(n_recent, device=pos.device).expand(pos.shape[:2]).unsqueeze(-1)
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
    from the model's own queries (``presses.queries``: ``q_norm`` and RoPE as the model applies them; in a PiKVCache
    padding queries and keys take no part); during decoding in a ``PiKVCache`` they are the accumulated attention
    mass its attention path keeps per slot (tracked from the prefill on once this press sees the cache), not
    recomputed.

    Parameters
    ----------
    compression_ratio : float
        Fraction of the context's KV pairs removed per (row, KV head), in ``[0, 1)``.
    recent_ratio : float
        Share of the kept budget reserved for the most recent tokens, in ``[0, 1]`` (the paper splits it evenly).
    """

    recomputes_queries = True
    decode_stats = ("attn_mass",)

    recent_ratio: float = 0.5

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.recent_ratio <= 1:
            raise ValueError(f"recent_ratio must be a number in [0, 1], got {self.recent_ratio!r}")

    def _with_recent(self, mass: torch.Tensor, pos: torch.Tensor, n_kept: torch.Tensor | int) -> torch.Tensor:
        n_recent = (torch.as_tensor(n_kept, device=pos.device).double() * self.recent_ratio).floor().long()
        return protect_recent(mass, pos, n_recent)

    def score(self, module: nn.Module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        t = keys.shape[2]
        stats = attention_statistics(module, hidden_states, keys, kwargs, with_hits=False)
        pos = torch.arange(t, device=keys.device).expand_as(stats.mass)
        return keep_newest(self._with_recent(stats.mass, pos, compute_n_kept(t, self.compression_ratio)))

    def score_view(self, module: nn.Module, kwargs: dict, view: DenseView, attentions) -> torch.Tensor:
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        layout = KeyLayout.of(layer, view)
        stats = attention_statistics(module, kwargs["hidden_states"], view.keys, kwargs, False, layout)
        return keep_newest(self._with_recent(stats.mass, view.rel_pos, self.budget(module, view)), view.pos)

    def decode_scores(self, layer: PiKVLayer, view: DenseView, n_kept: int) -> torch.Tensor:
        return keep_newest(self._with_recent(layer.slot_stat("attn_mass", view), view.rel_pos, n_kept), view.pos)
