"""Two-level selection: top groups of shards from group summaries, then the top-k shards inside them."""

from __future__ import annotations

import math

import torch

from pikv_hf.checks import check_int_at_least
from pikv_hf.routing.base import Selector, ShardSummary, check_select_args
from pikv_hf.routing.scores import check_score_kind, masked_topk, shard_log_probs


def cluster_shards(summary: ShardSummary, num_groups: int, iters: int) -> torch.Tensor:
    """Group shards by their centroids with count-weighted k-means (Lloyd), per batch row and KV head.

    Parameters
    ----------
    summary : ShardSummary
        ``[B, H, S, ...]`` shard summary.
    num_groups : int
        Number of groups ``NG <= S``.
    iters : int
        Lloyd iterations; the anchors start at the centroids of the evenly spaced shards
        ``round(linspace(0, S - 1, NG))`` (deterministic).

    Returns
    -------
    torch.Tensor
        ``[B, H, S]`` int64 group of each shard in ``[0, NG)``, its nearest anchor in squared L2 distance. Empty
        shards weigh nothing in the means; a group left without weight keeps its anchor.
    """
    centroids = summary.centroids.float()
    weight = summary.counts.float()
    s = centroids.shape[2]
    seeds = torch.linspace(0, s - 1, num_groups, device=centroids.device).round().long()
    anchors = centroids[:, :, seeds]

    def nearest(anchors: torch.Tensor) -> torch.Tensor:
        return (centroids.unsqueeze(3) - anchors.unsqueeze(2)).square().sum(-1).argmin(-1)

    for _ in range(iters):
        member = torch.nn.functional.one_hot(nearest(anchors), num_groups).float() * weight.unsqueeze(-1)
        mass = member.sum(2).unsqueeze(-1)  # [B, H, NG, 1]
        means = (member.transpose(-1, -2) @ centroids) / mass.clamp(min=1)
        anchors = torch.where(mass > 0, means, anchors)
    return nearest(anchors)


def group_summary(summary: ShardSummary, group: torch.Tensor, num_groups: int) -> ShardSummary:
    """Summarise shards into groups.

    Parameters
    ----------
    summary : ShardSummary
        ``[B, H, S, ...]`` shard summary.
    group : torch.Tensor
        ``[B, H, S]`` int64 group of each shard, in ``[0, num_groups)``.
    num_groups : int
        Number of groups ``NG``.

    Returns
    -------
    ShardSummary
        ``[B, H, NG, ...]``: summed counts, count-weighted mean centroid, element-wise min of ``key_min`` and max
        of ``key_max``; ``resident`` all True and ``misses`` zero (selection scores do not read them).
    """
    b, h, s, d = summary.centroids.shape
    counts = summary.counts.new_zeros(b, h, num_groups).scatter_add_(-1, group, summary.counts)
    index = group.unsqueeze(-1).expand(b, h, s, d)
    weighted = summary.centroids.float() * summary.counts.unsqueeze(-1)
    centroids = weighted.new_zeros(b, h, num_groups, d).scatter_add_(2, index, weighted)
    centroids = centroids / counts.clamp(min=1).unsqueeze(-1)
    key_min = torch.full_like(centroids, float("inf")).scatter_reduce_(2, index, summary.key_min.float(), "amin")
    key_max = torch.full_like(centroids, float("-inf")).scatter_reduce_(2, index, summary.key_max.float(), "amax")
    return ShardSummary(
        centroids=centroids,
        counts=counts,
        key_min=key_min,
        key_max=key_max,
        resident=torch.ones_like(counts, dtype=torch.bool),
        misses=torch.zeros_like(counts),
    )


class HierarchicalSelector(Selector):
    """Coarse-to-fine top-k: rank groups of shards, then shards inside the best groups.

    Shards are split, per batch row and KV head, into ``NG = min(num_groups, S)`` groups: by default with
    count-weighted k-means over the shard centroids (``cluster_shards``: shard ids carry no meaning, so shards with
    similar keys are grouped), or ``grouping="contiguous"`` (shard ``s`` in group ``s * NG // S``). Each group is
    summarised like a shard (count-weighted mean centroid, min / max of its shards' key bounds, ``group_summary``)
    and scored with the same routing softmax as ``TopKSelector``; the ``top_groups`` most probable groups are
    kept, and the result is the top-k shards by their own routing probability, taken first from non-empty shards
    of the kept groups, then (when those hold fewer than ``k``) from the other non-empty shards, then from empty
    ones. Two-level routing as in the PiKV paper's hierarchical router ("PiKV: KV Cache Management System for
    Mixture of Experts", Liu et al., 2025), after hierarchical mixtures of experts (Jordan and Jacobs,
    "Hierarchical Mixtures of Experts and the EM Algorithm", 1994). With one group per shard it equals
    ``TopKSelector``.

    Parameters
    ----------
    num_groups : int
        Number of groups ``>= 1`` (default 4; capped at ``S``).
    top_groups : int or None
        Groups kept ``>= 1`` (capped at ``NG``); None (default) keeps ``ceil(k * NG / S)``, the fewest groups of
        mean size that hold ``k`` shards.
    grouping : str
        ``"kmeans"`` (default) or ``"contiguous"``.
    kmeans_iters : int
        Lloyd iterations of the k-means grouping, ``>= 0`` (default 4).
    score : str
        ``"centroid"`` (default) or ``"bound"``.

    Notes
    -----
    ``select(query [B, H, G, D], summary, k) -> [B, H, k]`` int64. Stateless: groups are recomputed from each
    summary (``O(kmeans_iters * B * H * S * NG * D)``).
    """

    name = "hierarchical"
    GROUPINGS = ("kmeans", "contiguous")

    def __init__(
        self,
        num_groups: int = 4,
        top_groups: int | None = None,
        grouping: str = "kmeans",
        kmeans_iters: int = 4,
        score: str = "centroid",
    ) -> None:
        check_int_at_least("num_groups", num_groups, 1)
        if top_groups is not None:
            check_int_at_least("top_groups", top_groups, 1)
        if grouping not in self.GROUPINGS:
            raise ValueError(f"grouping must be one of {', '.join(self.GROUPINGS)}; got {grouping!r}")
        check_int_at_least("kmeans_iters", kmeans_iters, 0)
        self.num_groups = num_groups
        self.top_groups = top_groups
        self.grouping = grouping
        self.kmeans_iters = kmeans_iters
        self.score = check_score_kind(score)

    def select(self, query: torch.Tensor, summary: ShardSummary, k: int) -> torch.Tensor:
        check_select_args(query, summary, k)
        b, h, s = summary.counts.shape
        num_groups = min(self.num_groups, s)
        if self.grouping == "kmeans":
            group = cluster_shards(summary, num_groups, self.kmeans_iters)
        else:
            group = (torch.arange(s, device=summary.counts.device) * num_groups // s).expand(b, h, s)
        groups = group_summary(summary, group, num_groups)
        top_groups = math.ceil(int(k) * num_groups / s) if self.top_groups is None else self.top_groups
        kept = masked_topk(shard_log_probs(query, groups, self.score), min(top_groups, num_groups), groups.counts > 0)
        kept_group = torch.zeros(b, h, num_groups, dtype=torch.bool, device=kept.device).scatter_(-1, kept, True)
        filled = summary.counts > 0
        tier = filled.long() + (filled & kept_group.gather(-1, group)).long()
        return masked_topk(shard_log_probs(query, summary, self.score), k, tier)
