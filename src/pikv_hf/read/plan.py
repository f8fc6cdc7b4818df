"""``ReadPlan``: what one attention call reads from a layer's store, per batch row and KV head.

A plan is produced by a read policy (``exact``, ``routed``, ``quest``) and consumed by an attention backend. It
names pages by their local index in each (row, head)'s page-table run; the backend maps them to pool pages. A sparse
plan has a width fixed by the store's frame and the policy's budget (not by the data): entries past a (row, head)'s
own budget are ``-1``, so the shapes of a decode step do not depend on what it selects.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass
class ReadPlan:
    """Pages to read and which of their tokens may be attended.

    Attributes
    ----------
    pages : torch.Tensor or None
        ``[B, H, n]`` int64 local page indices (``-1``: padding); None reads the whole frame (exact attention).
    page_full : torch.Tensor or None
        ``[B, H, n]`` bool. True: every valid token of the page may be attended (a selected shard's page, a Quest
        page). False: only its sink tokens (``pos - row_start < n_sink``) and recent ones (``qpos - pos < window``).
        None: every page is full.
    n_sink, window : int
        The sink count and recent window of partial pages.
    row_start : torch.Tensor or None
        ``[B]`` int64 position of each row's first real token (left padding), the frame in which sinks count.
    lengths : torch.Tensor or None
        ``[B, H]`` integer: entries in use in each row, its pages first (the entries past them are padding), where the
        operator that planned them counted them: the fused kernel's splits divide those (None: counted from
        ``pages`` where needed), and the CPU path trims a plan to its longest row (routed plans and Quest's over a
        store group are as wide as the frame and read a fraction of it).
    """

    pages: torch.Tensor | None = None
    page_full: torch.Tensor | None = None
    n_sink: int = 0
    window: int = 0
    row_start: torch.Tensor | None = None
    lengths: torch.Tensor | None = None

    @property
    def exact(self) -> bool:
        return self.pages is None


def sink_or_recent(
    pos: torch.Tensor, qpos_last: torch.Tensor, n_sink: int, window: int, row_start: torch.Tensor
) -> torch.Tensor:
    """``[B, H, C]`` bool: slots at positions ``pos`` (``[B, H, C]``) that are one of their row's first ``n_sink`` real
    tokens or among the last ``window`` positions up to ``qpos_last`` (a 0-d or one-element tensor: no host read)."""
    pos = pos.to(torch.int64)
    rel_start = pos - row_start.view(-1, 1, 1)
    return ((rel_start >= 0) & (rel_start < n_sink)) | (pos > qpos_last.reshape(()) - window)


def compact(need: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, H, width]`` indices of the True entries of ``need`` (``[B, H, W]``) in order, ``-1`` padded; entries
    past ``width`` are dropped. Linear time (a prefix sum and a scatter), shapes independent of the data."""
    at = prefix_sum(need).mul_(need)  # 1 + the rank of a needed entry; 0 for the others, which land in column 0
    if width < need.shape[-1]:
        at.masked_fill_(at > width, 0)
    out = torch.full((*need.shape[:-1], width + 1), -1, dtype=torch.int64, device=need.device)
    return out.scatter_(-1, at, arange(need.shape[-1], need.device).expand_as(at))[..., 1:]


_SCAN_CHUNK = 256


def prefix_sum(x: torch.Tensor) -> torch.Tensor:
    """Inclusive int64 prefix sum of ``x`` (``[..., W]``, bool or integer) along the last dimension.

    Eager: one ``cumsum``. Compiled: two short scans (within chunks of 256, then over the chunk totals), since
    inductor's CUDA code for one long scan (W of 33,041 at 32k tokens in pages of 1) fails in torch 2.11 (an error
    in the codegen of a split scan)."""
    w = x.shape[-1]
    if not torch.compiler.is_compiling() or w <= _SCAN_CHUNK:
        return x.cumsum(-1)
    n = -(-w // _SCAN_CHUNK)
    chunks = torch.nn.functional.pad(x.to(torch.int64), (0, n * _SCAN_CHUNK - w)).unflatten(-1, (n, _SCAN_CHUNK))
    inner = chunks.cumsum(-1)
    before = inner[..., -1].cumsum(-1) - inner[..., -1]  # the chunks ahead of each
    return (inner + before.unsqueeze(-1)).flatten(-2)[..., :w]


def arange(n: int, device: torch.device) -> torch.Tensor:
    """``torch.arange(n)`` on ``device``, made once per (n, device) outside compiled code (a decode step asks for
    the same ones every layer)."""
    if torch.compiler.is_compiling():
        return torch.arange(n, device=device)
    return _arange(n, device)


@functools.lru_cache(maxsize=16)
def _arange(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device)
