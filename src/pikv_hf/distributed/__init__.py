"""Expert shards of the KV on several devices of one process or across ``torch.distributed`` ranks.

``ShardPlan`` says where each shard lives; ``PiKVCache(model, ..., partition=plan)`` stores every shard's pages
there and merges the per-partition partial attention exactly (``partition.py``); ``comm.py`` holds the collectives
(with timeouts) between ranks. See docs/ARCHITECTURE.md, section "Distribution".
"""

from pikv_hf.distributed.comm import CollectiveError, Communicator, init_process_group
from pikv_hf.distributed.partition import Partition, PartitionedStore, bind
from pikv_hf.distributed.plan import DEFAULT_TIMEOUT_S, ShardPlan, check_device, split_shards

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "CollectiveError",
    "Communicator",
    "Partition",
    "PartitionedStore",
    "ShardPlan",
    "bind",
    "check_device",
    "init_process_group",
    "split_shards",
]
