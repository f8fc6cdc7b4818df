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

from pikv_hf.layer import PagedKV

ATTN_IMPLEMENTATION = "pikv"
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


def pikv_mask(
    batch_size: int,
    cache_position: torch.Tensor,
    kv_length: int,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    config=None,
    **kwargs,
) -> PiKVMask:
    """Mask function registered under ``"pikv"``: keeps the padding and how to build the previous mask."""
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

    padding = None if attention_mask is None else attention_mask.to(torch.bool)
    return PiKVMask(padding=padding, build_previous=build_previous)


def previous_attention(module: nn.Module, name: str) -> Callable:
    """The attention function registered as ``name``, or the model file's own ``eager_attention_forward``."""
    if name == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


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
) -> tuple[torch.Tensor, None]:
    """Attention function registered under ``"pikv"`` (signature of transformers' attention interface)."""
    if not isinstance(key, PagedKV):
        fn = previous_attention(module, previous_implementation(module.config))
        mask = attention_mask.build_previous() if isinstance(attention_mask, PiKVMask) else attention_mask
        extra = {"sliding_window": sliding_window} if sliding_window is not None else {}
        if s_aux is not None:
            extra["s_aux"] = s_aux
        return fn(module, query, key, value, mask, dropout=dropout, scaling=scaling, **extra, **kwargs)
    if dropout and module.training:
        raise ValueError("pikv attention does not implement attention dropout; call model.eval()")
    if kwargs.get("softcap") is not None:
        raise ValueError("pikv attention does not implement logit soft-capping (softcap)")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    padding = attention_mask.padding if isinstance(attention_mask, PiKVMask) else None
    return key.layer.attend(query, scale, padding, sliding_window, s_aux), None


def register() -> None:
    """Register the ``"pikv"`` attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, pikv_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, pikv_mask)


def attach(model: nn.Module) -> None:
    """Switch ``model`` to the ``"pikv"`` attention implementation, remembering the one it had."""
    register()
    current = getattr(model.config, "_attn_implementation", None)
    if current != ATTN_IMPLEMENTATION:
        for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
            setattr(config, PREVIOUS_ATTR, current or DEFAULT_PREVIOUS)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
