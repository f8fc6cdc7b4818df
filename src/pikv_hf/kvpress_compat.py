"""kvpress integration: what a ``PiKVCache`` needs from kvpress's side, installed when ``pikv_hf`` is imported.

* kvpress's ``kv-press-text-generation`` pipeline trims each answer off the cache by slicing every layer's keys to
  the length ``get_seq_length`` reported before the question. A ``PiKVCache`` counts positions (tokens seen), which
  after compression is more than it stores, so the trim of a ``PiKVCache`` is done by position (``crop``) instead.
* kvpress's scorer presses (``ScorerPress`` subclasses that keep kvpress's top-k ``compress``: SnapKV, Knorm,
  ExpectedAttention, ...) prefill a ``PiKVCache`` through ``pikv_hf.presses.base.scorer_hook``: their own ``score``,
  each row's budget counted on its own tokens (left padding takes none), evicted per (row, KV head). On any other
  cache their hook is kvpress's.
* kvpress's other presses (their own ``compress`` on a layer's dense keys: AdaKV, ChunkKV, Block, ...; and those
  with a hook of their own on the cache's keys: ``DecodingPress`` and its subclasses, DMS, KVzip, FastKVzip,
  KVCompose) run on a ``PiKVCache`` as on a ``DynamicCache``, except on a left-padded batch, which they are refused
  (its rows start at different positions in the dense view).
* Entering any press enters the pikv_hf presses inside it (``PiKVPress.entered``): their fields are checked, and
  where the wrapper hands them the layer to act on, so is the cache, before each layer stores anything (kvpress's
  wrappers call an inner press's hook directly: a ratio of 1.5 emptied every layer, PyramidPress on eager attention
  was a silent no-op, H2O on GPT-OSS's DynamicCache failed at decode with a size mismatch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

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


_original_forward_hook = BasePress.forward_hook


def _refuse_left_padded(press, module, kwargs: dict) -> None:
    """Refuse a kvpress press acting on a layer's dense keys over a PiKVCache holding a left-padded batch: there each
    row's tokens are packed from its own start and the shorter rows filled at the end, so the press scored the fill
    as tokens (kvpress's AdaKV, ChunkKV, Block kept none of a padded row's tokens; a ``DecodingPress`` kept 3 and 8
    tokens of two rows where each alone keeps 17). The layer's new tokens are cut again first, so the cache is left as
    it was before the forward."""
    from pikv_hf.cache import PiKVCache

    cache = kwargs["past_key_values"]
    if isinstance(cache, PiKVCache):
        layer = cache.layers[module.layer_idx]
        if layer.rows_start_apart():
            before = layer.seen - kwargs["hidden_states"].shape[1]
            if before:
                layer.crop(before)
            else:
                layer.reset()  # as before its first tokens: it takes any batch again
            raise ValueError(
                f"{type(press).__name__} (kvpress's own compression of the layer's keys) cannot cut a left-padded "
                "batch in a PiKVCache: its rows start at different positions. Run it one row at a time, or use a "
                "pikv_hf press or a kvpress scorer press (each row's budget on its own tokens)"
            )


def _guarded(hook):
    """``hook`` (a kvpress press class's own ``forward_hook`` on the cache's keys) refused on a left-padded PiKVCache
    batch first."""

    def forward_hook(self, module, input, kwargs, output):
        _refuse_left_padded(self, module, kwargs)
        return hook(self, module, input, kwargs, output)

    return forward_hook


def _own_hooks() -> dict[type, object]:
    """kvpress's press classes with a ``forward_hook`` of their own that reads or cuts the cache's keys (not those
    that hand the call to inner presses: ComposedPress, PrefillDecodingPress, PerLayerCompressionPress), guarded."""
    import kvpress

    names = ("DecodingPress", "DMSPress", "FastKVzipPress", "KVComposePress", "KVzipPress")
    classes = [getattr(kvpress, name) for name in names if hasattr(kvpress, name)]
    return {cls: _guarded(cls.__dict__["forward_hook"]) for cls in classes if "forward_hook" in cls.__dict__}


_GUARDED = _own_hooks()
# kvpress's own hook (its ``compress`` on the layer's dense keys), refused on a left-padded PiKVCache batch
_base_forward_hook = _guarded(_original_forward_hook)


def _scorer_forward_hook(self, module, input, kwargs, output):
    from pikv_hf.cache import PiKVCache
    from pikv_hf.presses.base import scorer_hook

    if isinstance(kwargs["past_key_values"], PiKVCache) and type(self).compress is ScorerPress.compress:
        return scorer_hook(self, module, kwargs, output)
    return _base_forward_hook(self, module, input, kwargs, output)


_original_call = BasePress.__call__


def _acting_wrappers() -> tuple[type, ...]:
    """kvpress's wrappers that hand their inner presses the layer to act on (their hook or ``compress``); the others
    (AdaKV, CriticalKV, Block, ChunkKV, KeyRerotation, ...) only read their inner press's scores."""
    import kvpress

    names = ("ComposedPress", "PerLayerCompressionPress", "ChunkPress", "DecodingPress", "PrefillDecodingPress")
    return tuple(getattr(kvpress, name) for name in names if hasattr(kvpress, name))


_ACTING = _acting_wrappers()


def _inner_presses(press: BasePress, acts: bool = True) -> Iterator[tuple[BasePress, bool]]:
    """Every press inside ``press`` (its dataclass fields, lists of presses included, recursively), with whether it
    acts on the layer itself (every wrapper above it hands it the layer) or only gives scores."""
    if not dataclasses.is_dataclass(press):
        return
    acts = acts and isinstance(press, _ACTING)
    for field in dataclasses.fields(press):
        value = getattr(press, field.name, None)
        for inner in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(inner, BasePress):
                yield inner, acts
                yield from _inner_presses(inner, acts)


@contextmanager
def _call(self, model):
    """``BasePress.__call__`` entering the pikv_hf presses inside the press first (``PiKVPress.entered``); a kvpress
    press of its own refuses a partitioned PiKVCache before a layer's attention stores anything (its hook reads the
    layer's dense keys: refused after layer 0 had stored, the undo failed and the cache was out of step)."""
    from pikv_hf.presses.base import PiKVPress
    from pikv_hf.routing.expert import decoder_layers

    with ExitStack() as stack:
        for inner, acts in _inner_presses(self):
            if isinstance(inner, PiKVPress):
                stack.enter_context(inner.entered(model, checks=acts))
        if not isinstance(self, PiKVPress):
            hook = _refuse_partitioned(type(self).__name__)
            for layer in decoder_layers(model):
                stack.callback(layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True).remove)
        stack.enter_context(_original_call(self, model))
        yield


def _refuse_partitioned(name: str):
    def before_attention(module, args, kwargs) -> None:
        from pikv_hf.cache import PiKVCache

        cache = kwargs.get("past_key_values")
        if isinstance(cache, PiKVCache) and not cache.layers[module.layer_idx].has_view:
            raise cache.layers[module.layer_idx].refusal(f"{name} (a kvpress press reads the layer's dense keys)")

    return before_attention


def install() -> None:
    """Route kvpress's pipeline answer trimming, its scorer presses' prefill hook and its other presses' hook on a
    ``PiKVCache`` through pikv_hf (idempotent)."""
    KVPressTextGenerationPipeline._remove_answer_from_cache = _remove_answer_from_cache
    BasePress.forward_hook = _base_forward_hook
    BasePress.__call__ = _call
    ScorerPress.forward_hook = _scorer_forward_hook
    for cls, hook in _GUARDED.items():
        cls.forward_hook = hook
