"""PiKV presses: kvpress presses that act on a DynamicCache as kvpress does and free real bytes in a PiKVCache."""

from pikv_hf.presses.base import SHARD_BUDGETS, PiKVScorerPress, evict_lowest, proportional_keep
from pikv_hf.presses.channel_prune_press import ChannelPrunePress
from pikv_hf.presses.chunk_pca_press import ChunkPCAPress
from pikv_hf.presses.compress_base import CompressorPress, cache_report
from pikv_hf.presses.distill_press import DistillPress
from pikv_hf.presses.fastv_crop_press import FastVCropPress
from pikv_hf.presses.lora_plus_press import LoRAPlusPress
from pikv_hf.presses.lora_press import LoRAPress
from pikv_hf.presses.pyramid_press import PyramidPress
from pikv_hf.presses.quant_press import QuantPress
from pikv_hf.presses.svd_press import SVDPress

__all__ = ["SHARD_BUDGETS", "PiKVScorerPress", "evict_lowest", "proportional_keep"]
__all__ += [  # compression presses (issue 17)
    "ChannelPrunePress",
    "ChunkPCAPress",
    "CompressorPress",
    "DistillPress",
    "FastVCropPress",
    "LoRAPlusPress",
    "LoRAPress",
    "PyramidPress",
    "QuantPress",
    "SVDPress",
    "cache_report",
]
