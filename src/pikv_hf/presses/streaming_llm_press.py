"""StreamingLLM: attention sinks and a recent window."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pikv_hf.checks import check_int_at_least
from pikv_hf.layer import PiKVLayer
from pikv_hf.presses.base import PiKVScorerPress
from pikv_hf.view import DenseView

_ABOVE_POSITIONS = float(2**24)  # float32 holds every integer below it


def sink_recent_scores(rel_pos: torch.Tensor, n_sink: int) -> torch.Tensor:
    """``[B, H, T]`` scores ranking the first ``n_sink`` positions of each row first (the earliest first), then the
    most recent, older last (``rel_pos``: positions counted from the row's first real token; ``-1``: padding). No two
    entries of a (row, head) tie, so a budget smaller than ``n_sink`` keeps the same sinks under any top-k (kvpress's
    ``torch.topk`` on a DynamicCache, a stable sort in a PiKVCache)."""
    pos = rel_pos.float()  # exact below 2**24: sink p scores 2**24 - p, above every position
    return torch.where((rel_pos >= 0) & (rel_pos < n_sink), _ABOVE_POSITIONS - pos, pos)


@dataclass
class StreamingLLMPress(PiKVScorerPress):
    """StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024): keep the
    first ``n_sink`` tokens of each row (attention sinks: its first real tokens, after any left padding) and the most
    recent ones, ``compute_n_kept(T, compression_ratio)`` per (row, KV head) in all. Scores depend on position only,
    so prefill and decode-time budgets need no statistics.

    Parameters
    ----------
    compression_ratio : float
        Fraction of the context's KV pairs removed per (row, KV head), in ``[0, 1)``.
    n_sink : int
        Attention-sink tokens always kept.
    """

    n_sink: int = 4

    def validate(self) -> None:
        super().validate()
        check_int_at_least("n_sink", self.n_sink, 0)

    def score(self, module: nn.Module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        b, h, t, _ = keys.shape
        return sink_recent_scores(torch.arange(t, device=keys.device).expand(b, h, t), self.n_sink)

    def score_view(self, module: nn.Module, kwargs: dict, view: DenseView, attentions) -> torch.Tensor:
        return sink_recent_scores(view.rel_pos, self.n_sink)

    def decode_scores(self, layer: PiKVLayer, view: DenseView, n_kept: int) -> torch.Tensor:
        return sink_recent_scores(view.rel_pos, self.n_sink)
