"""Entropy-penalised load balancing over the running selection frequencies."""

from __future__ import annotations

import torch

from pikv_hf.routing.base import Selector, ShardSummary, check_select_args
from pikv_hf.routing.scores import check_score_kind, check_weight, masked_topk, shard_log_probs


class EPLBSelector(Selector):
    """Top-k of routing log-probabilities plus the entropy gain of choosing each shard.

    State: running selection counts ``c`` ``[H, S]`` (summed over batch rows, so batch reordering needs no
    handling), smoothed into frequencies ``f_s = (c_s + prior) / (sum c + S * prior)`` with entropy
    ``E(f) = -sum f log f``. Adding a selection of shard ``s`` changes ``E`` at rate
    ``dE/dc_s = (-log f_s - E(f)) / (sum c + S * prior)``; its scale-free part is the bonus

    ``a_s = log p_s + strength * (-log f_s - E(f))``,

    positive for under-used shards (choosing them raises the entropy of the selection distribution) and negative
    for over-used ones, so choices that lower the entropy are penalised. With no history ``f`` is uniform, the
    bonus is 0 and the choice is ``TopKSelector``'s. After each ``select`` the counts become
    ``c <- decay * c + (times each shard was chosen in the batch)``. The EPLB router of the PiKV paper ("PiKV: KV
    Cache Management System for Mixture of Experts", Liu et al., 2025); the name follows DeepSeek's
    expert-parallelism load balancer (EPLB, DeepSeek-V3 technical report, 2024), which shares the goal of even
    expert load by replicating hot experts; the entropy bonus here is this library's selection-time formulation.

    Parameters
    ----------
    strength : float
        Bonus weight ``>= 0`` in log-probability units (default 0.5); 0 is ``TopKSelector`` (counts still kept).
    decay : float
        Factor in ``[0, 1]`` on the counts before each update (default 1.0: plain running counts; < 1 forgets
        old selections with half-life ``log 0.5 / log decay`` steps).
    prior : float
        Laplace pseudo-count ``> 0`` per shard (default 1.0).
    score : str
        ``"centroid"`` (default) or ``"bound"``.

    Notes
    -----
    ``select(query [B, H, G, D], summary, k) -> [B, H, k]`` int64. The number of heads and shards is fixed by
    the first ``select`` after construction or ``reset()``; another shape raises ``ValueError``.
    """

    name = "eplb"

    def __init__(self, strength: float = 0.5, decay: float = 1.0, prior: float = 1.0, score: str = "centroid") -> None:
        self.strength = check_weight("strength", strength)
        self.decay = check_weight("decay", decay)
        if self.decay > 1:
            raise ValueError(f"decay must be in [0, 1], got {decay}")
        self.prior = check_weight("prior", prior)
        if self.prior == 0:
            raise ValueError("prior must be > 0 (it keeps log f finite)")
        self.score = check_score_kind(score)
        self.counts: torch.Tensor | None = None

    def reset(self) -> None:
        """Forget the selection history (a new sequence starts)."""
        self.counts = None

    def entropy_bonus(self, num_heads: int, num_shards: int, device: torch.device) -> torch.Tensor:
        """``[H, S]`` float32 ``-log f_s - E(f)`` of the current counts (zeros before any selection)."""
        if self.counts is None:
            return torch.zeros(num_heads, num_shards, device=device)
        if tuple(self.counts.shape) != (num_heads, num_shards):
            raise ValueError(
                f"summary has H={num_heads} heads and S={num_shards} shards but this EPLBSelector counts "
                f"{tuple(self.counts.shape)}; call reset() before reusing it for another layer shape"
            )
        counts = self.counts.to(device) + self.prior
        log_f = counts.log() - counts.sum(dim=-1, keepdim=True).log()
        entropy = -(log_f.exp() * log_f).sum(dim=-1, keepdim=True)
        return -log_f - entropy

    def select(self, query: torch.Tensor, summary: ShardSummary, k: int) -> torch.Tensor:
        check_select_args(query, summary, k)
        _, h, s = summary.counts.shape
        bonus = self.entropy_bonus(h, s, query.device)
        adjusted = shard_log_probs(query, summary, self.score) + self.strength * bonus
        selected = masked_topk(adjusted, k, summary.counts > 0)
        chosen = torch.zeros(summary.counts.shape, device=query.device).scatter_(-1, selected, 1.0).sum(dim=0)
        self.counts = chosen if self.counts is None else self.decay * self.counts.to(query.device) + chosen
        return selected
