"""``PyramidPress``: layer-wise KV budgets in a pyramid (PyramidKV, Cai et al. 2024), the total exact."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from kvpress.presses.scorer_press import ScorerPress
from kvpress.presses.snapkv_press import SnapKVPress
from kvpress.utils import compute_n_kept
from torch import nn

from pikv_hf.checks import check_ratio
from pikv_hf.presses.base import PiKVScorerPress
from pikv_hf.view import DenseView


def pyramid_budgets(length: int, num_layers: int, compression_ratio: float, slope: float) -> list[int]:
    """Tokens kept per layer (per row and KV head) of a ``length``-token context: in proportion to
    ``1 + slope * (1 - 2 l / (L - 1))`` (``(1 + slope)`` times the mean at the first layer, ``(1 - slope)`` at the
    last), each in ``[1, length]``, summing to exactly ``L * compute_n_kept(length, compression_ratio)``."""
    check_ratio("compression_ratio", compression_ratio)  # at 1 no budget of >= 1 token a layer sums to 0
    total = num_layers * compute_n_kept(length, compression_ratio)
    layer = torch.arange(num_layers, dtype=torch.float64)
    weight = 1 + slope * (1 - 2 * layer / max(num_layers - 1, 1))
    share = total * weight / weight.sum()
    budget = share.floor().clamp(1, length)
    remainder = share - budget  # of the clamped budget: a layer raised to 1 token is already past its share
    deficit = total - int(budget.sum())
    order = remainder.argsort(descending=True, stable=True).tolist()
    while deficit:  # largest remainders first (smallest first when over), never past [1, length]
        for i in order if deficit > 0 else order[::-1]:
            step = 1 if deficit > 0 else -1
            if deficit and 1 <= budget[i] + step <= length:
                budget[i] += step
                deficit -= step
    return [int(b) for b in budget]


@dataclass
class PyramidPress(PiKVScorerPress):
    """Evict at prefill, per (row, KV head), the lowest-scored tokens of each layer, keeping
    :func:`pyramid_budgets` tokens in layer ``l``: more in the lower layers, where attention is spread wide, fewer
    in the upper ones, where it concentrates; the total over layers is what a uniform ``compression_ratio`` keeps.

    On a ``PiKVCache`` the evicted bytes are freed (per shard with ``shard_budget="proportional"``); on a
    ``DynamicCache`` they are masked as kvpress's ``AdaKVPress`` masks head-wise budgets (:meth:`compress`).

    Parameters
    ----------
    compression_ratio : float
        Mean fraction of the context removed per layer, in ``[0, 1)``.
    scorer : ScorerPress
        Scores the tokens within a layer (default kvpress's ``SnapKVPress``, as PyramidKV).
    slope : float
        Pyramid steepness in ``[0, 1]`` (0: uniform budgets).
    shard_budget : str
        ``"global"`` or ``"proportional"`` (see :mod:`pikv_hf.presses.base`).
    """

    scorer: ScorerPress = field(default_factory=SnapKVPress)
    slope: float = 0.5
    shortens_keys = False
    masks_keys = True

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.slope <= 1:
            raise ValueError(f"slope must be a number in [0, 1], got {self.slope!r}")

    def post_init_from_model(self, model: nn.Module) -> None:
        self.scorer.post_init_from_model(model)

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        return self.scorer.score(module, hidden_states, keys, values, attentions, kwargs)

    def layer_budget(self, module: nn.Module, length: int) -> int:
        """Tokens layer ``module.layer_idx`` keeps of ``length``."""
        layers = module.config.get_text_config().num_hidden_layers
        return pyramid_budgets(length, layers, self.compression_ratio, self.slope)[module.layer_idx]

    def score_view(self, module: nn.Module, kwargs: dict, view: DenseView, attentions) -> torch.Tensor:
        if isinstance(self.scorer, PiKVScorerPress):
            return self.scorer.score_view(module, kwargs, view, attentions)
        return super().score_view(module, kwargs, view, attentions)

    def budget(self, module: nn.Module, view: DenseView) -> torch.Tensor:
        """``[B, H]``: the pyramid share of layer ``module.layer_idx`` of each (row, head)'s own tokens."""
        counts = view.count
        kept = {n: self.layer_budget(module, n) for n in counts.unique().tolist()}
        return counts.cpu().apply_(kept.__getitem__).to(counts.device)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        """DynamicCache: layers of different lengths cannot share the model's one attention mask, so the evicted
        tokens are masked instead, as kvpress's ``AdaKVPress`` does (``module.masked_key_indices``: kvpress's
        attention patch gives them fake keys with zero attention while decoding); the cache keeps its tensors."""
        if self.compression_ratio == 0:
            return keys, values
        b, h, t, _ = keys.shape
        scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
        # [B, H, n]: all but the budget's best under a stable sort (ties kept in order of position, as on a PiKVCache)
        drop = scores.argsort(dim=-1, descending=True, stable=True)[..., self.layer_budget(module, t) :]
        rows = torch.arange(b, device=drop.device).view(b, 1, 1).expand_as(drop)
        heads = torch.arange(h, device=drop.device).view(1, h, 1).expand_as(drop)
        module.masked_key_indices = (rows.reshape(-1), heads.reshape(-1), drop.reshape(-1))
        return keys, values
