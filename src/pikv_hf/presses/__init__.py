"""PiKV presses: kvpress presses that act on a DynamicCache as kvpress does and free real bytes in a PiKVCache."""

from pikv_hf.presses.base import SHARD_BUDGETS, PiKVScorerPress, evict_lowest, proportional_keep

__all__ = ["SHARD_BUDGETS", "PiKVScorerPress", "evict_lowest", "proportional_keep"]
