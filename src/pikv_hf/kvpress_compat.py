"""kvpress integration: what a ``PiKVCache`` needs from kvpress's side, installed when ``pikv_hf`` is imported.

* kvpress's ``kv-press-text-generation`` pipeline trims each answer off the cache by slicing every layer's keys to
  the length ``get_seq_length`` reported before the question. A ``PiKVCache`` counts positions (tokens seen), which
  after compression is more than it stores, so the trim of a ``PiKVCache`` is done by position (``crop``) instead.
* Errors raised while a press's hook runs name that press (:func:`calling_press`).
"""

from __future__ import annotations

import inspect

from kvpress import BasePress
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


def calling_press() -> str:
    """The class name of the outermost kvpress press whose hook is running (for error messages), or ``"code"``."""
    name = "code"
    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, BasePress):
            name = type(owner).__name__
        frame = frame.f_back
    return name
