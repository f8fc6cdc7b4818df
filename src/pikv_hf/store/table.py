"""The page table of one layer: which pool pages every (batch row, KV head) owns, and each shard's open page.

Every ``(row, head)`` owns one contiguous run of pool pages ``[start, start + cap)``, of which the first
``n_pages`` are in use; its pages are numbered locally ``0 .. n_pages - 1`` (allocation order, shards
interleaved) and a page's global id is ``start + local``. Runs are laid out back to back (``start`` is the
exclusive cumulative sum of ``cap``), so when every run has the same capacity (no ragged budget yet) a field of the
pool *is* a ``[B, H, cap * P, ...]`` tensor and exact attention reads it without a copy. Ragged budgets give
ragged runs: each (row, head) then holds only its own pages, and a read gathers pages through :meth:`pages`.

Tensors (``B`` batch, ``H`` KV heads, ``S`` shards), all int64 on the pool's device:

==========  ==============  ===================================================
start       ``[B, H]``      first pool page of the run
cap         ``[B, H]``      pages reserved by the run
n_pages     ``[B, H]``      pages in use
open_page   ``[B, H, S]``   local index of each shard's open page (-1: none)
open_fill   ``[B, H, S]``   tokens in that page (``P`` when there is none: a new token opens a page)
==========  ==============  ===================================================
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Assignment:
    """Where an append puts each new token (``[B, H, q]``) and what it does to the open pages (``[B, H, S]``)."""

    local_page: torch.Tensor
    offset: torch.Tensor
    need: torch.Tensor  # [B, H] pages in use after the append
    open_page: torch.Tensor
    open_fill: torch.Tensor


def set_state(owner: object, **values: torch.Tensor) -> None:
    """Set ``owner``'s state tensors: rebound in eager code, written in place under compile (a CUDA graph replays over
    the same tensors; a state tensor replaced by a graph output is overwritten by the next replay)."""
    for name, value in values.items():
        if torch.compiler.is_compiling():
            getattr(owner, name).copy_(value)
        else:
            setattr(owner, name, value)


class PageTable:
    """Runs of pool pages per (row, KV head); see the module docstring."""

    def __init__(self, batch: int, heads: int, num_shards: int, page_size: int, device: torch.device) -> None:
        self.page_size, self.num_shards, self.device = int(page_size), int(num_shards), device
        z = torch.zeros(batch, heads, dtype=torch.int64, device=device)
        self.start, self.cap, self.n_pages = z, z.clone(), z.clone()
        self.open_page = torch.full((batch, heads, self.num_shards), -1, dtype=torch.int64, device=device)
        self.open_fill = torch.full_like(self.open_page, self.page_size)
        self.uniform = True  # every run has the same capacity: fields are [B, H, cap * P, ...] views
        self._width = 0  # the largest capacity (a Python int, so reading the frame width needs no device sync)

    @property
    def batch(self) -> int:
        return self.start.shape[0]

    @property
    def heads(self) -> int:
        return self.start.shape[1]

    def set_caps(self, cap: torch.Tensor) -> int:
        """Lay runs of capacity ``cap`` (``[B, H]``) back to back; returns the pool size in pages."""
        self.cap = cap
        flat = cap.reshape(-1)
        self.start = (flat.cumsum(0) - flat).view_as(cap)
        self.uniform = bool((flat == flat[:1]).all()) if flat.numel() else True
        self._width = int(flat.max()) if flat.numel() else 0
        return int(flat.sum())

    def width(self) -> int:
        """Pages per (row, head) in the frame of :meth:`pages`: the largest run capacity (a Python int kept by
        :meth:`set_caps`, so no device sync; pages past a run's capacity read as ``-1``)."""
        return self._width

    def pages(self, local: torch.Tensor | None = None) -> torch.Tensor:
        """Global pool page ids (``-1`` where none) of local pages ``local`` (``[B, H, n]``, ``-1`` padded), by
        default of the frame ``0 .. width() - 1`` of every run (reserved but unused pages included)."""
        if local is None:
            local = torch.arange(self.width(), device=self.device).expand(self.batch, self.heads, -1)
            ok = local < self.cap.unsqueeze(-1)  # the frame runs past shorter runs' capacity
        else:
            ok = local >= 0  # a plan names pages in use
        return torch.where(ok, self.start.unsqueeze(-1) + local, -1)

    def assign(self, shard: torch.Tensor, present: torch.Tensor | None = None) -> Assignment:
        """Pages and offsets of new tokens of shards ``shard`` (``[B, H, q]`` int64), appended in order to their
        shard's open page, then to new pages; nothing is changed until :meth:`commit`.

        ``present`` (``[B, H, q]`` bool, optional): tokens with False take no slot (their ``local_page`` /
        ``offset`` are meaningless); a partition of a distributed layer stores only its own shards' tokens.
        """
        b, h, q = shard.shape
        p, s = self.page_size, self.num_shards
        # rank of each token among the new tokens of its shard, by a stable sort (no [B, H, q, S] one-hot); absent
        # tokens sort into an extra shard S that no page belongs to
        key = shard if present is None else torch.where(present, shard, s)
        order = key.argsort(dim=-1, stable=True)
        counts = torch.zeros(b, h, s + 1, dtype=torch.int64, device=shard.device).scatter_add_(
            2, key, torch.ones_like(key)
        )
        first = counts.cumsum(-1) - counts
        sorted_key = key.gather(2, order)
        sorted_rank = torch.arange(q, device=shard.device) - first.gather(2, sorted_key)
        rank = torch.empty_like(shard).scatter_(2, order, sorted_rank)
        count = counts[..., :s]

        base = self.open_fill  # fill of each shard's open page (P: none)
        n_new = (base + count - p).clamp(min=0).add(p - 1).div(p, rounding_mode="floor")  # new pages per shard
        first_new = self.n_pages.unsqueeze(-1) + n_new.cumsum(-1) - n_new
        t = base.gather(-1, shard) + rank  # offset from the start of the shard's open page
        in_open = t < p
        local_page = torch.where(in_open, self.open_page.gather(-1, shard), first_new.gather(-1, shard) + (t - p) // p)
        offset = torch.where(in_open, t, (t - p) % p)
        return Assignment(
            local_page=local_page,
            offset=offset,
            need=self.n_pages + n_new.sum(-1),
            open_page=torch.where(n_new > 0, first_new + n_new - 1, self.open_page),
            open_fill=torch.where(n_new > 0, base + count - p * n_new, base + count),
        )

    def commit(self, a: Assignment) -> None:
        set_state(self, n_pages=a.need, open_page=a.open_page, open_fill=a.open_fill)

    def index_batch(self, index: torch.Tensor) -> None:
        """Rows along ``index``; ``start`` / ``cap`` are left for the caller's relayout."""
        self.n_pages = self.n_pages.index_select(0, index)
        self.open_page = self.open_page.index_select(0, index)
        self.open_fill = self.open_fill.index_select(0, index)
