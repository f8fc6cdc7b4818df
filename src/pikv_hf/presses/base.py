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
from pikv_hf.checks import calling_press, check_ratio
from pikv_hf.layer import OFFLOAD_TARGETS, PiKVLayer
from pikv_hf.routing.scores import descending_rank

SHARD_BUDGETS = ("global", "proportional")


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
    by_score = torch.where(valid, scores, float("-inf")).argsort(dim=-1, descending=True, stable=True)
    shard_in_score_order = shard.gather(2, by_score)
    by_shard = shard_in_score_order.argsort(dim=-1, stable=True)
    grouped = shard_in_score_order.gather(2, by_shard)
    per_shard = torch.zeros(b, h, s + 1, dtype=torch.int64, device=scores.device)
    per_shard.scatter_add_(2, grouped, torch.ones_like(grouped))
    rank_grouped = torch.arange(t, device=scores.device) - (per_shard.cumsum(-1) - per_shard).gather(2, grouped)
    rank = torch.empty_like(rank_grouped).scatter_(2, by_shard, rank_grouped)
    keep_in_score_order = rank < budget.gather(2, shard_in_score_order)
    return torch.zeros_like(valid).scatter_(2, by_score, keep_in_score_order) & valid


def keep_newest(scores: torch.Tensor) -> torch.Tensor:
    """``scores`` (``[B, H, T]`` over position-ordered keys) with the newest token ranked first: a press never
    evicts the token being decoded, on a DynamicCache (kvpress keeps the top scores) as on a PiKVCache."""
    return scores.index_fill(-1, torch.tensor([scores.shape[-1] - 1], device=scores.device), float("inf"))


def keep_mask(
    layer: PiKVLayer, scores: torch.Tensor, n_kept: int | torch.Tensor, shard_budget: str = "global"
) -> torch.Tensor:
    """Frame keep mask (``[B, H, W * P]`` over the hot store) of the ``n_kept`` highest ``scores`` (``[B, H, T]`` over
    the layer's dense view) per (row, KV head); ``n_kept`` is an int or a ``[B, H]`` tensor (per-head budgets). The
    most recent token of every (row, head) is always kept."""
    view = layer.view_index()
    present = view.pos >= 0
    ranked = scores.masked_fill(~present, float("-inf"))
    newest = view.pos.argmax(-1, keepdim=True)
    ranked = ranked.scatter(2, newest, float("inf"))  # the token being decoded is never evicted
    budget = torch.as_tensor(n_kept, device=ranked.device).expand(ranked.shape[:2]).unsqueeze(-1)
    if shard_budget == "global":
        keep_view = (descending_rank(ranked) < budget) & present
    else:
        if isinstance(n_kept, torch.Tensor):
            raise ValueError("shard_budget='proportional' takes one budget for every (row, head)")
        st = layer.store
        frame_shard = st.frame("shard").long().repeat_interleave(st.page_size, dim=-1)
        shard = frame_shard.gather(2, view.frame_index.clamp(min=0))
        keep_view = proportional_keep(ranked, shard, present, n_kept)
    return to_frame(layer, view, keep_view)


def to_frame(layer: PiKVLayer, view, keep_view: torch.Tensor) -> torch.Tensor:
    """A keep mask over the entries of a dense view (``[B, H, T]``) as a keep mask over the hot store's frame."""
    return layer.frame_mask(view.frame_index, keep_view & (view.pos >= 0))


def drop_or_offload(layer: PiKVLayer, keep: torch.Tensor, offload: str | None) -> None:
    """Evict the hot store's tokens outside ``keep``, or move them to the layer's offload tier (``"cpu"`` or
    ``"disk"``) where attention still reads them."""
    if offload is None:
        layer.evict(keep)
    else:
        layer.offload_tokens(keep, offload)


def evict_lowest(
    layer: PiKVLayer,
    scores: torch.Tensor,
    compression_ratio: float,
    shard_budget: str = "global",
    offload: str | None = None,
) -> None:
    """Keep, per (row, KV head), the ``compute_n_kept(T, compression_ratio)`` highest ``scores`` (``[B, H, T]`` over
    the layer's dense view of ``T`` entries) and evict (or offload) the rest from the layer's hot store."""
    t = layer.view_index().pos.shape[-1]
    if t == 0 or compression_ratio == 0:
        return
    drop_or_offload(layer, keep_mask(layer, scores, compute_n_kept(t, compression_ratio), shard_budget), offload)


@dataclass
class PiKVScorerPress(ScorerPress):
    """A ``ScorerPress`` whose prefill hook, on a ``PiKVCache``, evicts the lowest-scored tokens of each (row, KV head)
    in place (see the module docstring); on any other cache it is kvpress's ``ScorerPress``.

    Subclasses give ``score`` (kvpress's signature: ``[B, H, T]``, higher = keep) and, when a PiKVCache's attention
    statistics can rank the stored tokens during decoding, ``decode_scores(layer) -> [B, H, T]`` over the layer's
    dense view (used by :class:`pikv_hf.presses.DecodingBudgetPress`).
    Presses that recompute the model's queries refuse models whose query path they cannot follow.

    Parameters
    ----------
    compression_ratio : float
        Fraction of the context's KV pairs removed per (row, KV head), in ``[0, 1)``.
    shard_budget : str
        ``"global"`` or ``"proportional"``: how a (row, head)'s budget splits over its shards in a PiKVCache.
    offload : str or None
        PiKVCache only: move the tokens the press does not keep to an offload tier (``"cpu"``: CPU memory, pinned
        when the cache is on a GPU; ``"disk"``: a memory-mapped file) instead of dropping them; attention keeps
        reading them there (routed reads select shards over both tiers).
    """

    compression_ratio: float = 0.0
    shard_budget: str = "global"
    offload: str | None = None

    def __post_init__(self) -> None:
        check_ratio("compression_ratio", self.compression_ratio)
        check_shard_budget(self.shard_budget)
        check_offload(self.offload)

    replays_prefill = True  # the PiKV branch reads only the hook's arguments: a recorded prefill can be replayed
    recomputes_queries = False  # scores from the model's own queries (presses.queries): checked on entering

    def post_init_from_model(self, model: nn.Module) -> None:
        """Refuse, before any forward, a model whose query path the press cannot follow."""
        super().post_init_from_model(model)
        if self.recomputes_queries:
            from pikv_hf.presses.queries import check_query_path
            from pikv_hf.routing.expert import decoder_layers

            for layer in decoder_layers(model):
                check_query_path(layer.self_attn)

    def decode_scores(self, layer: PiKVLayer, n_kept: int) -> torch.Tensor:
        """``[B, H, T]`` scores of the layer's stored tokens, in the order of ``layer.view_index()``, from the
        cache's statistics (decode time; ``n_kept`` is the budget they will be cut to)."""
        raise NotImplementedError(f"{type(self).__name__} has no decode-time scores from cache statistics")

    def decode_keep(self, layer: PiKVLayer, n_kept: int) -> torch.Tensor:
        """Frame keep mask of the ``n_kept`` tokens per (row, KV head) that :meth:`decode_scores` ranks highest."""
        return keep_mask(layer, self.decode_scores(layer, n_kept), n_kept, self.shard_budget)

    def forward_hook(self, module: nn.Module, input: list[torch.Tensor], kwargs: dict, output: list):
        if not isinstance(kwargs["past_key_values"], PiKVCache):
            return super().forward_hook(module, input, kwargs, output)
        layer = prefill_layer(module, kwargs, self.compression_ratio)
        if layer is None:
            return output
        view = layer.view()
        scores = self.score(module, kwargs["hidden_states"], view.keys, view.values, output[1], kwargs)
        evict_lowest(layer, scores, self.layer_ratio(module, view.pos.shape[-1]), self.shard_budget, self.offload)
        return output

    def layer_ratio(self, module: nn.Module, length: int) -> float:
        """The ``compression_ratio`` applied to ``module``'s layer of ``length`` tokens (the same for every layer
        here; layer-wise budgets override it)."""
        return self.compression_ratio


def prefill_layer(module: nn.Module, kwargs: dict, compression_ratio: float) -> PiKVLayer | None:
    """The PiKVCache layer a press hook compresses in this call: None unless the call prefills (several new tokens)
    and ``compression_ratio`` is above 0."""
    hidden_states = kwargs["hidden_states"]
    if not is_prefilling(kwargs["cache_position"], hidden_states.shape[1]) or compression_ratio == 0:
        return None
    layer = kwargs["past_key_values"].layers[module.layer_idx]
    if layer.tiers:
        raise ValueError(
            f"{calling_press()}: layer {layer.layer_idx} already holds tokens in tiers ({', '.join(layer.tiers)}) "
            "from an earlier press of this prefill; eviction ranks the uncompressed context: run eviction presses "
            "before compression (ComposedPress([eviction, compression]))"
        )
    return layer


def check_offload(value: str | None) -> None:
    if value is not None and value not in OFFLOAD_TARGETS:
        raise ValueError(f"offload must be None or one of {', '.join(OFFLOAD_TARGETS)}, got {value!r}")
