"""Adaptive selection: EXP3 bandit weights over score features, learned from recovered attention mass."""

from __future__ import annotations

import torch

from pikv_hf.checks import check_seed
from pikv_hf.routing.base import Selector, ShardSummary, check_select_args
from pikv_hf.routing.scores import (
    bound_scores,
    centroid_scores,
    check_weight,
    log_occupancy,
    masked_topk,
    standardize,
)


class AdaptiveSelector(Selector):
    """Chooses per row which score feature ranks the shards, learning the choice online from a real reward.

    Arms ``f`` (``ARMS``): the standardised centroid score, the standardised Quest bound score, and the
    standardised log-size prior ``log n_s`` (largest shards first, what uniform attention would favour). Each
    arm alone is a ranking; arm ``f`` selects ``top-k(z_f)``.

    The adaptive router of the PiKV paper ("PiKV: KV Cache Management System for Mixture of Experts", Liu et al.,
    2025) adapts routing online; here the adaptation is EXP3 (Auer, Cesa-Bianchi, Freund, Schapire, "The
    Nonstochastic Multiarmed Bandit Problem", SIAM J. Comput. 2002) over the arms, one weight vector per KV head,
    learned from observed recall:

    * policy ``pi_h = (1 - explore) * softmax(log_w_h) + explore / F``;
    * ``select`` draws one arm per ``(b, h)`` from ``pi_h`` with a seeded CPU generator (same draws on every
      device) and returns that arm's top-k;
    * ``update(query, summary, selected, reward)`` takes the reward ``r`` in ``[0, 1]`` of ``selected`` (e.g. the
      attention mass its shards recover out of full attention, computed by the cache on sampled steps), finds
      every arm whose top-k equals ``selected`` (``m_f``), and forms the importance-weighted estimate
      ``r_hat_f = r * m_f / sum_f' pi_f' m_f'``; then ``log_w_h += lr * mean_b r_hat``.

    Parameters
    ----------
    lr : float
        EXP3 step ``>= 0`` on the log-weights (default 0.05).
    explore : float
        Uniform exploration ``gamma`` in ``(0, 1]`` (default 0.1); it bounds ``r_hat <= F / gamma``.
    seed : int
        Seed of the arm draws (default 0): two instances with the same seed and the same calls select the same
        shards and learn the same weights.

    Notes
    -----
    ``select(query [B, H, G, D], summary, k) -> [B, H, k]`` int64. State: log-weights ``[H, F]`` float64 on the
    CPU (no batch dim, so batch reordering needs no handling) and the policy of the last ``select``, which
    ``update`` uses as the probabilities the selection was drawn with. ``reset()`` keeps the learned weights (they
    describe the layer, not the sequence) and only drops that last policy.
    """

    name = "adaptive"
    ARMS = ("centroid", "bound", "size")

    def __init__(self, lr: float = 0.05, explore: float = 0.1, seed: int = 0) -> None:
        self.lr = check_weight("lr", lr)
        self.explore = check_weight("explore", explore)
        if not 0 < self.explore <= 1:
            raise ValueError(f"explore must be in (0, 1], got {explore}")
        check_seed(seed)
        self.seed = seed
        self.generator = torch.Generator().manual_seed(self.seed)
        self.log_weights: torch.Tensor | None = None
        self.last_policy: torch.Tensor | None = None

    def reset(self) -> None:
        """Drop the policy of the last ``select`` (learned weights are kept)."""
        self.last_policy = None

    @property
    def weights(self) -> torch.Tensor | None:
        """``[H, F]`` float64 ``softmax(log_w)`` over ``ARMS``, or None before the first call."""
        return None if self.log_weights is None else torch.softmax(self.log_weights, dim=-1)

    def policy(self, num_heads: int) -> torch.Tensor:
        """``[H, F]`` float64 arm probabilities ``(1 - explore) * softmax(log_w) + explore / F``."""
        arms = len(self.ARMS)
        if self.log_weights is None:
            self.log_weights = torch.zeros(num_heads, arms, dtype=torch.float64)
        if self.log_weights.shape[0] != num_heads:
            raise ValueError(
                f"query has H={num_heads} KV heads but this AdaptiveSelector learned {self.log_weights.shape[0]}"
            )
        return (1 - self.explore) * torch.softmax(self.log_weights, dim=-1) + self.explore / arms

    def features(self, query: torch.Tensor, summary: ShardSummary) -> torch.Tensor:
        """``[B, H, F, S]`` float32 standardised arm scores (``-inf`` for empty shards), ``F`` over ``ARMS``."""
        size = log_occupancy(summary.counts).masked_fill(summary.counts == 0, float("-inf"))
        raw = torch.stack([centroid_scores(query, summary), bound_scores(query, summary), size], dim=-2)
        return standardize(raw)

    def select(self, query: torch.Tensor, summary: ShardSummary, k: int) -> torch.Tensor:
        check_select_args(query, summary, k)
        b, h, s = summary.counts.shape
        policy = self.policy(h)
        draws = torch.multinomial(policy.repeat(b, 1), 1, generator=self.generator).view(b, h, 1, 1)
        self.last_policy = policy
        scores = self.features(query, summary).gather(2, draws.to(query.device).expand(b, h, 1, s)).squeeze(2)
        return masked_topk(scores, k, summary.counts > 0)

    def update(
        self, query: torch.Tensor, summary: ShardSummary, selected: torch.Tensor, reward: torch.Tensor | float
    ) -> None:
        """One EXP3 step from the reward of a ``select`` result.

        Parameters
        ----------
        query, summary : torch.Tensor, ShardSummary
            The inputs ``selected`` was chosen from.
        selected : torch.Tensor
            ``[B, H, k]`` int64 ids returned by the last ``select``.
        reward : torch.Tensor or float
            Reward in ``[0, 1]`` broadcastable to ``[B, H]``, e.g. attention mass of the selected shards'
            tokens divided by the mass of all tokens under full attention.

        Notes
        -----
        A row whose ``selected`` set no arm would have chosen (e.g. the caller altered it) carries no information
        about the arms and adds nothing to the step.
        """
        if selected.dim() != 3:
            raise ValueError(f"selected must be [B, H, k], got shape {tuple(selected.shape)}")
        k = selected.shape[-1]
        check_select_args(query, summary, k)
        b, h = query.shape[:2]
        if tuple(selected.shape[:2]) != (b, h):
            raise ValueError(f"selected must be [B={b}, H={h}, k], got shape {tuple(selected.shape)}")
        reward = torch.as_tensor(reward, dtype=torch.float32, device=query.device)
        try:
            reward = reward.expand(b, h)
        except RuntimeError as err:
            raise ValueError(f"reward must broadcast to [B={b}, H={h}], got shape {tuple(reward.shape)}") from err
        if not bool(((reward >= 0) & (reward <= 1)).all()):  # NaN fails too: it would poison every weight
            raise ValueError(f"reward must be in [0, 1], got values in [{float(reward.min())}, {float(reward.max())}]")
        policy = self.policy(h)  # also checks H against the learned weights
        if self.last_policy is not None:
            policy = self.last_policy
        arm_sets = masked_topk(self.features(query, summary), k, (summary.counts > 0).unsqueeze(2))
        matches = (arm_sets.sort(dim=-1).values == selected.sort(dim=-1).values.unsqueeze(2)).all(dim=-1)
        m = matches.to(torch.float64).cpu()
        chance = (m * policy).sum(dim=-1, keepdim=True)
        estimate = torch.where(chance > 0, reward.to(torch.float64).cpu().unsqueeze(-1) * m / chance, 0.0)
        self.log_weights += self.lr * estimate.mean(dim=0)
        self.log_weights -= self.log_weights.amax(dim=-1, keepdim=True)
