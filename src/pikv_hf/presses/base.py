"""What every PiKV press shares: kvpress behaviour on a DynamicCache, real per-(row, KV head) eviction on a PiKVCache.

A PiKV press is a kvpress press (``ScorerPress``, ``DecodingPress``, ... subclasses), so kvpress's pipeline and its
``isinstance`` checks treat it as one of its own. One hook (:meth:`PiKVPress.forward_hook`) branches on the cache:

* on a ``DynamicCache`` (or any other cache) it is kvpress's own hook: the press compresses exactly as a kvpress
  press does, so results are comparable with kvpress's presses;
* on a ``PiKVCache`` it calls the press's :meth:`PiKVPress.press_layer` with the layer, which acts through the
  layer's small API (``view`` / ``view_index``, ``keep``, ``offload_tokens``, ``move_to_tier``, ``slot_stat``,
  ``held``): the bytes are freed per (row, KV head).

Budgets follow kvpress, per row: ``n_kept = compute_n_kept(T_b, compression_ratio)`` tokens per (row, KV head),
``T_b`` the tokens that (row, head) holds. Left padding takes no slot, so it takes no budget, and scores rank by
positions counted from each row's first real token (``DenseView.rel_pos``): a row of a padded batch keeps what it
keeps alone. kvpress's own scorer presses get the same budgets inside a PiKVCache (:func:`scorer_hook`, installed
by ``pikv_hf.kvpress_compat``). How a budget splits over the shards of a (row, head) is the press's
``shard_budget``: ``"global"`` keeps the best-scored tokens wherever they sit; ``"proportional"`` gives every shard
its share in proportion to the tokens it holds (largest remainders) and keeps that shard's best, so no shard a
routed read may select is emptied.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from kvpress.presses.base_press import is_prefilling
from kvpress.presses.scorer_press import ScorerPress
from kvpress.utils import compute_n_kept
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from pikv_hf.cache import PiKVCache
from pikv_hf.checks import calling_press, check_field_types, check_ratio
from pikv_hf.layer import PiKVLayer
from pikv_hf.routing.expert import decoder_layers
from pikv_hf.routing.scores import descending_rank
from pikv_hf.store.tiers import OFFLOAD_TARGETS
from pikv_hf.view import DenseView, view_weights

SHARD_BUDGETS = ("global", "proportional")


def check_shard_budget(value: str) -> None:
    if value not in SHARD_BUDGETS:
        raise ValueError(f"shard_budget must be one of {', '.join(SHARD_BUDGETS)}, got {value!r}")


def check_offload(value: str | None) -> None:
    if value is not None and value not in OFFLOAD_TARGETS:
        raise ValueError(f"offload must be None or one of {', '.join(OFFLOAD_TARGETS)}, got {value!r}")


def row_budgets(count: torch.Tensor, compression_ratio: float) -> torch.Tensor:
    """``compute_n_kept`` of every (row, head)'s token count (``[B, H]`` int64): ``max(1, int(T * (1 - r)))``."""
    kept = (count.double() * (1 - compression_ratio)).floor().long()
    return kept.clamp(min=1) if compression_ratio < 1 else torch.zeros_like(count)


def proportional_keep(
    scores: torch.Tensor, shard: torch.Tensor, valid: torch.Tensor, n_kept: torch.Tensor
) -> torch.Tensor:
    """``[B, H, T]`` bool keep mask: ``n_kept`` (``[B, H]``) entries per (row, head) (fewer if fewer are valid), split
    over shards in proportion to the valid entries each shard holds (largest remainders), the best-scored within
    each shard. ``scores``, ``shard`` (int64, any value where not valid) and ``valid`` are ``[B, H, T]``."""
    b, h, t = scores.shape
    s = int(shard[valid].max()) + 1 if bool(valid.any()) else 1
    shard = torch.where(valid, shard, s)  # entries that are not valid sit in a bucket of their own, never kept
    count = torch.zeros(b, h, s + 1, dtype=torch.float64, device=scores.device)
    count = count.scatter_add_(2, shard, valid.to(torch.float64))[..., :s]
    total = count.sum(-1, keepdim=True)
    target = total.minimum(n_kept.unsqueeze(-1).to(torch.float64))
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


def keep_newest(scores: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
    """``scores`` (``[B, H, T]``) with each (row, head)'s newest token ranked first, so the press that scores this
    way never evicts the token being decoded: the last key on a DynamicCache (position-ordered keys), the entry of
    highest position ``pos`` (``[B, H, T]``) in a PiKVCache view."""
    if pos is None:
        return scores.index_fill(-1, torch.tensor([scores.shape[-1] - 1], device=scores.device), float("inf"))
    return scores.scatter(2, pos.argmax(-1, keepdim=True), float("inf"))


def keep_mask(
    view: DenseView, scores: torch.Tensor, n_kept: int | torch.Tensor, shard_budget: str = "global"
) -> torch.Tensor:
    """``[B, H, T]`` keep mask over ``view``'s entries: the ``n_kept`` (an int or ``[B, H]``) highest ``scores``
    (``[B, H, T]``) of each (row, KV head). Nothing is forced in: a press that keeps the newest token says so in its
    scores (:func:`keep_newest`), on a DynamicCache as here."""
    present = view.valid
    ranked = scores.masked_fill(~present, float("-inf"))
    budget = torch.as_tensor(n_kept, device=ranked.device).expand(ranked.shape[:2])
    if shard_budget == "global":
        return (descending_rank(ranked) < budget.unsqueeze(-1)) & present
    return proportional_keep(ranked, view.shard, present, budget)


def kvpress_scores(
    scorer: ScorerPress, module: nn.Module, kwargs: dict, view: DenseView, attentions: torch.Tensor | None
) -> torch.Tensor:
    """``[B, H, T]`` scores of ``view``'s entries from a kvpress-style ``scorer.score`` (which reads keys laid out as
    on a DynamicCache, indexed against the hidden states: a window of the last queries, sinks and recent tokens by
    index, budgets from the hidden states' length). The view packs each (row, head)'s tokens at the front, while the
    hidden states of a left-padded batch hold the padding in front: unless every row holds as many tokens and the
    forward has no padding, the batch is scored row by row, each row on the tokens it holds and the hidden states
    (and rotary embeddings) of its real tokens of this forward, as that row alone would be (a press before this one
    in a ComposedPress may have left the rows different numbers of tokens: their zero fill was read as each short
    row's newest keys)."""
    hidden = kwargs["hidden_states"]
    q = hidden.shape[1]
    present = kwargs["past_key_values"].layers[module.layer_idx].forward.present  # [B, q] or None: no padding
    counts = view.count.amax(-1).tolist()  # tokens per row (prefill: a host read)
    if present is None and len(set(counts)) == 1:
        attentions = None if attentions is None else view_weights(attentions, view)  # positional -> the view's
        return scorer.score(module, hidden, view.keys, view.values, attentions, kwargs)
    scores = torch.full(view.valid.shape, float("-inf"), device=hidden.device)
    rope = kwargs.get("position_embeddings")
    real = [q] * len(counts) if present is None else present.sum(-1).tolist()
    for b, (n, r) in enumerate(zip(counts, real, strict=True)):
        if not n:
            continue
        row = {**kwargs, "hidden_states": hidden[b : b + 1, q - r :]}
        if rope is not None:
            row["position_embeddings"] = tuple((t[b : b + 1] if t.shape[0] > 1 else t)[:, q - r :] for t in rope)
        keys, values = view.keys[b : b + 1, :, :n], view.values[b : b + 1, :, :n]
        scores[b, :, :n] = scorer.score(module, row["hidden_states"], keys, values, None, row)[0]
    return scores


def topk_keep(view: DenseView, scores: torch.Tensor, n_kept: torch.Tensor) -> torch.Tensor:
    """``[B, H, T]`` keep mask over ``view``'s entries as kvpress's ``ScorerPress.compress`` selects (``torch.topk``,
    nothing forced in), with each (row, head)'s own budget ``n_kept`` (``[B, H]``)."""
    k = int(n_kept.max()) if n_kept.numel() else 0
    top = scores.masked_fill(~view.valid, float("-inf")).topk(min(k, scores.shape[-1]), dim=-1).indices
    taken = torch.arange(top.shape[-1], device=top.device) < n_kept.unsqueeze(-1)
    return torch.zeros_like(view.valid).scatter_(2, top, taken) & view.valid


def drop_or_offload(layer: PiKVLayer, view: DenseView, keep: torch.Tensor, offload: str | None) -> None:
    """Evict the view's tokens outside ``keep`` from the layer's hot store, or move them to its offload tier
    (``"cpu"`` or ``"disk"``) where attention still reads them."""
    if offload is None:
        layer.keep(view, keep)
    else:
        layer.offload_tokens(view, keep, offload)


def evict_lowest(
    layer: PiKVLayer,
    view: DenseView,
    scores: torch.Tensor,
    n_kept: int | torch.Tensor,
    shard_budget: str = "global",
    offload: str | None = None,
) -> None:
    """Keep the ``n_kept`` (an int or ``[B, H]``) highest ``scores`` of ``view``'s entries per (row, KV head) and
    evict (or offload) the rest from the layer's hot store."""
    drop_or_offload(layer, view, keep_mask(view, scores, n_kept, shard_budget), offload)


def prefilling(kwargs: dict) -> bool:
    """kvpress's ``is_prefilling`` for the arguments of a press hook; a one-token forward being traced (a compiled
    decode step, e.g. ``generate``'s on CUDA) is a decode step without reading its position (data there: reading it
    broke the graph)."""
    q = kwargs["hidden_states"].shape[1]
    if q == 1 and torch.compiler.is_compiling():
        return False
    return is_prefilling(kwargs["cache_position"], q)


def refuse_compiled_decode(press: object, what: str) -> None:
    """Raise ``ValueError`` naming ``press`` inside a traced forward: ``what`` it does while decoding changes the
    cache's shapes by data, which a compiled step cannot."""
    if torch.compiler.is_compiling():
        raise ValueError(
            f"{type(press).__name__} {what} while decoding, which a compiled decode step cannot do: run the prefill "
            "under the press and decode with it off, or generate(..., disable_compile=True) with it on"
        )


def prefill_layer(module: nn.Module, kwargs: dict, compression_ratio: float) -> PiKVLayer | None:
    """The PiKVCache layer a press hook compresses in this call: None unless the call prefills (several new tokens)
    and ``compression_ratio`` is above 0."""
    if not prefilling(kwargs) or compression_ratio == 0:
        return None
    layer = kwargs["past_key_values"].layers[module.layer_idx]
    if layer.tiers:
        raise ValueError(
            f"{calling_press()}: layer {layer.layer_idx} already holds tokens in tiers ({', '.join(layer.tiers)}) "
            "from an earlier press of this prefill; eviction ranks the uncompressed context: run eviction presses "
            "before compression (ComposedPress([eviction, compression]))"
        )
    return layer


def scorer_hook(press: ScorerPress, module: nn.Module, kwargs: dict, output: list) -> list:
    """The prefill hook of a scorer press on a PiKVCache: score the layer's view, keep each row's budget (its own
    tokens only), evict (or offload) the rest. Serves pikv_hf's scorer presses and kvpress's own (whose selection is
    kvpress's top-k: on a row of the full length it keeps what kvpress keeps on a DynamicCache)."""
    layer = prefill_layer(module, kwargs, press.compression_ratio)
    if layer is None:
        return output
    view = layer.view()
    if isinstance(press, PiKVScorerPress):
        scores = press.score_view(module, kwargs, view, output[1])
        evict_lowest(layer, view, scores, press.budget(module, view), press.shard_budget, press.offload)
    else:  # kvpress's own scorer: its scores and its top-k, on each row's own tokens
        scores = kvpress_scores(press, module, kwargs, view, output[1])
        layer.keep(view, topk_keep(view, scores, row_budgets(view.count, press.compression_ratio)))
    return output


class PiKVPress:
    """Mixin placed first among a press's bases: the hook that branches on the cache (module docstring).

    Subclasses define :meth:`press_layer` (what the press does to a PiKVCache layer), may refuse a cache they cannot
    act on in :meth:`check_cache` and, when they can rank decoding tokens from the cache's per-slot statistics, name
    them in :attr:`decode_stats` (turned on by a wrapper that decodes under a budget, :meth:`stats_needed`). Both
    take effect before a layer's attention (a pre-hook), so a refusal comes before anything is stored and the
    statistics count the prefill's queries too."""

    replays_prefill = True  # the PiKV branch reads only the hook's arguments: a recorded prefill can be replayed
    decode_stats: tuple[str, ...] = ()
    # on another cache: the press removes keys (kvpress's compress), or masks them through kvpress's attention patch
    shortens_keys = False
    masks_keys = False

    def forward_hook(self, module: nn.Module, input: list[torch.Tensor], kwargs: dict, output: list):
        cache = kwargs["past_key_values"]
        if not isinstance(cache, PiKVCache):
            return super().forward_hook(module, input, kwargs, output)
        self.press_layer(module, cache.layers[module.layer_idx], kwargs, output)
        return output

    def press_layer(self, module: nn.Module, layer: PiKVLayer, kwargs: dict, output: list) -> None:
        raise NotImplementedError

    def stats_needed(self) -> tuple[str, ...]:
        """The per-slot statistics the cache must keep while this press is on: none for a prefill press, which
        computes its statistics from the queries (:class:`DecodingBudgetPress` asks for its base's
        :attr:`decode_stats`). Kept statistics take every attention off the fast path (per-slot mass)."""
        return ()

    def check_cache(self) -> None:
        """Raise if this press cannot act on a PiKVCache (called before a layer's attention)."""

    def validate(self) -> None:
        """Check the press's fields (``TypeError`` / ``ValueError`` naming the field): at construction and again on
        entering the press, since a field may be set after construction (kvpress's evaluation loops set
        ``compression_ratio``), before any forward stores anything. Subclasses add their own fields' checks."""
        check_field_types(self)
        ratio = getattr(self, "compression_ratio", None)
        if ratio is not None:
            check_ratio("compression_ratio", ratio)

    def check_other_cache(self, module: nn.Module, cache) -> None:
        """Raise if this press cannot act on ``cache`` (any cache but a PiKVCache), before a layer's attention: a
        press that removes keys cannot cut a sliding-window layer (a DynamicCache built from GPT-OSS's config: its
        attention mask keeps the window's length, and the forward failed with a size mismatch), and one that masks
        them goes through kvpress's attention patch, which eager attention does not take (it silently kept them)."""
        name, kind = type(self).__name__, type(cache).__name__
        if self.shortens_keys and any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", ())):
            raise ValueError(
                f"{name} removes keys, which the sliding-window layers of this {kind} cannot take: use a PiKVCache "
                "(it evicts per row and head, sliding-window layers included)"
            )
        impl = module.config._attn_implementation
        if self.masks_keys and impl not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(
                f"{name} masks the dropped keys on a {kind} through kvpress's attention patch, which "
                f"attn_implementation={impl!r} does not go through: load the model with attn_implementation='sdpa', "
                "or use a PiKVCache (which evicts them)"
            )

    @contextmanager
    def __call__(self, model: nn.Module):
        with self.entered(model), super().__call__(model):
            yield

    @contextmanager
    def entered(self, model: nn.Module, checks: bool = True):
        """What entering the press does besides installing its hook: :meth:`validate`, then (``checks``) a hook
        that checks the cache before each layer's attention stores anything. A press inside a wrapper is entered
        too (``pikv_hf.kvpress_compat``): with ``checks`` where the wrapper hands it the layer to act on (kvpress's
        ComposedPress, PerLayerCompressionPress, ChunkPress, DecodingPress, PrefillDecodingPress), without where the
        wrapper only reads its scores."""
        self.validate()
        hook = self._before_attention
        layers = decoder_layers(model) if checks else []
        hooks = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in layers]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()

    def _before_attention(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        cache = kwargs.get("past_key_values")
        if isinstance(cache, PiKVCache):
            layer = cache.layers[module.layer_idx]
            if not layer.has_view:  # a partitioned cache: refused here, before the layer stores anything
                raise layer.refusal(f"{type(self).__name__} (a press edits a layer through its dense view)")
            self.check_cache()
            if self.stats_needed():
                layer.enable_stats()
        elif cache is not None and module.layer_idx == 0:  # the whole cache and the model's attention: checked once
            self.check_other_cache(module, cache)


@dataclass
class PiKVScorerPress(PiKVPress, ScorerPress):
    """A ``ScorerPress`` whose prefill hook, on a ``PiKVCache``, evicts the lowest-scored tokens of each (row, KV head)
    (see the module docstring); on any other cache it is kvpress's ``ScorerPress``.

    Subclasses give ``score`` (kvpress's signature: ``[B, H, T]``, higher = keep), may give :meth:`score_view` (the
    same from a PiKVCache layer's view, with positions) and, when the cache's statistics rank decoding tokens,
    :meth:`decode_scores` (used by :class:`pikv_hf.presses.DecodingBudgetPress`).

    Parameters
    ----------
    compression_ratio : float
        Fraction of the context's KV pairs removed per (row, KV head), in ``[0, 1)``.
    shard_budget : str
        ``"global"`` or ``"proportional"``: how a (row, head)'s budget splits over its shards in a PiKVCache.
    offload : str or None
        PiKVCache only: move the tokens the press does not keep to an offload tier (``"cpu"``: CPU memory, pinned
        when the cache is on a GPU; ``"disk"``: memory-mapped files) instead of dropping them; attention keeps
        reading them there (routed reads select shards over both tiers).
    """

    compression_ratio: float = 0.0
    shard_budget: str = "global"
    offload: str | None = None
    shortens_keys = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        super().validate()
        check_shard_budget(self.shard_budget)
        check_offload(self.offload)

    recomputes_queries = False  # scores from the model's own queries (presses.queries): checked on entering

    def post_init_from_model(self, model: nn.Module) -> None:
        """Refuse, before any forward, a model whose query path the press cannot follow."""
        super().post_init_from_model(model)
        if self.recomputes_queries:
            from pikv_hf.presses.queries import check_query_path

            for layer in decoder_layers(model):
                check_query_path(layer.self_attn)

    def press_layer(self, module: nn.Module, layer: PiKVLayer, kwargs: dict, output: list) -> None:
        scorer_hook(self, module, kwargs, output)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        """A DynamicCache's prefill or decode-time cut (kvpress's ``ScorerPress.compress``: the ``compute_n_kept``
        best-scored pairs of each head), the kept pairs left in position order: kvpress gathers them in score order,
        and a press that scores by index (sinks, recent window, recency) reads index as position at its next cut
        (``DecodingBudgetPress``; a PiKVCache keeps positions)."""
        if self.compression_ratio == 0:
            return keys, values
        scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
        n_kept = compute_n_kept(keys.shape[2], self.compression_ratio)
        at = scores.topk(n_kept, dim=-1).indices.sort(-1).values.unsqueeze(-1)
        return tuple(x.gather(2, at.expand(*at.shape[:3], x.shape[-1])).contiguous() for x in (keys, values))

    def score_view(self, module: nn.Module, kwargs: dict, view: DenseView, attentions) -> torch.Tensor:
        """``[B, H, T]`` scores of a PiKVCache layer's view at prefill (default: kvpress's ``score`` of its keys)."""
        return kvpress_scores(self, module, kwargs, view, attentions)

    def decode_scores(self, layer: PiKVLayer, view: DenseView, n_kept: int) -> torch.Tensor:
        """``[B, H, T]`` scores of ``view``'s entries from the cache's statistics (decode time; ``n_kept`` is the
        budget they will be cut to)."""
        raise NotImplementedError(f"{type(self).__name__} has no decode-time scores from cache statistics")

    def decode_keep(self, layer: PiKVLayer, view: DenseView, n_kept: int) -> torch.Tensor:
        """Keep mask of the ``n_kept`` tokens per (row, KV head) that :meth:`decode_scores` ranks highest."""
        return keep_mask(view, self.decode_scores(layer, view, n_kept), n_kept, self.shard_budget)

    def budget(self, module: nn.Module, view: DenseView) -> torch.Tensor:
        """``[B, H]`` tokens ``module``'s layer keeps of ``view`` at prefill: ``compute_n_kept`` of each (row, head)'s
        own tokens (layer-wise budgets override it)."""
        return row_budgets(view.count, self.compression_ratio)
