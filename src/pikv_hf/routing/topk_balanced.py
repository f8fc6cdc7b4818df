"""Top-k selection with a load-balance penalty on shard occupancy."""

from __future__ import annotations

import torch

from pikv_hf.routing.base import Selector, ShardSummary, check_select_args
from pikv_hf.routing.scores import check_score_kind, check_weight, log_occupancy, masked_topk, shard_log_probs


class BalancedTopKSelector(Selector):
    """Top-k of routing log-probabilities minus a penalty on how full each shard is.

    ``a_s = log p_s - strength * log(n_s / mean n)``, where ``p`` is the routing softmax of ``TopKSelector``,
    ``n_s`` the tokens stored in shard ``s`` and ``mean n`` the mean over the row's non-empty shards. A shard
    fuller than average must score higher to be chosen, which evens out the tokens read per selected shard (the
    load-balanced top-k router of the PiKV paper, "PiKV: KV Cache Management System for Mixture of Experts",
    Liu et al., 2025; the balance idea follows the auxiliary load-balancing of Fedus et al., "Switch
    Transformers", 2021, applied at selection time instead of as a training loss). ``strength = 0`` is
    ``TopKSelector``; ``strength = 1`` ranks by probability per stored token.

    Parameters
    ----------
    strength : float
        Penalty weight ``>= 0`` in log-probability units (default 0.5).
    score : str
        ``"centroid"`` (default) or ``"bound"``.

    Notes
    -----
    ``select(query [B, H, G, D], summary, k) -> [B, H, k]`` int64. Stateless: occupancy is read from
    ``summary.counts`` ``[B, H, S]``.
    """

    name = "topk_balanced"

    def __init__(self, strength: float = 0.5, score: str = "centroid") -> None:
        self.strength = check_weight("strength", strength)
        self.score = check_score_kind(score)

    def select(self, query: torch.Tensor, summary: ShardSummary, k: int) -> torch.Tensor:
        check_select_args(query, summary, k)
        adjusted = shard_log_probs(query, summary, self.score) - self.strength * log_occupancy(summary.counts)
        return masked_topk(adjusted, k, summary.counts > 0)
