"""``torch.export`` support: a ``PiKVCache`` is a pytree whose leaves are its tensors.

Every layer contributes the pool fields, page table and shard statistics of each of its stores (the hot one and the
tiers a press made: compressed, offloaded), its token counter and eviction counts as leaves;
the structure (which leaf is which, and a template cache holding everything else: placement routers, read policy,
layer settings) is the pytree context. Two caches with the same structure flatten to equal contexts, so a program
exported with one cache runs with another of the same configuration. Export the decode step of a compileable cache
(``PiKVCache(..., max_cache_len=N)``) after its prefill; see ``tests/test_hf_integration.py``.
"""

from __future__ import annotations

import copy

import torch
import torch.utils._pytree as pytree

from pikv_hf.cache import PiKVCache
from pikv_hf.store import PagedStore
from pikv_hf.store.tiers import LayerStores
from pikv_hf.view import LayerViews

_TABLE = ("start", "cap", "n_pages", "open_page", "open_fill")
_STATS = ("sum", "sq", "count", "min", "max")


class _Structure:
    """The non-tensor part of a flattened cache; equal when the leaf layout and the layer settings agree."""

    def __init__(self, cache: PiKVCache, names: tuple[str, ...]) -> None:
        self.template, self.names = cache, names
        self.signature = (
            names,
            cache.router,
            cache.num_shards,
            cache.page_size,
            cache.read,
            tuple(
                (la.max_cache_len, la.is_sliding, la.sliding_window, la.shard_groups, la.track_stats)
                for la in cache.layers
            ),
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Structure) and self.signature == other.signature

    def __hash__(self) -> int:
        return hash(self.signature[:4])


def _leaves(cache: PiKVCache) -> dict[str, torch.Tensor]:
    """Every layer's tensors by name: ``{layer}.{store}.{part}.{field}`` for each of its stores (the hot one and its
    tiers: a compressed or offload tier a press made), then its eviction counts and token counter."""
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(cache.layers):
        if layer.store is None:
            raise ValueError(f"layer {i} of the PiKVCache holds no tokens yet: export the decode step after a prefill")
        for name, st in layer.stores.named():
            out.update({f"{i}.{name}.pool.{n}": t for n, t in st.pool.fields.items()})
            out.update({f"{i}.{name}.table.{n}": getattr(st.table, n) for n in _TABLE})
            stats = {n: getattr(st.stats, n) for n in _STATS}
            out.update({f"{i}.{name}.stats.{n}": t for n, t in stats.items() if t is not None})
        out[f"{i}.evicted"] = layer.evicted
        if layer._seen_t is not None:
            out[f"{i}.seen"] = layer._seen_t
    return out


def _flatten(cache: PiKVCache) -> tuple[list[torch.Tensor], _Structure]:
    leaves = _leaves(cache)
    return list(leaves.values()), _Structure(cache, tuple(leaves))


def _flatten_with_keys(cache: PiKVCache) -> tuple[list, _Structure]:
    values, structure = _flatten(cache)
    return [(pytree.MappingKey(k), v) for k, v in zip(structure.names, values, strict=True)], structure


def _copy_store(st: PagedStore) -> PagedStore:
    """A shallow copy of ``st`` whose pool fields, table and statistics can take other tensors."""
    st = copy.copy(st)
    st.pool = copy.copy(st.pool)
    st.pool.fields = dict(st.pool.fields)
    st.table, st.stats = copy.copy(st.table), copy.copy(st.stats)
    return st


def _unflatten(values, structure: _Structure) -> PiKVCache:
    """A shallow copy of the template whose tensors are ``values`` (the template itself is not changed)."""
    cache = copy.copy(structure.template)
    cache.layers = []
    for layer in structure.template.layers:
        tiers = {name: _copy_store(st) for name, st in layer.stores.tiers.items()}
        layer = copy.copy(layer)
        layer.store = _copy_store(layer.store)
        layer.store.summed_with = [tiers[n] for n, st in layer.stores.tiers.items() if st in layer.store.summed_with]
        layer.stores = LayerStores(layer.store)
        layer.stores.tiers = tiers
        layer.views = LayerViews(layer)
        cache.layers.append(layer)
    for name, value in zip(structure.names, values, strict=True):
        index, *path = name.split(".")
        layer = cache.layers[int(index)]
        if path == ["seen"]:
            layer._seen_t = value
        elif path == ["evicted"]:
            layer.evicted = value
        else:
            store_name, part, field = path
            st = layer.store if store_name == "hot" else layer.stores.tiers[store_name]
            if part == "pool":
                st.pool.fields[field] = value
            else:
                setattr(getattr(st, part), field, value)
    return cache


def register() -> None:
    """Register ``PiKVCache`` as a pytree node (idempotent)."""
    if PiKVCache in pytree.SUPPORTED_NODES:
        return
    pytree.register_pytree_node(
        PiKVCache,
        _flatten,
        _unflatten,
        serialized_type_name=f"{PiKVCache.__module__}.{PiKVCache.__name__}",
        flatten_with_keys_fn=_flatten_with_keys,
    )
