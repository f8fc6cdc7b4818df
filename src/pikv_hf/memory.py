"""What an object holds in tensor memory, measured by walking its attributes (``PiKVCache.held_nbytes``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def reachable_tensors(root: Any) -> dict[int, tuple[str, torch.Tensor]]:
    """Every tensor reachable from ``root`` through ``__dict__``s, containers and dataclasses (not through modules
    or weak references), by ``id``, with the first attribute path that reaches it."""
    seen, out = set(), {}
    stack = [("", root)]
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (torch.nn.Module, type, str, int, float, bool)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            out[id(obj)] = (path, obj)
            continue
        if isinstance(obj, dict):
            stack.extend((f"{path}[{k!r}]", v) for k, v in obj.items())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(obj))
        else:
            stack.extend((f"{path}.{k}", v) for k, v in getattr(obj, "__dict__", {}).items())
    return out


def storage_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``, each storage once (views of one storage count it once)."""
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def held_nbytes(root: Any) -> int:
    """Bytes of every tensor storage reachable from ``root`` (:func:`reachable_tensors`), each storage once."""
    return storage_nbytes(t for _, t in reachable_tensors(root).values())
