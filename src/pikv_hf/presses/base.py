"""What every PiKV press shares: kvpress behaviour on a DynamicCache, real per-(row, KV head) eviction on a PiKVCache.

A PiKV press is a kvpress press (``ScorerPress``, ``DecodingPress``, ... subclasses), so kvpress's pipeline and its
``isinstance`` checks treat it as one of its own. Its hook branches on the cache it finds:

* on a ``DynamicCache`` (or any other cache) it runs kvpress's own hook: the press compresses exactly as a kvpress
  press does, so results are comparable with kvpress's presses;
* on a ``PiKVCache`` it acts on the layer directly: a scorer press scores the layer's position-ordered view and
  evicts what it does not keep (:func:`evict_lowest`), so the bytes are freed per (row, KV head) with no copy of the
  kept tokens through the view assignment; other presses call other layer operations (moving tokens to a tier,
  switching the read policy).

Budgets follow kvpress: ``n_kept = compute_n_kept(T, compression_ratio)`` tokens per (row, KV head) of a ``T``-token
view. How a budget splits over the shards of a (row, head) is the press's ``shard_budget``: ``"global"`` keeps the
``n_kept`` best-scored tokens wherever they sit; ``"proportional"`` gives every shard its share of ``n_kept`` in
proportion to the tokens it holds (largest remainders round it to exactly ``n_kept``) and keeps that shard's best,
so no shard a routed read may select is emptied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvpress.presses.base_press import is_prefilling
from kvpress.presses.scorer_press import ScorerPress
from kvpress.utils import compute_n_kept
from torch import nn

from pikv_hf.cache import PiKVCache
from pikv_hf.layer import PiKVLayer

SHARD_BUDGETS = ("global", "proportional")


def check_ratio(name: str, value: float) -> None:
    """``ValueError`` unless ``value`` is a number in ``[0, 1)`` (kvpress's ``compression_ratio`` range)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")


def check_shard_budget(value: str) -> None:
    if value not in SHARD_BUDGETS:
        raise ValueError(f"shard_budget must be one of {', '.join(SHARD_BUDGETS)}, got {value!r}")


def proportional_keep(scores: torch.Tensor, shard: torch.Tensor, valid: torch.Tensor, n_kept: int) -> torch.Tensor:
    """``[B, H, T]`` bool keep mask: ``n_kept`` entries per (row, head) (fewer if fewer are valid), split over shards
    in proportion to the valid entries each shard holds (largest remainders), the best-scored within each shard.

    ``scores``, ``shard`` (int64, any value where not valid) and ``valid`` are ``[B, H, T]``.
    """
    b, h, t = scores.shape
    s = int(shard[valid].max()) + 1 if bool(valid.any()) else 1
    shard = torch.where(valid, shard, s)  # entries that are not valid sit in a bucket of their own, never kept
    count = torch.zeros(b, h, s + 1, dtype=torch.float64, device=scores.device)
    count = count.scatter_add_(2, shard, valid.to(torch.float64))[..., :s]
    total = count.sum(-1, keepdim=True)
    target = total.clamp(max=n_kept)
    share = count * (target / total.clamp(min=1))
    budget = share.floor()
    short = (target - budget.sum(-1, keepdim=True)).round().long()  # one more for the largest remainders
    by_remainder = (share - budget).argsort(dim=-1, descending=True, stable=True)
    extra = (torch.arange(s, device=scores.device) < short).to(budget.dtype)
    budget = budget.scatter_add(2, by_remainder, extra).long()
    budget = torch.cat([budget, torch.zeros_like(budget[..., :1])], -1)
    # rank of every entry within its shard, best score first: a stable sort by shard of the score order
    by_score = torch.where(valid, scores.float(), float("-inf")).argsort(dim=-1, descending=True, stable=True)
    shard_in_score_order = shard.gather(2, by_score)
    by_shard = shard_in_score_order.argsort(dim=-1, stable=True)
    grouped = shard_in_score_order.gather(2, by_shard)
    per_shard = torch.zeros(b, h, s + 1, dtype=torch.int64, device=scores.device)
    per_shard.scatter_add_(2, grouped, torch.ones_like(grouped))
    rank_grouped = torch.arange(t, device=scores.device) - (per_shard.cumsum(-1) - per_shard).gather(2, grouped)
    rank = torch.empty_like(rank_grouped).scatter_(2, by_shard, rank_grouped)
    keep_in_score_order = rank < budget.gather(2, shard_in_score_order)
    return torch.zeros_like(valid).scatter_(2, by_score, keep_in_score_order) & valid


def evict_lowest(layer: PiKVLayer, scores: torch.Tensor, compression_ratio: float, shard_budget: str) -> None:
    """Keep, per (row, KV head), the ``compute_n_kept(T, compression_ratio)`` highest ``scores`` (``[B, H, T]`` over
    the layer's dense view) and evict the rest from the layer's hot store."""
    view = layer.view()
    t = view.pos.shape[-1]
    if t == 0 or compression_ratio == 0:
        return
    n_kept = compute_n_kept(t, compression_ratio)
    present = view.pos >= 0
    if shard_budget == "global":
        ranked = scores.float().masked_fill(~present, float("-inf"))
        keep_view = torch.zeros_like(present).scatter_(2, ranked.topk(n_kept, dim=-1).indices, True) & present
    else:
        st = layer.store
        frame_shard = st.frame("shard").long().repeat_interleave(st.page_size, dim=-1)
        shard = frame_shard.gather(2, view.frame_index.clamp(min=0))
        keep_view = proportional_keep(scores, shard, view.valid, n_kept)
    st = layer.store
    keep = torch.zeros(st.batch, st.heads, st.table.width() * st.page_size, dtype=torch.bool, device=st.device)
    keep.scatter_(2, view.frame_index.clamp(min=0), keep_view & present)
    layer.evict(keep & st.frame("valid"))


@dataclass
class PiKVScorerPress(ScorerPress):
    """A ``ScorerPress`` whose prefill hook, on a ``PiKVCache``, evicts the lowest-scored tokens of each (row, KV head)
    in place (see the module docstring); on any other cache it is kvpress's ``ScorerPress``.

    Parameters
    ----------
    compression_ratio : float
        Fraction of the context's KV pairs removed per (row, KV head), in ``[0, 1)``.
    shard_budget : str
        ``"global"`` or ``"proportional"``: how a (row, head)'s budget splits over its shards in a PiKVCache.
    """

    compression_ratio: float = 0.0
    shard_budget: str = "global"

    def __post_init__(self) -> None:
        check_ratio("compression_ratio", self.compression_ratio)
        check_shard_budget(self.shard_budget)

    def forward_hook(self, module: nn.Module, input: list[torch.Tensor], kwargs: dict, output: list):
        cache = kwargs["past_key_values"]
        if not isinstance(cache, PiKVCache):
            return super().forward_hook(module, input, kwargs, output)
        hidden_states = kwargs["hidden_states"]
        if not is_prefilling(kwargs["cache_position"], hidden_states.shape[1]) or self.compression_ratio == 0:
            return output
        layer = cache.layers[module.layer_idx]
        view = layer.view()
        scores = self.score(module, hidden_states, view.keys, view.values, output[1], kwargs)
        evict_lowest(layer, scores, self.layer_ratio(module, view.pos.shape[-1]), self.shard_budget)
        return output

    def layer_ratio(self, module: nn.Module, length: int) -> float:
        """The ``compression_ratio`` applied to ``module``'s layer of ``length`` tokens (the same for every layer
        here; layer-wise budgets override it)."""
        return self.compression_ratio
