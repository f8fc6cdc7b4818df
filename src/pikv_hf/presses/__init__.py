"""PiKV presses: kvpress presses that act on a DynamicCache as kvpress does and free real bytes in a PiKVCache.

Scheduling (the PiKV paper's table 3): :class:`H2OPress`, :class:`StreamingLLMPress`, :class:`QuestPress`,
:class:`FlexGenPress`, :class:`LRUPress`, :class:`LRUPlusPress`, :class:`AdaKVPress`, :class:`DuoAttentionPress`, and
:class:`DecodingBudgetPress` to hold any of them to a token budget while decoding.
"""

from pikv_hf.presses.adakv import AdaKVPress
from pikv_hf.presses.base import (
    OFFLOAD_TARGETS,
    SHARD_BUDGETS,
    PiKVScorerPress,
    drop_or_offload,
    evict_lowest,
    keep_mask,
    proportional_keep,
)
from pikv_hf.presses.decoding import DecodingBudgetPress
from pikv_hf.presses.duo_attention import DuoAttentionPress, calibrate_heads, load_heads, save_heads
from pikv_hf.presses.flexgen import FlexGenPress
from pikv_hf.presses.h2o import H2OPress
from pikv_hf.presses.lru import LRUPress
from pikv_hf.presses.lru_plus import LRUPlusPress
from pikv_hf.presses.quest import QuestPress
from pikv_hf.presses.streaming_llm import StreamingLLMPress

SCHEDULERS = {
    "h2o": H2OPress,
    "streaming_llm": StreamingLLMPress,
    "quest": QuestPress,
    "flexgen": FlexGenPress,
    "lru": LRUPress,
    "lru_plus": LRUPlusPress,
    "adakv": AdaKVPress,
    "duo_attention": DuoAttentionPress,
}

__all__ = [
    "OFFLOAD_TARGETS",
    "SCHEDULERS",
    "SHARD_BUDGETS",
    "AdaKVPress",
    "DecodingBudgetPress",
    "DuoAttentionPress",
    "FlexGenPress",
    "H2OPress",
    "LRUPlusPress",
    "LRUPress",
    "PiKVScorerPress",
    "QuestPress",
    "StreamingLLMPress",
    "calibrate_heads",
    "drop_or_offload",
    "evict_lowest",
    "keep_mask",
    "load_heads",
    "proportional_keep",
    "save_heads",
]
