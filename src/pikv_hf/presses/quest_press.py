"""Quest: query-aware page selection at every decode step (selection, not eviction)."""

from __future__ import annotations

import dataclasses
import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from kvpress.attention_patch import search_hyperplane
from kvpress.presses.decoding_press import DecodingPress
from kvpress.presses.scorer_press import ScorerPress
from torch import nn

from pikv_hf.cache import PiKVCache
from pikv_hf.checks import check_field_types, check_int_at_least, check_ratio
from pikv_hf.config import ReadConfig
from pikv_hf.presses.queries import model_queries
from pikv_hf.routing.expert import decoder_layers
from pikv_hf.routing.scores import descending_rank, upper_bounds


def quest_pages(
    queries: torch.Tensor,
    keys: torch.Tensor,
    page_size: int,
    read_fraction: float,
    n_sink: int,
    window: int,
    row_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, H, T]`` bool: the cached tokens Quest reads for one decode query (``queries`` ``[B, H, G, D]``, the query
    heads of each KV head, at position ``T``) over ``keys`` ``[B, H, T, D]`` in position order.

    The ``T + 1`` tokens (the new one included) form pages of ``page_size``; the pages holding one of the first
    ``n_sink`` tokens or one of the last ``window`` positions (the new token's page among them) are read always, and
    the pages with the largest upper bound ``max_g sum_d max(q_d min_d, q_d max_d)`` of ``q . k`` up to
    ``ceil(read_fraction * pages)`` pages in all, ties to the earlier page (as a PiKVCache's Quest read ranks its
    pages). ``row_start`` (``[B]``): each row's left padding, which takes no page (its pages and sinks start at the
    row's first real token, as in a PiKVCache) and is not read.
    """
    if row_start is not None and bool(row_start.any()):
        rows = [
            F.pad(quest_pages(queries[i : i + 1], keys[i : i + 1, :, s:], page_size, read_fraction, n_sink, window),
                  (s, 0), value=False)
            for i, s in enumerate(row_start.tolist())
        ]  # fmt: skip
        return torch.cat(rows)
    b, h, t, d = keys.shape
    n_pages = math.ceil((t + 1) / page_size)
    padded = torch.nn.functional.pad(keys.float(), (0, 0, 0, n_pages * page_size - t))
    pages = padded.view(b, h, n_pages, page_size, d)
    filled = (torch.arange(n_pages * page_size, device=keys.device) < t).view(1, 1, n_pages, page_size, 1)
    lo = pages.masked_fill(~filled, float("inf")).amin(3)
    hi = pages.masked_fill(~filled, float("-inf")).amax(3)
    bound = upper_bounds(queries, lo, hi, filled.view(1, 1, n_pages, page_size).sum(-1).expand(b, h, -1))
    first = torch.arange(n_pages, device=keys.device) * page_size
    special = (first < n_sink) | (first + page_size - 1 > t - window)  # a sink, or a position within the window
    bound = bound.masked_fill(special.view(1, 1, -1), float("inf"))
    read = (descending_rank(bound) < math.ceil(read_fraction * n_pages)) | special.view(1, 1, -1)
    return read.repeat_interleave(page_size, dim=-1)[..., :t]


@dataclass(init=False)
class QuestPress(DecodingPress):
    """Quest (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024): each
    decode query reads only ``ceil((1 - compression_ratio) * pages)`` pages of its (row, KV head): the pages holding
    sink or recent-window tokens, then those with the largest upper bound of ``q . k`` from per-page key min / max.
    Nothing is evicted: the ratio is the share of the KV a decode step does not read.

    On a ``PiKVCache`` the press sets the cache's read policy to Quest with its own ratio before every layer's
    attention (``attention="quest"``, ``read_fraction = 1 - compression_ratio``, pages of the cache's ``page_size``,
    bounds kept incrementally), whatever mode the cache was in; the cache keeps that mode after the press. The cache's
    ``sparse_from`` still applies (default 4096 positions per row, :data:`pikv_hf.config.SPARSE_FROM`: below it a
    dense read is faster on a CPU): a decode step that reads densely because of it warns once per ``with`` block
    (``PiKVCache(model, sparse_from=0)`` reads sparsely from the first step). On a
    ``DynamicCache`` a hook before every decode step's attention computes the query, selects pages of ``page_size``
    tokens (a left-padded row's from its first real token, found from the step's ``position_ids``) and replaces the
    other cached keys, for that step only, by a key no query of the head attends to (kvpress's
    ``search_hyperplane``); the hook after the step puts the real keys back. (kvpress's own head-wise
    masking writes its fake keys into the cache for good, which is right for a fixed mask but not for a selection
    that changes at every step.) It is a kvpress ``DecodingPress`` so that kvpress's pipeline keeps it active while
    answering.

    Parameters
    ----------
    compression_ratio : float
        Share of pages a decode step skips, in ``[0, 1)``.
    page_size : int
        Tokens per page on a DynamicCache.
    n_sink, window : int
        First and most recent tokens whose pages are always read.
    """

    compression_ratio: float = 0.0
    page_size: int = 16
    n_sink: int = 4
    window: int = 64

    def __init__(self, compression_ratio: float = 0.0, page_size: int = 16, n_sink: int = 4, window: int = 64):
        # the ratio comes first, as in every kvpress press; DecodingPress's own fields keep their defaults (its
        # base press is never called: Quest selects, it does not evict)
        self.base_press = ScorerPress()
        self.compression_interval, self.target_size, self.hidden_states_buffer_size = 512, 2048, 256
        self.compression_ratio, self.page_size, self.n_sink, self.window = compression_ratio, page_size, n_sink, window
        self.__post_init__()

    def __post_init__(self) -> None:
        self.validate()
        self._real_keys: dict[int, torch.Tensor] = {}
        self._warned = False

    def read_config(self, cache: PiKVCache) -> ReadConfig:
        """The cache's read settings with this press's Quest selection (its other options, e.g. ``sparse_from``,
        kept)."""
        return dataclasses.replace(
            cache.read,
            attention="quest",
            read_fraction=1 - self.compression_ratio,
            n_sink=self.n_sink,
            window=self.window,
            mass_target=None,
        )

    def forward_hook(self, module: nn.Module, input: list[torch.Tensor], kwargs: dict, output: list):
        cache = kwargs["past_key_values"]
        if isinstance(cache, PiKVCache):
            decoding = kwargs["hidden_states"].shape[1] == 1
            if decoding and self.compression_ratio and not self._warned and not torch.compiler.is_compiling():
                self._warn_if_dense(cache.layers[module.layer_idx])  # reads lengths: eager steps only
            return output
        real = self._real_keys.pop(module.layer_idx, None)
        if real is not None:  # the step is over: the real keys go back, followed by the step's new ones
            layer = cache.layers[module.layer_idx]
            layer.keys = torch.cat([real, layer.keys[:, :, real.shape[2] :]], dim=2)
        return output

    def _warn_if_dense(self, layer) -> None:
        """Warn (once per ``with`` block) when ``layer``'s decode step just read every page because of the cache's
        ``sparse_from``."""
        # some row read sparsely, or a layer kept dense (dense_layers)
        if layer._sparse_rows() is not False or layer.get_seq_length() >= layer.read.sparse_threshold:
            return
        self._warned = True
        warnings.warn(
            f"QuestPress({self.compression_ratio}) has no effect yet: this PiKVCache reads densely until a layer has "
            f"seen sparse_from={layer.read.sparse_threshold} positions per row (layer {layer.layer_idx} has seen "
            f"{layer.get_seq_length()}); build it with PiKVCache(model, sparse_from=0) to read sparsely from the first "
            "decode step",
            stacklevel=2,
        )

    def _select(self, module: nn.Module, args, kwargs: dict) -> None:
        """Before a layer's attention: on a PiKVCache, its Quest read settings; before a DynamicCache decode step's
        attention, hide the keys of the pages the query does not read."""
        cache = kwargs.get("past_key_values")
        hidden = kwargs["hidden_states"]
        if isinstance(cache, PiKVCache):
            wanted = self.read_config(cache)
            if cache.read != wanted:
                cache.set_attention(wanted)
            return
        if hidden.shape[1] != 1 or not self.compression_ratio:
            return
        layer = cache.layers[module.layer_idx] if cache is not None and module.layer_idx < len(cache.layers) else None
        if layer is None or layer.keys is None or not layer.keys.numel():
            return
        keys = layer.keys  # the cached tokens; the new token is appended after them and always read
        queries = model_queries(module, hidden, kwargs)
        b, hq, _, d = queries.shape
        h = keys.shape[1]
        qg = queries.view(b, h, hq // h, d)
        # left padding: position_ids count a padded row's real tokens (generate), the cache all its positions
        pos = kwargs.get("position_ids")
        pads = None if pos is None else (keys.shape[2] - pos[:, -1].to(keys.device)).clamp(0, keys.shape[2]).expand(b)
        read = quest_pages(qg, keys, self.page_size, 1 - self.compression_ratio, self.n_sink, self.window, pads)
        fake = search_hyperplane(qg.reshape(b * h, hq // h, d)).view(b, h, 1, d).to(keys.dtype)
        self._real_keys[module.layer_idx] = keys
        layer.keys = torch.where(read.unsqueeze(-1), keys, fake)

    def validate(self) -> None:
        """Check the fields (at construction and again on entering: they may be set after construction)."""
        check_field_types(self)
        check_ratio("compression_ratio", self.compression_ratio)
        check_int_at_least("page_size", self.page_size, 1)
        check_int_at_least("n_sink", self.n_sink, 0)
        check_int_at_least("window", self.window, 1)

    @contextmanager
    def __call__(self, model: nn.Module):
        self.validate()
        self._warned = False
        handles = [
            layer.self_attn.register_forward_pre_hook(self._select, with_kwargs=True) for layer in decoder_layers(model)
        ]
        try:
            with super().__call__(model):
                yield
        finally:
            for handle in handles:
                handle.remove()
            self._real_keys.clear()
