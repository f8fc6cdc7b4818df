"""kvpress integration: what a ``PiKVCache`` needs from kvpress's side, installed when ``pikv_hf`` is imported.

* kvpress's ``kv-press-text-generation`` pipeline trims each answer off the cache by slicing every layer's keys to
  the length ``get_seq_length`` reported before the question. A ``PiKVCache`` counts positions (tokens seen), which
  after compression is more than it stores, so the trim of a ``PiKVCache`` is done by position (``crop``) instead.
"""

from __future__ import annotations

from kvpress.pipeline import KVPressTextGenerationPipeline

_original_remove_answer = KVPressTextGenerationPipeline._remove_answer_from_cache


def _remove_answer_from_cache(self, cache, cache_seq_lengths: list[int]) -> None:
    from pikv_hf.cache import PiKVCache

    if not isinstance(cache, PiKVCache):
        return _original_remove_answer(self, cache, cache_seq_lengths)
    for layer, length in zip(cache.layers, cache_seq_lengths, strict=True):
        layer.crop(length)


def install() -> None:
    """Route kvpress's pipeline answer trimming of a ``PiKVCache`` through ``crop`` (idempotent)."""
    KVPressTextGenerationPipeline._remove_answer_from_cache = _remove_answer_from_cache
