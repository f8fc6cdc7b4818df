"""PiKV presses: kvpress presses that act on a DynamicCache as kvpress does and free real bytes in a PiKVCache.

Scheduling (the PiKV paper's table 3): :class:`H2OPress`, :class:`StreamingLLMPress`, :class:`QuestPress`,
:class:`FlexGenPress`, :class:`LRUPress`, :class:`LRUPlusPress`, :class:`AdaKVPress`, :class:`DuoAttentionPress`, and
:class:`DecodingBudgetPress` to hold any of them to a token budget while decoding.

Compression: :class:`QuantPress` (KIVI), :class:`SVDPress`, :class:`LoRAPress`, :class:`LoRAPlusPress`,
:class:`DistillPress` (fitted projections), :class:`ChunkPCAPress`, :class:`FastVCropPress`,
:class:`ChannelPrunePress`, and :class:`PyramidPress` (layer-wise budgets).
"""

from pikv_hf.presses.adakv_press import AdaKVPress
from pikv_hf.presses.base import (
    SHARD_BUDGETS,
    PiKVPress,
    PiKVScorerPress,
    drop_or_offload,
    evict_lowest,
    keep_mask,
    proportional_keep,
    row_budgets,
)
from pikv_hf.presses.channel_prune_press import ChannelPrunePress
from pikv_hf.presses.chunk_pca_press import ChunkPCAPress
from pikv_hf.presses.compress_base import CompressorPress, cache_report
from pikv_hf.presses.decoding_budget_press import DecodingBudgetPress
from pikv_hf.presses.distill_press import DistillPress
from pikv_hf.presses.duo_attention_press import DuoAttentionPress, calibrate_heads, load_heads, save_heads
from pikv_hf.presses.fastv_crop_press import FastVCropPress
from pikv_hf.presses.flexgen_press import FlexGenPress
from pikv_hf.presses.h2o_press import H2OPress
from pikv_hf.presses.lora_plus_press import LoRAPlusPress
from pikv_hf.presses.lora_press import LoRAPress
from pikv_hf.presses.lru_plus_press import LRUPlusPress
from pikv_hf.presses.lru_press import LRUPress
from pikv_hf.presses.pyramid_press import PyramidPress
from pikv_hf.presses.quant_press import QuantPress
from pikv_hf.presses.quest_press import QuestPress
from pikv_hf.presses.streaming_llm_press import StreamingLLMPress
from pikv_hf.presses.svd_press import SVDPress

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
COMPRESSORS = {
    "quant": QuantPress,
    "svd": SVDPress,
    "lora": LoRAPress,
    "lora_plus": LoRAPlusPress,
    "distill": DistillPress,
    "chunk_pca": ChunkPCAPress,
    "fastv_crop": FastVCropPress,
    "channel_prune": ChannelPrunePress,
    "pyramid": PyramidPress,
}

__all__ = [
    "COMPRESSORS",
    "SCHEDULERS",
    "SHARD_BUDGETS",
    "AdaKVPress",
    "ChannelPrunePress",
    "ChunkPCAPress",
    "CompressorPress",
    "DecodingBudgetPress",
    "DistillPress",
    "DuoAttentionPress",
    "FastVCropPress",
    "FlexGenPress",
    "H2OPress",
    "LRUPlusPress",
    "LRUPress",
    "LoRAPlusPress",
    "LoRAPress",
    "PiKVPress",
    "PiKVScorerPress",
    "PyramidPress",
    "QuantPress",
    "QuestPress",
    "SVDPress",
    "StreamingLLMPress",
    "cache_report",
    "calibrate_heads",
    "drop_or_offload",
    "evict_lowest",
    "keep_mask",
    "load_heads",
    "proportional_keep",
    "row_budgets",
    "save_heads",
]
