"""Query-to-shard scores shared by every selector.

A selector ranks the ``S`` shards of one layer for each batch row and KV head from the layer's ``ShardSummary``.
Everything here is vectorised over ``[B, H]`` and works on any device.

Shapes use ``B`` batch, ``H`` KV heads, ``G`` query rows per KV head, ``S`` shards, ``D`` key head dim.

* ``centroid_scores``: ``max_g q_g . c_s``, the query-to-mean-key score of the PiKV paper's expert routing.
* ``bound_scores``: Quest's upper bound of ``q . k`` over a shard's keys from their element-wise min / max
  (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024).
* ``shard_log_probs``: the routing distribution ``log softmax(z)`` of the standardised scores ``z``. Both raw
  scores scale linearly with a positive scale of the query, so standardising them over a row's non-empty shards
  makes every selector scale-invariant, and penalties added to these log-probabilities are in units of one
  standard deviation of the row's scores.
* ``estimated_mass``: each shard's expected share of the softmax attention mass under a diagonal Gaussian model
  of its keys (mean and per-dimension variance); used to size a routed read by a mass target (top-p).
* ``masked_topk``: ``k`` distinct ids per row, higher ``priority`` tier first (non-empty shards before empty
  ones), then higher score, ties to the lower id.
"""

from __future__ import annotations

import math

import torch

from pikv_hf.routing.base import ShardSummary

SCORE_KINDS = ("centroid", "bound")


def check_score_kind(kind: str) -> str:
    """Return ``kind`` if it is one of ``SCORE_KINDS``; ``ValueError`` naming ``score`` otherwise."""
    if kind not in SCORE_KINDS:
        raise ValueError(f"score must be one of {', '.join(SCORE_KINDS)}; got {kind!r}")
    return kind


def check_weight(name: str, value: float) -> float:
    """Return ``value`` as a float if it is finite and ``>= 0``; ``ValueError`` naming ``name`` otherwise."""
    value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    return value


def centroid_scores(query: torch.Tensor, summary: ShardSummary) -> torch.Tensor:
    """Max over the query rows of the dot product with each shard's mean key.

    Parameters
    ----------
    query : torch.Tensor
        ``[B, H, G, D]`` queries (any float dtype, any positive scale).
    summary : ShardSummary
        The layer's shard summary (``centroids`` ``[B, H, S, D]``, ``counts`` ``[B, H, S]``).

    Returns
    -------
    torch.Tensor
        ``[B, H, S]`` float32 ``max_g q_g . c_s``; ``-inf`` for an empty shard.
    """
    return scores_of_dots(summary.query_dots(query), summary.counts)


def scores_of_dots(dots: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``[B, H, S]`` centroid scores from the products ``dots`` (``[B, H, G, S]`` ``q_g . c_s``) and ``counts``
    (``[B, H, S]``): the max over the query rows, ``-inf`` for an empty shard."""
    return dots.amax(dim=-2).masked_fill(counts == 0, float("-inf"))


def bound_scores(query: torch.Tensor, summary: ShardSummary) -> torch.Tensor:
    """Quest upper bound of ``q . k`` over each shard's keys, maxed over the query rows.

    ``sum_d max(q_d * min_d, q_d * max_d) = q^+ . max + q^- . min`` with ``q^+ = max(q, 0)``,
    ``q^- = min(q, 0)``; it is ``>=`` the dot product of ``q`` with every key of the shard.

    Parameters
    ----------
    query : torch.Tensor
        ``[B, H, G, D]`` queries.
    summary : ShardSummary
        The layer's shard summary (``key_min`` / ``key_max`` ``[B, H, S, D]``, ``counts`` ``[B, H, S]``).

    Returns
    -------
    torch.Tensor
        ``[B, H, S]`` float32 bound; ``-inf`` for an empty shard.
    """
    return upper_bounds(query, summary.key_min, summary.key_max, summary.counts)


def descending_rank(scores: torch.Tensor) -> torch.Tensor:
    """Rank of every entry of ``scores`` along the last dim under a stable descending sort (0: the largest; ties to
    the earlier entry), as int64 of the same shape: ``rank < n`` keeps the ``n`` best of each row."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    steps = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, steps)


def upper_bounds(
    query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """``[B, H, N]`` Quest bound ``max_g (q_g^+ . max_n + q_g^- . min_n)`` of ``N`` key sets (shards or pages).

    ``query`` is ``[B, H, G, D]``, ``key_min`` / ``key_max`` ``[B, H, N, D]``, ``counts`` ``[B, H, N]``; an empty
    set (count 0) scores ``-inf``.
    """
    q = query.float()
    # Empty sets carry +-inf bounds (0 * inf makes their columns NaN): every entry of a product is its own dot
    # product, so only their columns are touched, and those are set to -inf at the end.
    bound = q.clamp(min=0) @ key_max.float().transpose(-1, -2) + q.clamp(max=0) @ key_min.float().transpose(-1, -2)
    return bound.amax(dim=-2).masked_fill_(counts == 0, float("-inf"))


def estimated_mass(query: torch.Tensor, summary: ShardSummary, scale: float) -> torch.Tensor:
    """Expected share of each shard in the attention mass of the query rows, averaged over the rows.

    A shard of ``n`` keys with mean ``mu`` and per-dimension variance ``var`` gets the moment generating function
    of a diagonal Gaussian, ``n * E[exp(s q.k)] = n * exp(s q.mu + s^2/2 * sum_d q_d^2 var_d)`` with ``s`` the
    softmax scale; shares are normalised over the shards for every query row, then averaged over the ``G`` rows
    (the mass a KV head's reads must cover). Without the variance term the estimate is too sharp (Jensen), and
    a mass target would stop too early. The idea of sizing a sparse read by mass (top-p) rather than a fixed
    count follows Lin et al., "Twilight: Adaptive Attention Sparsity with Hierarchical Top-p Pruning", 2025.

    Parameters
    ----------
    query : torch.Tensor
        ``[B, H, G, D]`` queries.
    summary : ShardSummary
        Needs ``centroids``, ``counts`` and ``key_var``.
    scale : float
        Softmax scale of the attention (``1 / sqrt(D)`` for most models).

    Returns
    -------
    torch.Tensor
        ``[B, H, S]`` float32 shares in ``[0, 1]`` summing to 1 over the non-empty shards; 0 for empty shards.
    """
    if summary.key_var is None:
        raise ValueError("summary.key_var is required to estimate attention mass")
    return mass_of_dots(summary.query_dots(query), query, summary.key_var, summary.counts, scale)


def mass_of_dots(
    dots: torch.Tensor, query: torch.Tensor, key_var: torch.Tensor, counts: torch.Tensor, scale: float
) -> torch.Tensor:
    """:func:`estimated_mass` from the products ``dots`` (``[B, H, G, S]`` ``q_g . c_s``), the query rows ``query``
    (``[B, H, G, D]``), the keys' per-dimension variance ``key_var`` (``[B, H, S, D]``) and ``counts``
    (``[B, H, S]``)."""
    q = query.float()
    b, h, g, n = dots.shape
    var = key_var.float().reshape(b * h, n, -1).transpose(-1, -2)
    q2 = q.square().reshape(b * h, g, -1)
    # s q.mu + s^2 / 2 q^2.var, one batched product
    logit = torch.baddbmm(dots.reshape(b * h, g, n), q2, var, beta=scale, alpha=0.5 * scale**2)
    logit = logit.view(b, h, g, n) + counts.log().unsqueeze(-2)  # log n: -inf for an empty shard, no share
    return torch.softmax(logit, dim=-1).mean(dim=-2)


def query_scores(query: torch.Tensor, summary: ShardSummary, kind: str) -> torch.Tensor:
    """``[B, H, S]`` raw scores of kind ``"centroid"`` (``centroid_scores``) or ``"bound"`` (``bound_scores``)."""
    if check_score_kind(kind) == "centroid":
        return centroid_scores(query, summary)
    return bound_scores(query, summary)


def standardize(scores: torch.Tensor) -> torch.Tensor:
    """Z-score each row over its finite entries; non-finite entries become ``-inf``.

    Parameters
    ----------
    scores : torch.Tensor
        ``[..., S]`` float scores, ``-inf`` for shards to ignore.

    Returns
    -------
    torch.Tensor
        ``[..., S]`` ``(s - mean) / std`` over the row's finite entries (``std`` taken as 1 when it is 0, so a
        row of equal scores gives zeros); invariant to a positive affine change of ``scores``.
    """
    finite = torch.isfinite(scores)
    n = finite.sum(dim=-1, keepdim=True).clamp(min=1)
    x = scores.masked_fill(~finite, 0.0)
    mean = x.sum(dim=-1, keepdim=True) / n
    dev = (x - mean).masked_fill(~finite, 0.0)
    std = (dev.square().sum(dim=-1, keepdim=True) / n).sqrt()
    z = dev / torch.where(std > 0, std, torch.ones_like(std))
    return z.masked_fill(~finite, float("-inf"))


def shard_log_probs(query: torch.Tensor, summary: ShardSummary, kind: str) -> torch.Tensor:
    """Routing log-probabilities ``log softmax(standardize(query_scores))`` over the shards.

    Returns
    -------
    torch.Tensor
        ``[B, H, S]`` float32; ``-inf`` for empty shards (``NaN`` for a row whose shards are all empty, which
        ``masked_topk`` ranks last).
    """
    return torch.log_softmax(standardize(query_scores(query, summary, kind)), dim=-1)


def log_occupancy(counts: torch.Tensor) -> torch.Tensor:
    """``log(n_s / mean n)`` over each row's non-empty shards; ``0`` for empty shards.

    Parameters
    ----------
    counts : torch.Tensor
        ``[..., S]`` int64 tokens per shard.

    Returns
    -------
    torch.Tensor
        ``[..., S]`` float32; positive for a shard fuller than the row's mean non-empty shard.
    """
    filled = counts > 0
    n = counts.float()
    mean = n.sum(dim=-1, keepdim=True) / filled.sum(dim=-1, keepdim=True).clamp(min=1)
    return torch.where(filled, (n / mean.clamp(min=1e-30)).log(), torch.zeros_like(n))


def masked_topk(scores: torch.Tensor, k: int, priority: torch.Tensor) -> torch.Tensor:
    """The ``k`` best distinct ids per row: higher ``priority`` tier first, then higher score.

    Parameters
    ----------
    scores : torch.Tensor
        ``[..., S]`` float scores (``NaN`` ranks as ``-inf``).
    k : int
        Ids to return per row, ``1 <= k <= S``.
    priority : torch.Tensor
        Bool or integer tiers broadcastable to ``scores``; e.g. ``counts > 0`` so empty shards are chosen only
        when fewer than ``k`` shards hold tokens.

    Returns
    -------
    torch.Tensor
        ``[..., k]`` int64 ids, best first; ties go to the lower id (two stable sorts).
    """
    s = scores.float().nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    order = torch.argsort(s, dim=-1, descending=True, stable=True)
    tier = priority.to(torch.int64).expand_as(s).gather(-1, order)
    order = order.gather(-1, torch.argsort(tier, dim=-1, descending=True, stable=True))
    return order[..., : int(k)]
