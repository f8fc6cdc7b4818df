"""kvpress integration: what a ``PiKVCache`` needs from kvpress's side, installed when ``pikv_hf`` is imported.

* kvpress's ``kv-press-text-generation`` pipeline trims each answer off the cache by slicing every layer's keys to
  the length ``get_seq_length`` reported before the question. A ``PiKVCache`` counts positions (tokens seen), which
  after compression is more than it stores, so the trim of a ``PiKVCache`` is done by position (``crop``) instead.
* kvpress's scorer presses (``ScorerPress`` subclasses that keep kvpress's top-k ``compress``: SnapKV, Knorm,
  ExpectedAttention, ...) prefill a ``PiKVCache`` through ``pikv_hf.presses.base.scorer_hook``: their own ``score``,
  each row's budget counted on its own tokens (left padding takes none), evicted per (row, KV head). On any other
  cache their hook is kvpress's.
"""

from __future__ import annotations

from kvpress.pipeline import KVPressTextGenerationPipeline
from kvpress.presses.base_press import BasePress
from kvpress.presses.scorer_press import ScorerPress

_original_remove_answer = KVPressTextGenerationPipeline._remove_answer_from_cache


def _remove_answer_from_cache(self, cache, cache_seq_lengths: list[int]) -> None:
    from pikv_hf.cache import PiKVCache

    if not isinstance(cache, PiKVCache):
        return _original_remove_answer(self, cache, cache_seq_lengths)
    for layer, length in zip(cache.layers, cache_seq_lengths, strict=True):
        layer.crop(length)


def _scorer_forward_hook(self, module, input, kwargs, output):
    from pikv_hf.cache import PiKVCache
    from pikv_hf.presses.base import scorer_hook

    if isinstance(kwargs["past_key_values"], PiKVCache) and type(self).compress is ScorerPress.compress:
        return scorer_hook(self, module, kwargs, output)
    return BasePress.forward_hook(self, module, input, kwargs, output)


def install() -> None:
    """Route kvpress's pipeline answer trimming and its scorer presses' prefill hook on a ``PiKVCache`` through
    pikv_hf (idempotent)."""
    KVPressTextGenerationPipeline._remove_answer_from_cache = _remove_answer_from_cache
    ScorerPress.forward_hook = _scorer_forward_hook
