"""The page pool of one layer on one device: every stored field as ``[N, P, ...]`` pages (slot fields) or
``[N, ...]`` (page fields), with no knowledge of which row or head owns a page (``table.py`` knows that).

A field is declared by a ``FieldSpec``: its per-slot (or per-page) shape, dtype and the value of an empty slot.
The codec declares the key/value fields (identity: ``keys`` ``[P, Dk]`` and ``values`` ``[P, Dv]`` in the model
dtype); the store adds the per-slot metadata (``pos``, ``valid``, statistics) and per-page ``shard`` (and Quest's
``key_min`` / ``key_max`` once asked for).

Pages move only in two bulk operations, each one gather of the live data into freshly allocated tensors:
``remap_pages`` (whole pages: growth, batch reordering) and ``remap_slots`` (single slots: eviction, crop). The new
tensors are sized to what the caller asks for, so freed pages are really released.
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
from dataclasses import dataclass

import torch

STORAGES = (None, "pinned", "disk")


@dataclass(frozen=True)
class FieldSpec:
    """One stored field: ``shape`` per slot (slot field) or per page (``per_page=True``), dtype, empty value."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: float | int | bool = 0
    per_page: bool = False


class PagePool:
    """Field tensors of ``num_pages`` pages of ``page_size`` slots on one device.

    Parameters
    ----------
    specs : dict of str to FieldSpec
        The fields to hold.
    page_size : int
        Slots per page ``P``.
    device : torch.device
        Where every field lives.
    storage : str or None
        CPU pools only: ``"pinned"`` (page-locked memory, for fast copies to a GPU) or ``"disk"``, where every field is
        a memory-mapped file in the temporary directory (``tempfile.gettempdir()``), created, mapped and unlinked at
        once: nothing is ever left in the file system, and the blocks are freed with the tensor. Default: ordinary
        memory.
    """

    def __init__(
        self, specs: dict[str, FieldSpec], page_size: int, device: torch.device, storage: str | None = None
    ) -> None:
        self.specs = dict(specs)
        self.page_size = int(page_size)
        self.device = device
        if storage not in STORAGES:
            raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
        self.storage = storage
        self.fields: dict[str, torch.Tensor] = {name: self._empty(name, 0) for name in self.specs}

    def __deepcopy__(self, memo: dict) -> PagePool:
        """A copy in the same kind of storage: a disk pool's fields are mapped files again, a pinned pool's pinned
        (the default deepcopy cloned them into ordinary memory, while the copy still reported its storage). Views of
        a field copied along (torch memoises storages) land on the new field."""
        new = copy.copy(self)
        memo[id(self)] = new
        new.specs = dict(self.specs)
        storages = memo.setdefault("torch", {})
        new.fields = {}
        for name, t in self.fields.items():
            key = t.untyped_storage()._cdata
            whole = t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes
            if key in storages or not whole:  # copied already through a view (keep the sharing), or part of one
                new.fields[name] = copy.deepcopy(t, memo)
                continue
            field = new._empty(name, t.shape[0]).copy_(t)
            storages[key], memo[id(t)] = field.untyped_storage(), field
            new.fields[name] = field
        return new

    @property
    def num_pages(self) -> int:
        return next(iter(self.fields.values())).shape[0]

    def _empty(self, name: str, pages: int) -> torch.Tensor:
        spec = self.specs[name]
        shape = (pages, *spec.shape) if spec.per_page else (pages, self.page_size, *spec.shape)
        if self.storage is None or not math.prod(shape):
            return torch.full(shape, spec.fill, dtype=spec.dtype, device=self.device)
        if self.storage == "pinned":
            return torch.full(shape, spec.fill, dtype=spec.dtype).pin_memory()
        numel = math.prod(shape)
        handle, path = tempfile.mkstemp(prefix=f"pikv-{name}-", suffix=".bin")
        try:
            os.ftruncate(handle, numel * torch.empty((), dtype=spec.dtype).element_size())
            mapped = torch.from_file(path, shared=True, size=numel, dtype=spec.dtype)
        finally:
            os.close(handle)
            os.unlink(path)  # the mapping keeps the file's blocks until the tensor is freed
        return mapped.view(shape).fill_(spec.fill)

    def add_field(self, name: str, spec: FieldSpec) -> torch.Tensor:
        """Declare one more field (empty on every existing page) and return its tensor."""
        self.specs[name] = spec
        self.fields[name] = self._empty(name, self.num_pages)
        return self.fields[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.fields[name]

    def flat(self, name: str) -> torch.Tensor:
        """A slot field as ``[N * P, ...]`` (a view)."""
        t = self.fields[name]
        return t.view(-1, *t.shape[2:])

    # ------------------------------------------------------------------ bulk moves
    def _take(self, name: str, rows: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """A new tensor whose row ``i`` is ``rows[src[i]]`` (one gather, no zero-fill), empty where ``src[i] < 0``."""
        fill = self.specs[name].fill
        if rows.shape[0] == 0:
            return torch.full((src.numel(), *rows.shape[1:]), fill, dtype=rows.dtype, device=rows.device)
        new = rows.index_select(0, src.clamp(min=0))
        empty = (src < 0).nonzero().squeeze(-1)
        if empty.numel():
            new.index_fill_(0, empty, fill)
        return new

    def _into_storage(self, name: str, new: torch.Tensor) -> torch.Tensor:
        """``new`` placed in this pool's storage (a copy there unless it is ordinary memory)."""
        if self.storage is None:
            return new
        out = self._empty(name, new.shape[0])
        out.view(-1, *out.shape[1:]).copy_(new.view(-1, *new.shape[1:]))
        return out

    def remap_pages(self, src: torch.Tensor) -> None:
        """Reallocate to ``len(src)`` pages; new page ``i`` is old page ``src[i]`` in every field (empty if ``-1``)."""
        for name, old in self.fields.items():
            self.fields[name] = self._into_storage(name, self._take(name, old, src))

    def remap_slots(self, src: torch.Tensor, page_values: dict[str, torch.Tensor]) -> None:
        """Reallocate to ``len(src) // P`` pages; new slot ``i`` is old flat slot ``src[i]`` in every slot field (empty
        if ``-1``). Page fields take ``page_values[name]`` (``[pages, ...]``) where given, else start empty."""
        pages = src.numel() // self.page_size
        for name, spec in self.specs.items():
            if spec.per_page:
                self.fields[name] = page_values[name] if name in page_values else self._empty(name, pages)
            else:
                new = self._take(name, self.flat(name), src)
                self.fields[name] = self._into_storage(name, new.view(pages, self.page_size, *spec.shape))

    # ------------------------------------------------------------------ reads and writes
    def write(self, name: str, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` (``[M, ...]``) at flat slot ids ``slots`` (``[M]``) of a slot field."""
        flat = self.flat(name)
        flat.index_copy_(0, slots, values.to(flat.dtype))

    def gather(self, name: str, pages: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Pages ``pages`` (int64 ``[M]``, all valid ids) of a field as ``[M, P, ...]`` (or ``[M, ...]``)."""
        t = self.fields[name]
        if out is None:
            return t.index_select(0, pages)
        return torch.index_select(t, 0, pages, out=out.view(pages.numel(), *t.shape[1:]))

    def nbytes(self, names: tuple[str, ...] | None = None) -> int:
        """Bytes allocated for the named fields (all by default)."""
        names = tuple(self.fields) if names is None else names
        return sum(self.fields[n].numel() * self.fields[n].element_size() for n in names)
