"""Plain top-k selection: the ``k`` most probable shards under the routing softmax."""

from __future__ import annotations

import torch

from pikv_hf.routing.base import Selector, ShardSummary, check_select_args
from pikv_hf.routing.scores import check_score_kind, masked_topk, shard_log_probs


class TopKSelector(Selector):
    """Top-k shards of ``softmax`` over standardised query-to-shard scores.

    The PiKV paper's standard top-k router ("PiKV: KV Cache Management System for Mixture of Experts", Liu et al.,
    2025), with the expert gate replaced by the query's score against each shard's summary, as in MoE gating
    (Shazeer et al., "Outrageously Large Neural Networks: The Sparsely-Gated Mixture-of-Experts Layer", 2017):
    ``p = softmax(z)``, ``z = standardize(max_g score(q_g, shard))``, selection ``= top-k(p)``.

    Parameters
    ----------
    score : str
        ``"centroid"`` (``q . mean key``, default) or ``"bound"`` (Quest min/max upper bound); see
        ``pikv_hf.routing.scores``.

    Notes
    -----
    ``select(query [B, H, G, D], summary, k) -> [B, H, k]`` int64, most probable first. Stateless.
    """

    name = "topk"

    def __init__(self, score: str = "centroid") -> None:
        self.score = check_score_kind(score)

    def select(self, query: torch.Tensor, summary: ShardSummary, k: int) -> torch.Tensor:
        check_select_args(query, summary, k)
        return masked_topk(shard_log_probs(query, summary, self.score), k, summary.counts > 0)
