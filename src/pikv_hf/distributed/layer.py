"""``PartitionedLayer``: a cache layer whose shards live in the partitions of a ``ShardPlan``.

The contract and the decode step are the ``PiKVLayer``'s; the layer's store is a ``PartitionedStore`` (one
``PagedStore`` per local partition plus the statistics of every shard), its ``DecodeStep`` attends over the local
partitions and merges across ranks with the plan's all-gather. What needs every token in one place is refused with
a clear error: dense views, eviction, crop, tiers (Quest reads, ``track_stats`` and recall are refused when the cache
is built, ``partition.Partition.check_read`` / ``bind``).
"""

from __future__ import annotations

import torch

from pikv_hf.distributed.partition import Partition, PartitionedStore
from pikv_hf.layer import PiKVLayer
from pikv_hf.step import DecodeStep


class PartitionedLayer(PiKVLayer):
    """A ``PiKVLayer`` over a partitioned store (module docstring)."""

    has_view = False

    def __init__(self, *args, partition: Partition, **kwargs) -> None:
        self.partition = partition
        super().__init__(*args, **kwargs)

    def set_read(self, read) -> None:
        super().set_read(read)
        self.step = DecodeStep(self.policy, self.backend, self.shard_groups, self.partition.gather(self.layer_idx))

    def _new_store(self, key_states: torch.Tensor, value_states: torch.Tensor) -> PartitionedStore:
        b, h, _, dk = key_states.shape
        return self.partition.store(
            b, h, dk, value_states.shape[-1], self.num_shards, self.page_size, key_states.dtype, key_states.device
        )

    def _group(self) -> PartitionedStore:
        return self.store

    def refusal(self, what: str) -> RuntimeError:
        """The error that refuses ``what`` on this layer (raised by the layer, and by a press before it edits one)."""
        return RuntimeError(
            f"layer {self.layer_idx}: {what} is not supported on a partitioned cache (its shards live on several "
            "devices or ranks)"
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs=None):
        if not self.forward.active:  # a direct call returns the dense keys / values: refused before storing
            raise self.refusal("update() outside a model forward (it returns the dense keys / values)")
        return super().update(key_states, value_states, cache_kwargs)

    def view(self):
        if self.store is None:
            return None
        raise self.refusal("a dense keys / values view")

    def view_index(self):
        raise self.refusal("a dense keys / values view")

    def _check_dense_readable(self) -> None:
        raise self.refusal("reading keys / values with another attention than 'pikv'")

    def evict(self, keep: torch.Tensor) -> None:
        raise self.refusal("evict()")

    def enable_stats(self) -> None:
        raise self.refusal("track_stats (per-slot statistics need the merged attention)")

    def crop(self, max_length: int) -> None:
        if not isinstance(max_length, int) or isinstance(max_length, bool):
            raise TypeError(f"max_length must be an int (a position, negative: from the end), got {max_length!r}")
        if self.store is not None and (max_length if max_length >= 0 else self.seen + max_length) < self.seen:
            raise self.refusal("crop()")

    def held_positions(self, length: int) -> torch.Tensor:
        """``[B, length]`` bool: every position from each row's first real token on (of the ``seen`` ones). A
        partitioned layer evicts and crops nothing, and its other partitions may live on other ranks, which this
        one does not read: what it holds follows from the row's start alone."""
        pos = torch.arange(length, device=self.row_start.device)
        started = (pos >= self.row_start.unsqueeze(-1)) & ~self._row_open.unsqueeze(-1)
        return started & (pos < self.seen)

    def tokens_per_shard(self) -> torch.Tensor:
        if self.store is None:
            return torch.zeros(0, 0, self.num_shards, dtype=torch.int64)
        return self.store.tokens_per_shard()

    def resident_tokens(self) -> torch.Tensor:
        return torch.zeros(0, 0, dtype=torch.int64) if self.store is None else self.store.tokens_per_shard().sum(-1)

    def kv_nbytes(self) -> int:
        return 0 if self.store is None else self.store.kv_nbytes()

    def offloaded_nbytes(self) -> int:
        return 0

    def meta_nbytes(self) -> int:
        return 0 if self.store is None else self.store.meta_nbytes()
