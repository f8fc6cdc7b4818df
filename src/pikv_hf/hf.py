"""transformers glue: the ``"pikv"`` mask and attention functions, their registration, and ``attach``.

With a ``PiKVCache`` the attention function receives the layer's ``PagedKV`` view instead of key/value tensors and
the layer computes attention from its store, masking by stored positions and valid bits. With any other cache, or
none, the call is handed over unchanged to the implementation the model used before ``attach`` (its own mask is
built lazily from the mask arguments transformers passed), so attaching a PiKVCache never changes another
computation.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from pikv_hf.constants import ATTN_IMPLEMENTATION
from pikv_hf.layer import PagedKV

PREVIOUS_ATTR = "_pikv_previous_attn_implementation"
DEFAULT_PREVIOUS = "sdpa"


@dataclass
class PiKVMask:
    """What the ``pikv`` mask function hands to the attention function.

    Attributes
    ----------
    padding : torch.Tensor or None
        ``[B, T]`` bool, False for padding tokens, over all ``T`` tokens seen so far including the current ones
        (the 2-D ``attention_mask`` of ``generate``); None when the caller gave no mask.
    build_previous : callable
        Builds the mask the previous attention implementation expects (called only when the call is handed over).
    """

    padding: torch.Tensor | None
    build_previous: Callable[[], Any] = field(repr=False, default=lambda: None)


def previous_implementation(config) -> str:
    """The attention implementation a model used before ``attach`` (``"sdpa"`` if it was loaded as ``"pikv"``)."""
    return getattr(config, PREVIOUS_ATTR, DEFAULT_PREVIOUS)


def _caller_cache(depth: int = 2):
    """The ``past_key_values`` of transformers' mask builder that called the mask function (``create_causal_mask``
    and its sliding / chunked siblings take it as an argument; the mask interface does not receive it)."""
    frame = sys._getframe(depth)
    return frame.f_locals.get("past_key_values", _UNKNOWN) if frame is not None else _UNKNOWN


_UNKNOWN = object()


def pikv_mask(
    batch_size: int,
    cache_position: torch.Tensor,
    kv_length: int,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    config=None,
    **kwargs,
) -> PiKVMask | Any:
    """Mask function registered under ``"pikv"``. For a ``PiKVCache`` it keeps only the padding (the cache masks by
    stored positions); for any other cache, or none, it returns the previous implementation's own mask."""
    from pikv_hf.cache import PiKVCache

    previous = previous_implementation(config)

    def build_previous():
        fn = ALL_MASK_ATTENTION_FUNCTIONS[previous]
        return fn(
            batch_size=batch_size,
            cache_position=cache_position,
            kv_length=kv_length,
            kv_offset=kv_offset,
            attention_mask=attention_mask,
            config=config,
            **kwargs,
        )

    cache = _UNKNOWN if torch.compiler.is_compiling() else _caller_cache()
    if cache is not _UNKNOWN and not isinstance(cache, PiKVCache):
        return build_previous()
    padding = None if attention_mask is None else attention_mask.to(torch.bool)
    return PiKVMask(padding=padding, build_previous=build_previous)


def previous_attention(module: nn.Module, name: str) -> Callable:
    """The attention function registered as ``name``, or the model file's own ``eager_attention_forward``."""
    if name == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def wants_attention_weights(module: nn.Module) -> bool:
    """Whether the caller expects attention probabilities back: the model was on the eager implementation (whose
    consumers, e.g. kvpress's ObservedAttentionPress, read them) or ``output_attentions`` is being collected."""
    if previous_implementation(module.config) == "eager":
        return True
    if torch.compiler.is_compiling():  # the collector is a ContextVar, which dynamo does not trace
        return False
    from transformers.utils.output_capturing import _active_collector

    return "attentions" in (_active_collector.get() or {})


def pikv_attention(
    module: nn.Module,
    query: torch.Tensor,
    key,
    value,
    attention_mask: PiKVMask | torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention function registered under ``"pikv"`` (signature of transformers' attention interface).

    Without a ``PiKVCache`` the call goes unchanged to the implementation the model had before ``attach``. With one,
    the layer attends from its store; a custom 4-D ``attention_mask`` (which indexes the positions of a contiguous
    cache) is honoured by running the previous implementation over the layer's position-ordered view, as long as
    nothing was evicted.
    """
    fn = previous_attention(module, previous_implementation(module.config))
    extra = {"sliding_window": sliding_window} if sliding_window is not None else {}
    if s_aux is not None:
        extra["s_aux"] = s_aux
    if not isinstance(key, PagedKV):
        mask = attention_mask.build_previous() if isinstance(attention_mask, PiKVMask) else attention_mask
        return fn(module, query, key, value, mask, dropout=dropout, scaling=scaling, **extra, **kwargs)
    layer = key.layer
    if isinstance(attention_mask, torch.Tensor):
        view = layer.view()
        if not view.contiguous:
            raise ValueError(
                f"layer {layer.layer_idx}: a custom 4-D attention_mask indexes the positions of a contiguous cache, "
                "but this PiKVCache has evicted tokens; pass a 2-D padding mask (or none) instead"
            )
        return fn(
            module, query, view.keys, view.values, attention_mask, dropout=dropout, scaling=scaling, **extra, **kwargs
        )
    if dropout and module.training:
        raise ValueError("pikv attention does not implement attention dropout; call model.eval()")
    if kwargs.get("softcap") is not None:
        raise ValueError("pikv attention does not implement logit soft-capping (softcap)")
    if getattr(module, "masked_key_indices", None) is not None:
        module.masked_key_indices = None  # kvpress's patch just handed them to PagedKV.__setitem__: evicted
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    padding = attention_mask.padding if isinstance(attention_mask, PiKVMask) else None
    out = layer.attend(query, scale, padding, sliding_window, s_aux)
    weights = None
    if layer.partition is None and wants_attention_weights(module):  # a partitioned layer has no dense view
        weights = layer.attention_weights(query, scale, sliding_window, s_aux)
    return out, weights


def register() -> None:
    """Register the ``"pikv"`` attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, pikv_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, pikv_mask)


def _configs(model: nn.Module) -> list:
    return list({id(c): c for c in (model.config, model.config.get_text_config())}.values())


def attach(model: nn.Module) -> None:
    """Switch ``model`` to the ``"pikv"`` attention implementation, remembering the one it had."""
    register()
    current = getattr(model.config, "_attn_implementation", None)
    if current != ATTN_IMPLEMENTATION:
        for config in _configs(model):
            setattr(config, PREVIOUS_ATTR, current or DEFAULT_PREVIOUS)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)


def detach(model: nn.Module) -> None:
    """Give ``model`` back the attention implementation it had before :func:`attach` (no-op if not attached)."""
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        return
    previous = previous_implementation(model.config)
    model.set_attn_implementation(previous)
    for config in _configs(model):
        if hasattr(config, PREVIOUS_ATTR):
            delattr(config, PREVIOUS_ATTR)
