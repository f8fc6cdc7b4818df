"""Per-page key bounds of a :class:`~pikv_hf.store.pool.PagePool`: Quest's ``key_min`` / ``key_max`` (``[N, Dk]``,
one row per page), added once, folded as tokens arrive, rebuilt after a re-pack.

Their dtype is the keys' own where the pool holds the keys as the model produced them (the min and max of bfloat16
keys are bfloat16 values: exact, half the bytes of float32 and half of what Quest's score kernel reads), float32 over
decoded keys of a lossy codec (a rounded bound could fall inside the keys it bounds)."""

from __future__ import annotations

import torch

from pikv_hf.kernels import _triton
from pikv_hf.store.pool import FieldSpec, PagePool

BOUND_FIELDS = {"key_min": float("inf"), "key_max": float("-inf")}


def add_page_bounds(pool: PagePool, keys: torch.Tensor, dtype: torch.dtype) -> None:
    """Add the two bound fields (``dtype``) to ``pool`` and compute them from its decoded ``keys`` (``[N, P, Dk]``)."""
    for name, fill in BOUND_FIELDS.items():
        pool.add_field(name, FieldSpec((keys.shape[-1],), dtype, fill, per_page=True))
    rebuild_page_bounds(pool, keys)


def rebuild_page_bounds(pool: PagePool, keys: torch.Tensor, pages: torch.Tensor | None = None) -> None:
    """Recompute the bounds of every page (or of the distinct ``pages``, ``[M]``) from the decoded ``keys``
    (``[N, P, Dk]``, or ``[M, P, Dk]`` of those pages) of its valid slots."""
    valid = pool["valid"] if pages is None else pool["valid"].index_select(0, pages)
    assert keys.dim() == 3 and keys.shape[0] == valid.shape[0], "keys must be [N, P, Dk] over the pages"
    k, empty = keys.float(), ~valid.unsqueeze(-1)
    for name, fill in BOUND_FIELDS.items():
        bound = k.masked_fill(empty, fill)
        bound = bound.amin(1) if name == "key_min" else bound.amax(1)
        if pages is None:
            pool[name].copy_(bound)
        else:
            pool[name].index_copy_(0, pages, bound.to(pool[name].dtype))


def fold_page_bounds(pool: PagePool, page: torch.Tensor, keys: torch.Tensor) -> None:
    """Widen the bounds of pages ``page`` (``[M]`` int64) by the new ``keys`` (``[M, Dk]``) stored in them."""
    fold = _fold_op if torch.compiler.is_compiling() and _triton.traced_as_operator(keys) else _fold
    fold(pool["key_min"], pool["key_max"], page, keys)


def _fold(key_min: torch.Tensor, key_max: torch.Tensor, page: torch.Tensor, keys: torch.Tensor) -> None:
    k = keys.to(key_min.dtype)
    idx = page.unsqueeze(-1).expand_as(k)
    key_min.scatter_reduce_(0, idx, k, "amin")
    key_max.scatter_reduce_(0, idx, k, "amax")


# A compiled append of several tokens on CUDA folds through this operator, opaque to inductor
# (``_triton.traced_as_operator``): traced, the two scatters into the bound fields (graph inputs) were compiled into
# copies of both whole fields per layer and step (an H100 profile of a compiled Quest step: four field-sized kernels
# per layer); the operator runs them in place. On the CPU inductor's own code writes in place. A decode token's bounds
# are folded by the append operator itself (``pikv_hf.kernels.append``).
_fold_op = torch.library.custom_op("pikv::fold_page_bounds", _fold, mutates_args=("key_min", "key_max"))
_fold_op.register_fake(lambda key_min, key_max, page, keys: None)
