"""Argument checks shared by the cache, the placements and the evaluation config (one message format), and the name
of the kvpress press whose hook is running, for error messages."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import torch


def check_int_at_least(name: str, value: object, low: int, high: int | None = None) -> None:
    """Raise ``ValueError("<name> must be an integer >= <low>, got <value>")`` unless ``value`` is such an int (with
    ``high``: ``"... an integer in [<low>, <high>] ..."`` unless it is at most that too)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")


def check_seed(value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is a seed ``torch.manual_seed`` takes: an integer in ``[0, 2**63)``."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
        raise ValueError(f"seed must be an integer in [0, 2**63), got {value!r}")


def is_number(value: object) -> bool:
    """Whether ``value`` is a Python int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_ratio(name: str, value: object) -> None:
    """Raise ``ValueError("<name> must be a number in [0, 1), got <value>")`` unless ``value`` is such a number."""
    if not is_number(value) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")


class CommandLineError(ValueError):
    """Bad input to a ``pikv-hf`` command, found before any work: printed as one ``pikv-hf CMD: error:`` line."""


def calling_press(innermost: bool = False) -> str:
    """The class name of the outermost (or ``innermost``) kvpress press whose hook is running (for error messages),
    or ``"code"``. Only frames of methods of kvpress and pikv_hf are read: reading a frame's ``f_locals`` on Python
    3.11 leaves a snapshot of its locals on it, which kept the caller's objects (a deleted cache) alive while the
    caller's function ran."""
    import kvpress  # only when an error is being raised
    from kvpress import BasePress

    libraries = tuple(str(Path(m.__file__).parent) for m in (kvpress, sys.modules["pikv_hf"]))
    name = "code"
    frame = inspect.currentframe()
    while frame is not None:
        code = frame.f_code
        method = code.co_argcount and code.co_varnames[0] == "self" and code.co_filename.startswith(libraries)
        owner = frame.f_locals.get("self") if method else None
        if isinstance(owner, BasePress):
            name = type(owner).__name__
            if innermost:
                break
        frame = frame.f_back
    return name


def check_tensor(
    name: str,
    value: object,
    dims: int | None = None,
    dtype: object = None,
    device: object = None,
) -> None:
    """Raise ``TypeError`` unless ``value`` is a tensor, ``ValueError`` unless it has ``dims`` dimensions, ``dtype``
    and lies on ``device`` (each checked when given), naming ``name`` and the expected value."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dims is not None and value.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(value.shape)}")
    if dtype is not None and value.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {value.dtype}")
    if device is not None and value.device != device:
        raise ValueError(f"{name} must be on {device}, got {value.device}")


def check_rows(name: str, index: object, batch: int, device: object) -> None:
    """``IndexError`` unless ``index`` (a tensor of row indices, or a row mask) selects at least one row, each in
    range for a batch of ``batch`` rows (``[0, batch)``: the rows are gathered with ``index_select``); ``ValueError``
    unless it lies on the CPU or on ``device``; ``TypeError`` for a float or multi-dimensional index."""
    import torch

    check_tensor(name, index)
    if index.device.type not in ("cpu", torch.device(device).type):
        raise ValueError(f"{name} must be on the CPU or the cache's device ({device}), got {index.device}")
    if index.dtype == torch.bool:
        if index.dim() != 1 or index.numel() != batch:
            raise IndexError(f"{name} as a mask must be 1-D bool of length {batch}, got {tuple(index.shape)}")
        if not bool(index.any()):
            raise IndexError(f"{name} must select at least one batch row, got a mask of no row")
        return
    if index.is_floating_point() or index.dim() != 1:
        raise TypeError(f"{name} must be a 1-D integer tensor of batch rows, got {index.dtype} {tuple(index.shape)}")
    if not index.numel() or not bool(((index >= 0) & (index < batch)).all()):
        raise IndexError(f"{name} must index at least one batch row, each in [0, {batch}), got {index.tolist()}")


def _matches(value: object, hint: object) -> bool:
    """Whether ``value`` fits the type hint ``hint`` (unions, ``None``, containers by their origin; a ``float``
    takes an ``int``; ``bool`` is not a number)."""
    import types
    import typing

    if hint is typing.Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if hint is type(None) or hint is None:
        return value is None
    hint = origin or hint
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint) if isinstance(hint, type) else True


def check_field_types(obj: object) -> None:
    """Raise ``TypeError`` naming the field when a dataclass field of ``obj`` holds a value of another type than it
    declares (e.g. ``QuestPress(compression_ratio="0.5")``)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if not f.init or f.name not in hints:
            continue
        value = getattr(obj, f.name)
        if not _matches(value, hints[f.name]):
            expected = getattr(hints[f.name], "__name__", None) or str(hints[f.name]).replace("typing.", "")
            raise TypeError(f"{type(obj).__name__}.{f.name} must be {expected}, got {type(value).__name__} {value!r}")


def check_kv_update(layer_idx: int, key_states: object, value_states: object, present, store) -> torch.dtype:
    """Check what ``PiKVLayer.update`` receives (``[B, H_kv, q, D]`` floating-point tensors; the forward's padding
    mask ``present`` ``[B, q]``; the batch, heads, dims, dtype and device of the layer's ``store`` once there is one),
    raising ``TypeError`` / ``ValueError`` naming the argument before the layer changes. Returns the dtype the layer
    stores both in: the wider of the two (autocast leaves keys float32 beside bfloat16 values)."""
    for name, states in (("key_states", key_states), ("value_states", value_states)):
        check_tensor(name, states)
        if states.dim() != 4:
            raise ValueError(f"{name} must be [B, H_kv, q, D], got shape {tuple(states.shape)}")
    if key_states.shape[:3] != value_states.shape[:3]:
        raise ValueError(
            f"key_states and value_states must agree on [B, H_kv, q]; got {tuple(key_states.shape[:3])} and "
            f"{tuple(value_states.shape[:3])}"
        )
    if key_states.shape[2] < 1:
        raise ValueError("key_states must hold at least one new token (q >= 1)")
    if min(*key_states.shape[:2], key_states.shape[3], value_states.shape[3]) < 1:
        raise ValueError(
            f"key_states / value_states must have B, H_kv and D >= 1, got {tuple(key_states.shape)} and "
            f"{tuple(value_states.shape)}"
        )
    if not (key_states.is_floating_point() and value_states.is_floating_point()):
        raise ValueError(
            f"key_states / value_states must be floating point, got {key_states.dtype} and {value_states.dtype}"
        )
    if key_states.device.type == "meta" or value_states.device != key_states.device:
        raise ValueError(
            f"key_states / value_states must lie on one real device, got {key_states.device} and "
            f"{value_states.device}"
        )
    dtype = key_states.dtype  # promote_types only where they differ: it is an operator, on every decode step
    if value_states.dtype != dtype:
        dtype = torch.promote_types(dtype, value_states.dtype)
    if present is not None and tuple(present.shape) != (key_states.shape[0], key_states.shape[2]):
        raise ValueError(
            f"layer {layer_idx}: the forward's padding mask covers {tuple(present.shape)} new tokens, "
            f"key_states hold [B, q] = {(key_states.shape[0], key_states.shape[2])}"
        )
    if store is None:
        return dtype
    expected = {
        "batch size": (key_states.shape[0], store.batch),
        "number of KV heads": (key_states.shape[1], store.heads),
        "key head dim": (key_states.shape[3], store.k_dim),
        "value head dim": (value_states.shape[3], store.v_dim),
    }
    for what, (got, want) in expected.items():
        if got != want:
            raise ValueError(f"layer {layer_idx}: {what} of key/value_states is {got}, cache holds {want}")
    if dtype != store.dtype:
        raise ValueError(
            f"layer {layer_idx}: key/value_states dtype changed mid-sequence: got {dtype}, cache holds {store.dtype}"
        )
    if key_states.device != store.device:
        raise ValueError(f"layer {layer_idx}: key/value_states on {key_states.device}, cache on {store.device}")
    return dtype
