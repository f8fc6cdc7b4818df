"""Plain top-k selection: the ``k`` most probable shards under the routing softmax."""

from __future__ import annotations

import torch

from pikv_hf.routing.base import Selector, ShardSummary, check_select_args
from pikv_hf.routing.scores import check_score_kind, query_scores


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
        # standardising is a positive affine map per row and log-softmax is increasing: the raw scores rank the same;
        # they are -inf for empty shards, which therefore come last (in id order), as masked_topk orders them
        scores = query_scores(query, summary, self.score)
        return scores.argsort(dim=-1, descending=True, stable=True)[..., : int(k)]
