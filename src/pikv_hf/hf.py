"""transformers glue: the ``"pikv"`` mask and attention functions, the forward hooks, ``attach`` / ``detach``.

``attach(model)`` switches the model to the ``"pikv"`` attention and hooks its decoder: before every forward a cache
derived from :class:`ForwardAwareCache` (``PiKVCache``) learns whether this forward runs the ``"pikv"`` attention
and which new tokens are left padding (from the 2-D ``attention_mask``), before any layer stores anything, so padding
takes no slot and no budget. With such a cache the attention function receives the layer's ``PagedKV`` handle and
the layer attends from its store, masking by stored positions (the mask function returns None there). With any
other cache, or none, mask and attention are the implementation's the model had before ``attach``, so attaching
never changes another computation.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, PretrainedConfig
from transformers.cache_utils import Cache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from pikv_hf.constants import ATTN_IMPLEMENTATION
from pikv_hf.forward import PagedKV

PREVIOUS_ATTR = "_pikv_previous_attn_implementation"
HOOKS_ATTR = "_pikv_forward_hooks"
DEFAULT_PREVIOUS = "sdpa"


class ForwardAwareCache(Cache):
    """A cache the decoder's forward hooks tell, before the layers run, what the forward brings (``begin_forward``)
    and that it ended (``end_forward``); after a forward that raised half-way, the hooks put its layers back in step
    (``undo_partial_forward``) or, where that is impossible, refuse further forwards until ``reset``."""

    out_of_step: str | None = None  # why the layers hold different positions (a failed undo), else None
    # whether every row has had a real token since the last reset: left padding precedes each row's first real
    # token, so a one-token forward is checked for padding (a host read) only before then
    rows_started: bool = False

    def begin_forward(self, attention_mask: torch.Tensor | None, new_tokens: int, pikv: bool) -> None:
        raise NotImplementedError

    def end_forward(self, failed: bool = False) -> None:
        raise NotImplementedError

    def forward_running(self) -> bool:
        """Whether a forward of this cache began and did not end."""
        raise NotImplementedError

    def end_interrupted_forward(self) -> None:
        """End a forward that stopped without the forward hook's end (a ``KeyboardInterrupt``, which torch's
        ``always_call`` hooks do not see), and undo it as a failed one."""
        while self.forward_running():
            self.end_forward(failed=True)
        self.undo_partial_forward()

    def check_dense_reads(self, custom_mask: bool, attention_weights: bool) -> None:
        """Raise before a forward that brings a custom 4-D attention mask or asks for the attention weights when a
        layer cannot give them (both are read over a dense view of the layer, which a partitioned layer does not
        have)."""

    def undo_partial_forward(self) -> None:
        """After a forward that raised: the layers that stored its tokens before the failure drop them again (a crop
        to the shortest layer; a reset if that is empty), so that every layer holds the same positions."""
        lengths = [layer.get_seq_length() for layer in self.layers]
        if len(set(lengths)) == 1 or self.out_of_step is not None:
            return
        try:
            if min(lengths) == 0:
                self.reset()
            else:
                self.crop(min(lengths))
        except Exception as e:
            self.out_of_step = f"a forward failed after some layers stored its tokens (positions {lengths}): {e}"
            raise

    def reset(self) -> None:
        super().reset()
        self.out_of_step = None
        self.rows_started = False


_PIKV_FORWARDS: list[bool] = []  # per forward in progress (nested ones too): does it read a PiKVCache via "pikv"?
_CALL_IMPL = nn.Module._call_impl.__code__


def _drop_interrupted_forwards(running: int) -> None:
    """Drop the entries of ``_PIKV_FORWARDS`` beyond the ``running`` decoder forwards: a forward interrupted by a
    ``KeyboardInterrupt`` (torch runs ``always_call`` hooks on an ``Exception`` only) left its entry behind."""
    if len(_PIKV_FORWARDS) > running:
        del _PIKV_FORWARDS[running:]


def _running_decoders() -> int:
    """Forwards of decoders with these hooks on this thread's stack (``Module._call_impl`` frames); a host-side
    walk of a few frames, skipped in traced code."""
    n, frame = 0, sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CALL_IMPL and hasattr(frame.f_locals.get("self"), HOOKS_ATTR):
            n += 1
        frame = frame.f_back
    return n


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
) -> Any:
    """Mask function registered under ``"pikv"``. Inside a forward that reads a PiKVCache it returns None: the cache
    masks by stored positions and learned the padding from the forward hook. Anywhere else (another cache, no cache,
    ``generate`` preparing a mask ahead of a forward) it returns the previous implementation's mask."""
    if not torch.compiler.is_compiling():
        _drop_interrupted_forwards(_running_decoders())
    if _PIKV_FORWARDS and _PIKV_FORWARDS[-1]:
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS[previous_implementation(config)](
        batch_size=batch_size,
        cache_position=cache_position,
        kv_length=kv_length,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        config=config,
        **kwargs,
    )


def previous_attention(module: nn.Module, name: str) -> Callable:
    """The attention function registered as ``name``, or the model file's own ``eager_attention_forward``."""
    if name == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def wants_attention_weights(module: nn.Module, new_tokens: int) -> bool:
    """Whether the caller expects attention probabilities back: ``output_attentions`` is being collected, or the
    model was on the eager implementation and this is a prefill (kvpress's ObservedAttentionPress reads them from the
    layer's output). A decode step computes none unless they are collected."""
    if not torch.compiler.is_compiling():  # the collector is a ContextVar, which dynamo does not trace
        from transformers.utils.output_capturing import _active_collector

        if "attentions" in (_active_collector.get() or {}):
            return True
    return new_tokens > 1 and previous_implementation(module.config) == "eager"


def pikv_attention(
    module: nn.Module,
    query: torch.Tensor,
    key,
    value,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention function registered under ``"pikv"`` (signature of transformers' attention interface).

    Without a ``PagedKV`` (another cache, or none) the call goes unchanged to the implementation the model had
    before ``attach``. With one, the layer attends from its store; a custom 4-D ``attention_mask`` (which indexes the
    positions of a contiguous cache) is honoured by running the previous implementation over the layer's
    position-ordered view, as long as nothing was evicted.
    """
    fn = previous_attention(module, previous_implementation(module.config))
    extra = {"sliding_window": sliding_window} if sliding_window is not None else {}
    if s_aux is not None:
        extra["s_aux"] = s_aux
    if not isinstance(key, PagedKV):
        return fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **extra, **kwargs)
    layer = key.layer
    if isinstance(attention_mask, torch.Tensor):
        view = layer.view()
        if not view.contiguous:
            raise ValueError(
                f"layer {layer.layer_idx}: a custom 4-D attention_mask indexes the positions of a contiguous cache, "
                "but this PiKVCache has evicted tokens or padding; pass a 2-D padding mask (or none) instead"
            )
        return fn(
            module, query, view.keys, view.values, attention_mask, dropout=dropout, scaling=scaling, **extra, **kwargs
        )
    if dropout and module.training:
        raise ValueError("pikv attention does not implement attention dropout; call model.eval()")
    if kwargs.get("softcap") is not None:
        raise ValueError("pikv attention does not implement logit soft-capping (softcap)")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if sliding_window is None:  # a model that applies its window through the mask alone (Qwen2-MoE, PhiMoE)
        sliding_window = layer.sliding_window
    out = layer.attend(query, scale, sliding_window, s_aux)
    weights = None
    if layer.has_view and wants_attention_weights(module, query.shape[2]):  # partitions have no dense view
        weights = layer.attention_weights(query, scale, sliding_window, s_aux)
    return out, weights


def register() -> None:
    """Register the ``"pikv"`` attention and mask functions with transformers (idempotent). kvpress wraps every
    attention function registered when it is imported (its head-wise presses mask keys through that wrapper); if it
    was imported first, the ``"pikv"`` attention is registered wrapped the same way."""
    patch = sys.modules.get("kvpress.attention_patch")
    fn = pikv_attention if patch is None else patch.attention_patch(pikv_attention)
    AttentionInterface.register(ATTN_IMPLEMENTATION, fn)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, pikv_mask)


def _configs(model: nn.Module) -> list:
    return list({id(c): c for c in (model.config, model.config.get_text_config())}.values())


def _decoder(model: nn.Module) -> nn.Module:
    """The module whose forward takes ``attention_mask`` and ``past_key_values`` and runs the decoder layers."""
    return getattr(model, "base_model", model)


def _padding_of_prepared_mask(mask: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
    """``[B, q]`` bool, False for padding, read off a 4-D mask ``generate`` prepared for a compileable cache: the
    diagonal entry (a new token's own position) is masked only for padding."""
    own = mask[:, 0, torch.arange(cache_position.shape[0], device=mask.device), cache_position.to(mask.device)]
    return own if own.dtype == torch.bool else own == 0


def _forget_head_masks(decoder: nn.Module) -> None:
    """Drop the key masks a head-wise kvpress press left on the attention modules (``masked_key_indices``) before a
    prefill into an empty reserved cache. kvpress's attention patch drops them at a prefill, which it recognises by
    as many keys as queries; a reserved layer reports its frame, so the patch took the prefill for a decode step and
    wrote an earlier run's masks into the new cache (its tokens evicted, or kvpress's fake-key search failed)."""
    for m in decoder.modules():
        if getattr(m, "masked_key_indices", None) is not None:
            m.masked_key_indices = None


def _forward_hooks(decoder: nn.Module) -> tuple:
    names = list(inspect.signature(decoder.forward).parameters)  # read here, not in the hooks (compiled code)

    def argument(name: str, args: tuple, kwargs: dict) -> Any:
        if name in kwargs:
            return kwargs[name]
        at = names.index(name) if name in names else len(args)
        return args[at] if at < len(args) else None

    def before(module: nn.Module, args: tuple, kwargs: dict):
        cache = argument("past_key_values", args, kwargs)
        if not torch.compiler.is_compiling():
            outer = _running_decoders() - 1  # the forwards around this one (which has no entry yet)
            _drop_interrupted_forwards(outer)
            if not outer and isinstance(cache, ForwardAwareCache) and cache.forward_running():
                cache.end_interrupted_forward()
        if not isinstance(cache, ForwardAwareCache):
            _PIKV_FORWARDS.append(False)
            return None
        pikv = getattr(module.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION
        tokens = argument("input_ids", args, kwargs)
        tokens = argument("inputs_embeds", args, kwargs) if tokens is None else tokens
        mask = argument("attention_mask", args, kwargs)
        if isinstance(mask, dict):  # several layer types: generate prepares one mask per type (same padding)
            mask = mask.get("full_attention", next(iter(mask.values()), None))
        replaced = None
        if pikv and isinstance(mask, torch.Tensor) and mask.dim() == 4 and cache.is_compileable:
            # generate prepares a 4-D mask ahead of the forward for compileable caches: the cache masks by stored
            # positions, so only the padding is kept and the forward runs without that mask
            cache_position = argument("cache_position", args, kwargs)
            padded = tokens.shape[1] > 1 or not cache.rows_started
            mask = _padding_of_prepared_mask(mask, cache_position) if padded else None
            if "attention_mask" in kwargs:
                replaced = (args, {**kwargs, "attention_mask": None})
            else:
                at = names.index("attention_mask")
                replaced = ((*args[:at], None, *args[at + 1 :]), kwargs)
        if pikv and cache.is_compileable and not torch.compiler.is_compiling() and cache.get_seq_length() == 0:
            _forget_head_masks(module)
        cache.begin_forward(mask, tokens.shape[1], pikv)
        _PIKV_FORWARDS.append(pikv)
        if cache.out_of_step is not None:  # after the pushes: the forward hook pops them as the forward fails
            raise RuntimeError(f"{type(cache).__name__} is out of step: {cache.out_of_step}; call reset() on it")
        weights = argument("output_attentions", args, kwargs)
        weights = getattr(module.config, "output_attentions", False) if weights is None else weights
        custom = isinstance(mask, torch.Tensor) and mask.dim() == 4
        if pikv and (custom or weights):
            cache.check_dense_reads(custom, bool(weights))  # before any layer stores
        return replaced

    def after(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if _PIKV_FORWARDS:
            _PIKV_FORWARDS.pop()
        cache = argument("past_key_values", args, kwargs)
        if isinstance(cache, ForwardAwareCache):
            cache.end_forward(failed=output is None)
            if output is None:  # the forward raised (torch calls this hook, then re-raises)
                cache.undo_partial_forward()

    return (
        decoder.register_forward_pre_hook(before, with_kwargs=True),
        decoder.register_forward_hook(after, with_kwargs=True, always_call=True),
    )


def attach(model: nn.Module) -> None:
    """Switch ``model`` to the ``"pikv"`` attention implementation, remembering the one it had, and install the
    forward hooks that tell a ``PiKVCache`` about each forward (once per model)."""
    if not isinstance(getattr(model, "config", None), PretrainedConfig):
        raise TypeError(f"model must be a transformers model, got {type(model).__name__}")
    register()
    decoder = _decoder(model)
    if getattr(decoder, HOOKS_ATTR, None) is None:
        setattr(decoder, HOOKS_ATTR, _forward_hooks(decoder))
    current = getattr(model.config, "_attn_implementation", None)
    if current != ATTN_IMPLEMENTATION:
        for config in _configs(model):
            setattr(config, PREVIOUS_ATTR, current or DEFAULT_PREVIOUS)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)


def detach(model: nn.Module) -> None:
    """Give ``model`` back the attention implementation it had before :func:`attach` (no-op if not attached); the
    forward hooks stay (a PiKVCache then hands the model dense tensors, or refuses if it evicted tokens)."""
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        return
    previous = previous_implementation(model.config)
    model.set_attn_implementation(previous)
    for config in _configs(model):
        if hasattr(config, PREVIOUS_ATTR):
            delattr(config, PREVIOUS_ATTR)
