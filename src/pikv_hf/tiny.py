"""Tiny random-weight configs of the supported architectures (no download), for the demo, tests and benchmarks."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

MAX_POSITIONS = 4096  # positions of every tiny config

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=MAX_POSITIONS,
    tie_word_embeddings=False,
)
_MOE = dict(num_experts_per_tok=2)

# model_type -> config overrides on top of _COMMON. Every MoE config has 4 experts and routes to 2.
# DeepSeek's multi-head latent attention with one shared and 4 routed experts (V3 also compresses queries)
_MLA = dict(
    n_routed_experts=4,
    n_shared_experts=1,
    moe_intermediate_size=64,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    num_key_value_heads=4,
)
TINY_ARCHS: dict[str, dict] = {
    "mixtral": dict(model_type="mixtral", num_local_experts=4, **_MOE),
    "qwen2_moe": dict(
        model_type="qwen2_moe", num_experts=4, moe_intermediate_size=64, shared_expert_intermediate_size=64, **_MOE
    ),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, moe_intermediate_size=64, head_dim=16, **_MOE),
    "olmoe": dict(model_type="olmoe", num_experts=4, **_MOE),
    "deepseek_v3": dict(model_type="deepseek_v3", q_lora_rank=32, **_MLA, **_MOE),
    "deepseek_v2": dict(model_type="deepseek_v2", q_lora_rank=None, **_MLA, **_MOE),
    "gpt_oss": dict(
        model_type="gpt_oss",
        num_local_experts=4,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        **_MOE,
    ),
    "phimoe": dict(model_type="phimoe", num_local_experts=4, **_MOE),
    "granitemoe": dict(model_type="granitemoe", num_local_experts=4, **_MOE),
    "llama": dict(model_type="llama"),
}


# Reference attention per architecture (GPT-OSS has no SDPA path in transformers: its sinks need eager).
REFERENCE_ATTN = {"gpt_oss": "eager"}


def tiny_config(arch: str, **overrides) -> PretrainedConfig:
    """Config of a tiny ``arch`` model (one of ``TINY_ARCHS``); ``overrides`` replace any field."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"arch must be one of {', '.join(TINY_ARCHS)}; got {arch!r}")
    fields = {**_COMMON, **TINY_ARCHS[arch], **overrides}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def tiny_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> PreTrainedModel:
    """A tiny ``arch`` causal LM with fixed-seed random weights, in eval mode, on its reference attention (SDPA,
    or eager where transformers has no SDPA path)."""
    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    attn = REFERENCE_ATTN.get(arch, "sdpa")
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    return model.eval()
