"""Cache-aware selection (the PiKV paper's PiKVRouter): routing scores discounted by counted cache misses."""

from __future__ import annotations

import torch

from pikv_hf.routing.base import Selector, ShardSummary, check_select_args
from pikv_hf.routing.scores import check_score_kind, check_weight, masked_topk, shard_log_probs


class CacheAwareSelector(Selector):
    """Top-k of routing log-probabilities minus miss and offload penalties.

    ``a_s = log p_s - miss_weight * log(1 + miss_s) - offload_penalty * [s not resident]`` where ``p`` is the
    routing softmax of ``TopKSelector``, ``miss_s`` the misses the cache counted for shard ``s``
    (``summary.misses``: the shard was selected while offloaded or after its pages were evicted) and
    ``resident`` says whether its pages are on the attention device now. This is the PiKVRouter of "PiKV: KV
    Cache Management System for Mixture of Experts" (Liu et al., 2025), which lowers the routing score of
    experts whose cache keeps missing so that queries favour shards that are cheap to read.

    Parameters
    ----------
    miss_weight : float
        ``lambda >= 0`` on ``log(1 + misses)`` (default 0.5).
    offload_penalty : float
        Penalty ``>= 0`` for a shard that is not resident (default 1.0).
    score : str
        ``"centroid"`` (default) or ``"bound"``.

    Notes
    -----
    ``select(query [B, H, G, D], summary, k) -> [B, H, k]`` int64; reads ``summary.misses`` and
    ``summary.resident`` ``[B, H, S]``. Stateless: the miss history lives in the cache.
    """

    name = "cache_aware"
    reads_misses = True

    def __init__(self, miss_weight: float = 0.5, offload_penalty: float = 1.0, score: str = "centroid") -> None:
        self.miss_weight = check_weight("miss_weight", miss_weight)
        self.offload_penalty = check_weight("offload_penalty", offload_penalty)
        self.score = check_score_kind(score)

    def select(self, query: torch.Tensor, summary: ShardSummary, k: int) -> torch.Tensor:
        check_select_args(query, summary, k)
        adjusted = (
            shard_log_probs(query, summary, self.score)
            - self.miss_weight * summary.misses.float().log1p()
            - self.offload_penalty * (~summary.resident).float()
        )
        return masked_topk(adjusted, k, summary.counts > 0)
