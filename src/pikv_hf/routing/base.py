"""The router interface shared by every PiKV router.

A router has up to two jobs:

* **placement** (``Placement.place``): which shard each new token's KV goes to, called by a cache layer on every
  ``update``. One instance serves one layer, so per-layer state (e.g. online centroids) lives in the instance.
* **selection** (``Selector.select``): which ``k`` shards a decode-time query attends to, from a ``ShardSummary``
  of the layer's shards. Selection is per batch row and per KV head.

Shapes use ``B`` batch, ``H`` KV heads, ``q`` new tokens, ``S`` shards, ``D`` key head dim.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class PlacementContext:
    """What a placement router may read about the tokens being stored.

    Attributes
    ----------
    layer_idx : int
        Index of the decoder layer whose cache is being updated.
    keys : torch.Tensor
        ``[B, H, q, D]`` post-RoPE keys of the new tokens.
    token_index : torch.Tensor
        ``[q]`` int64 ordinal of each new token in the layer's sequence (tokens seen before it, pads included).
    page_size : int
        Tokens per page of the store.
    num_shards : int
        Number of shards ``S``; every returned id must lie in ``[0, S)``.
    present : torch.Tensor, optional
        ``[B, q]`` bool, False for left padding (stored nowhere: its shard does not matter and it must not shape
        the placement of real tokens); None: every token is real.
    row_start : torch.Tensor, optional
        ``[B]`` int64 position of each row's first real token; ``token_index - row_start`` numbers a row's tokens
        as if it were alone.
    """

    layer_idx: int
    keys: torch.Tensor
    token_index: torch.Tensor
    page_size: int
    num_shards: int
    present: torch.Tensor | None = None
    row_start: torch.Tensor | None = None

    def row_index(self) -> torch.Tensor:
        """``[B, q]`` (or ``[1, q]`` without left padding) ordinal of every new token within its own row."""
        index = self.token_index.view(1, -1)
        return index if self.row_start is None else index - self.row_start.view(-1, 1)


class Placement:
    """Base class of placement routers (one instance per cache layer).

    ``placed_by_append``: a decode token's shard is the page-granular round robin, which the store's one-token append
    computes itself (``PagedStore.append_one`` with no shard): :meth:`place` is not called for it.
    """

    name: str = ""
    placed_by_append = False

    def __init__(self, num_shards: int) -> None:
        if int(num_shards) < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        self.num_shards = int(num_shards)

    def place(self, ctx: PlacementContext) -> torch.Tensor:
        """Return ``[B, H, q]`` int64 shard ids in ``[0, S)`` for the new tokens."""
        raise NotImplementedError

    def index_batch(self, index: torch.Tensor) -> None:
        """Keep/reorder per-batch-row state along ``index`` (beam search, batch selection). Stateless: no-op."""

    def reset(self) -> None:
        """Forget all per-sequence state (the cache was cleared)."""


@dataclass
class ShardSummary:
    """What a selector may read about one layer's shards, per batch row and KV head.

    Attributes
    ----------
    centroids : torch.Tensor
        ``[B, H, S, D]`` float32 mean key of the valid tokens of each shard (zeros for an empty shard).
    counts : torch.Tensor
        ``[B, H, S]`` int64 valid tokens per shard.
    key_min, key_max : torch.Tensor
        ``[B, H, S, D]`` float32 element-wise min / max of the shard's keys (Quest-style bounds; +inf / -inf when
        empty).
    resident : torch.Tensor
        ``[B, H, S]`` bool, False for a shard whose pages are not on the attention device (offloaded).
    misses : torch.Tensor
        ``[B, H, S]`` int64 misses counted by the cache: a selected shard that was not resident, or whose pages
        had been evicted.
    key_var : torch.Tensor, optional
        ``[B, H, S, D]`` float32 per-dimension variance of the shard's keys (zeros for an empty shard).

    Notes
    -----
    :meth:`query_dots` remembers ``q . centroids`` for the query it was last asked about, so a selector and the mass
    estimate of one decode step share one product.
    """

    centroids: torch.Tensor
    counts: torch.Tensor
    key_min: torch.Tensor
    key_max: torch.Tensor
    resident: torch.Tensor
    misses: torch.Tensor
    key_var: torch.Tensor | None = None

    @property
    def num_shards(self) -> int:
        return self.counts.shape[-1]

    def rows(self, index: torch.Tensor) -> ShardSummary:
        """The summary of the batch rows ``index`` (``[B']`` int64)."""
        picked = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return ShardSummary(**{n: t if t is None else t.index_select(0, index.to(t.device)) for n, t in picked.items()})

    def query_dots(self, query: torch.Tensor) -> torch.Tensor:
        """``[B, H, G, S]`` float32 ``q_g . c_s`` of the query rows ``query`` (``[B, H, G, D]``) with every centroid."""
        memo = self.__dict__.get("_dots")
        if memo is None or memo[0] is not query:
            memo = (query, query.float() @ self.centroids.float().transpose(-1, -2))
            self.__dict__["_dots"] = memo
        return memo[1]


class Selector:
    """Base class of selection routers.

    ``reads_misses``: the selector reads ``ShardSummary.misses`` (the cache then counts them at every step).

    ``select(query, summary, k)`` receives ``query`` of shape ``[B, H, G, D]`` (the ``G = q * (H_q / H)`` query
    rows that share each KV head, post-RoPE, already scaled or not: selectors must be scale-invariant) and returns
    ``[B, H, k]`` int64 ids of ``k`` distinct shards. Empty shards (count 0) are chosen only when fewer than ``k``
    shards hold tokens.
    """

    name: str = ""
    reads_misses = False

    def select(self, query: torch.Tensor, summary: ShardSummary, k: int) -> torch.Tensor:
        raise NotImplementedError

    def update(self, query: torch.Tensor, summary: ShardSummary, selected: torch.Tensor, reward: torch.Tensor) -> None:
        """Learn from ``reward`` (``[B, H]`` in [0, 1]) for the ``selected`` shards. Stateless selectors: no-op."""

    def reset(self) -> None:
        """Forget running state (the cache was cleared). Stateless selectors: no-op."""


def check_select_args(query: torch.Tensor, summary: ShardSummary, k: int) -> None:
    """Validate selector inputs from their shapes (no tensor values are read: selection runs inside decode steps);
    raises ``ValueError`` naming the bad parameter."""
    if query.dim() != 4:
        raise ValueError(f"query must be [B, H, G, D], got shape {tuple(query.shape)}")
    b, h, _, d = query.shape
    if tuple(summary.centroids.shape[:2]) != (b, h) or summary.centroids.shape[-1] != d:
        raise ValueError(f"summary.centroids must be [B={b}, H={h}, S, D={d}], got {tuple(summary.centroids.shape)}")
    s = summary.num_shards
    if tuple(summary.counts.shape) != (b, h, s) or summary.centroids.shape[2] != s:
        raise ValueError(
            f"summary.counts must be [B={b}, H={h}, S] matching centroids' S={summary.centroids.shape[2]}, "
            f"got {tuple(summary.counts.shape)}"
        )
    if not 1 <= int(k) <= s:
        raise ValueError(f"k (top_k_shards) must be in [1, {s}] (number of shards), got {k}")
