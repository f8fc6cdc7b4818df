"""A layer's KV split over the partitions of a ``ShardPlan``: the partitioned store and the binding of a plan.

Replicated compute, sharded KV (decode context parallelism). Every rank runs the same model on the same inputs, so
every rank's layer sees every new key at ``update`` and places it with the same deterministic router; each
partition stores only the tokens of its own shards (``PagedStore.append(..., present=...)``), while the shard
statistics of *all* shards are kept next to them (``PartitionedStore.stats``, updated exactly as a single store
would), so routed selection is global and identical everywhere and each partition reads only its selected shards.
At every attention call (prefill chunks included) each local partition computes the partial ``(o, lse)`` of all
query rows over its tokens, on its own device; the partials are merged exactly by log-sum-exp, first in this
process, then across ranks after an all-gather, and attention sinks (GPT-OSS) join once, after the merge
(``pikv_hf.step.DecodeStep``, the path of every layer; ``layer.py`` here). Only queries and partials move: the query
to each partition's device, ``[B, Hq, q, Dv + 1]`` floats between ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import torch
from transformers import PretrainedConfig

from pikv_hf.config import ReadConfig
from pikv_hf.distributed.comm import Communicator
from pikv_hf.distributed.plan import ShardPlan
from pikv_hf.routing import Selector, ShardSummary, make_selector
from pikv_hf.store import PagedStore, ShardStats


class PartitionedStore:
    """One layer's store under a plan: a ``PagedStore`` per local partition plus the statistics of every shard.

    It offers what a layer reads from a store outside attention (sizes, ``append``, batch operations, byte counts),
    what a routed selection reads (``summary``) and what a ``DecodeStep`` attends over (``stores``: the local
    partitions). Arguments as ``PagedStore``'s; ``device`` is the layer's (where keys arrive, where partials are
    merged), each partition's pool lives on its plan device.
    """

    def __init__(
        self,
        plan: ShardPlan,
        batch: int,
        heads: int,
        k_dim: int,
        v_dim: int,
        num_shards: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        track_stats: bool = False,
    ) -> None:
        self.k_dim, self.v_dim, self.dtype, self.device = int(k_dim), int(v_dim), dtype, device
        self.num_shards, self.page_size = int(num_shards), int(page_size)
        owner = torch.tensor(plan.owner, device=device)
        self.parts: list[PagedStore] = []
        self.mine: list[torch.Tensor] = []  # [S] bool per local partition: the shards it holds
        for p in plan.local_partitions:
            where = torch.device(plan.devices[p]) if plan.devices[p] is not None else device
            part = PagedStore(batch, heads, k_dim, v_dim, num_shards, page_size, dtype, where, track_stats=track_stats)
            self.parts.append(part)
            self.mine.append(owner == p)
        self.stats = ShardStats(batch, heads, num_shards, self.k_dim, device)  # every shard, not only local ones
        self.stats.keep_bounds()  # kept from the first key (no pages of every shard here to compute them from later)

    @property
    def batch(self) -> int:
        return self.stats.count.shape[0]

    @property
    def heads(self) -> int:
        return self.stats.count.shape[1]

    @property
    def stores(self) -> list[PagedStore]:
        """The local partitions (what a ``DecodeStep`` attends over, like the stores of a ``StoreGroup``)."""
        return self.parts

    offloaded: tuple = ()  # no partition is an offload tier
    holds_newest = False  # the token being decoded sits in the partition of its shard, not in every one

    def append(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        shard: torch.Tensor,
        pos: torch.Tensor,
        present: torch.Tensor | None = None,
        grow: bool = True,
        row_start: torch.Tensor | None = None,
    ) -> None:
        """Store each new token (``[B, H, q, D]``, shards ``[B, H, q]``, positions ``[q]``) in the local partition
        owning its shard, if any; fold every key (but padding, ``present`` False) into the statistics (``row_start``:
        ``PagedStore.append``'s)."""
        b, h, _ = shard.shape
        bhs = torch.arange(b * h, device=shard.device).view(b, h, 1) * self.num_shards + shard
        if present is None:
            self.stats.add(bhs.reshape(-1), keys.reshape(-1, self.k_dim))  # the same sums as one PagedStore's
        else:
            self.stats.add(bhs[present], keys[present])
        for part, mine in zip(self.parts, self.mine, strict=True):
            here = mine[shard] if present is None else mine[shard] & present
            if bool(here.any()):
                d = part.device
                rows = None if row_start is None else row_start.to(d)
                part.append(keys.to(d), values.to(d), shard.to(d), pos.to(d), here.to(d), grow=grow, row_start=rows)

    def keep_summaries(self) -> None:
        """The statistics of every shard are always kept here (the selection is global)."""

    def shard_stats(self) -> ShardStats:
        """The key statistics of every shard of the layer (the same on every rank)."""
        return self.stats

    def key_stats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(sums, squares, counts)`` of every shard's keys (as ``StoreGroup.key_stats``; the same on every rank):
        what the top-k centroid selection reads."""
        return self.stats.sums_and_counts()

    def summary(self, misses: torch.Tensor) -> ShardSummary:
        """The summaries of every shard of the layer (the same on every rank)."""
        return self.stats.summary(misses)

    def index_batch(self, index: torch.Tensor) -> None:
        for part in self.parts:
            part.index_batch(index.to(part.device))
        self.stats.index_batch(index)

    def tokens_per_shard(self) -> torch.Tensor:
        """``[B, H, S]`` valid tokens held by this process's partitions (zero for other ranks' shards)."""
        return sum(part.tokens_per_shard().to(self.device) for part in self.parts)

    def kv_nbytes(self) -> int:
        return sum(part.kv_nbytes() for part in self.parts)

    def meta_nbytes(self) -> int:
        return sum(part.meta_nbytes() for part in self.parts) + self.stats.nbytes()


class Partition:
    """A plan bound to a cache: builds each layer's :class:`PartitionedStore` and computes its attention.

    Build it with :func:`bind` (``PiKVCache(..., partition=plan)`` does). ``comm`` is None in one process.
    """

    def __init__(self, plan: ShardPlan, comm: Communicator | None) -> None:
        self.plan, self.comm = plan, comm

    def store(self, *args, **kwargs) -> PartitionedStore:
        """A layer's store, built where ``PiKVLayer`` would build a ``PagedStore`` (same arguments)."""
        return PartitionedStore(self.plan, *args, **kwargs)

    def check_read(self, read: ReadConfig) -> None:
        """Raise ``ValueError`` for read settings that need every token in one place; bound over ranks (``comm``),
        also for settings that differ between the ranks (one all-gather: every rank must call this, as
        ``PiKVCache.set_attention`` does, with the same settings)."""
        if read.attention == "quest":
            raise ValueError(
                "attention='quest' is not supported with a partition: Quest's page budget per (row, KV head) "
                "spans every shard; use 'exact' or 'routed'"
            )
        if read.sparse and read.measure_recall:
            raise ValueError("measure_recall is not supported with a partition (recall needs exact attention's mass)")
        if read.attention == "routed":
            selector = make_selector(read.selector, **read.selector_kwargs)
            if type(selector).update is not Selector.update:
                raise ValueError(
                    f"selector {read.selector!r} learns from recall, which a partition does not measure; "
                    "use a stateless selector"
                )
        if self.comm is not None:
            self.comm.check_same({f"read.{k}": v for k, v in dataclasses.asdict(read).items()})

    def gather(self, layer_idx: int):
        """The cross-rank merge of a layer's attention (``DecodeStep``'s ``remote``): every rank's partials."""
        if self.comm is None:
            return None
        return lambda o, lse: self.comm.gather_partials(o, lse, f"attention partials of layer {layer_idx}")


def _config_digest(config: PretrainedConfig) -> str:
    public = {k: v for k, v in config.to_dict().items() if not k.startswith("_")}
    return hashlib.sha256(json.dumps(public, sort_keys=True, default=str).encode()).hexdigest()[:32]


def bind(
    plan: ShardPlan,
    *,
    config: PretrainedConfig,
    num_shards: int,
    page_size: int,
    router: str,
    shard_groups: int,
    track_stats: bool,
    read: ReadConfig,
) -> Partition:
    """Check ``plan`` against a cache's settings and, with ranks, that every rank builds the same cache (one
    all-gather of a fingerprint); raises ``ValueError`` / ``RuntimeError`` before the cache changes anything."""
    if not isinstance(plan, ShardPlan):
        raise TypeError(f"partition must be a pikv_hf.distributed.ShardPlan, got {type(plan).__name__}")
    if plan.num_shards != num_shards:
        raise ValueError(
            f"the partition plan covers {plan.num_shards} shards but the cache has num_shards={num_shards}"
        )
    if track_stats:
        raise ValueError("track_stats is not supported with a partition (slot statistics need the merged attention)")
    partition = Partition(plan, None)
    partition.check_read(read)
    if plan.world_size == 1:
        return partition
    comm = Communicator(plan.group, plan.timeout)
    if comm.world_size != plan.world_size or comm.rank != plan.rank:
        raise ValueError(
            f"the plan is for rank {plan.rank} of {plan.world_size}, but this process is rank {comm.rank} of "
            f"{comm.world_size} in its process group"
        )
    model_fields = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size")
    comm.check_same(
        {
            "world_size": plan.world_size,
            "shard owners": plan.owner,
            "num_shards": num_shards,
            "page_size": page_size,
            "router": router,
            "shard_groups": shard_groups,
            **{f"read.{k}": v for k, v in dataclasses.asdict(read).items()},
            **{f"config.{k}": getattr(config, k, None) for k in model_fields},
            "model config (digest)": _config_digest(config),
        }
    )
    partition.comm = comm
    return partition
