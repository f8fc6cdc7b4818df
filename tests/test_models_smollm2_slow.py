"""The real SmolLM2-135M-Instruct GGUF: tokenizer rebuild, loading, upcycling (slow: ~1 min, 3 GB)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from pikv_hf.models import load_smollm2

    return load_smollm2()


def test_rebuilt_tokenizer_round_trip_and_special_tokens():
    import gguf

    from pikv_hf.models import find_smollm2_gguf, tokenizer_from_gguf

    path = find_smollm2_gguf()
    tok = tokenizer_from_gguf(path)
    tokens = list(gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].contents())
    for text in ["Hello world! The year 2024.", "Café 日本語\n\n  tabs\tend", "<|im_start|>user\nhi<|im_end|>\n"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode(" the") == [tokens.index("Ġthe")]
    assert tok.encode("2024") == [tokens.index(d) for d in "2024"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.encode("<|im_end|>") == [2] and tok("hi").input_ids == tok.encode("hi", add_special_tokens=False)


def test_loaded_model_answers_a_simple_question(smollm2):
    model, tok = smollm2
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1] :])
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3


def test_upcycled_smollm2_equals_dense_and_routes_by_content(smollm2):
    from pikv_hf.eval.haystack import essay_sentences
    from pikv_hf.models import upcycle_to_moe

    model, tok = smollm2
    calibration = tok(" ".join(essay_sentences()[:200]), return_tensors="pt").input_ids[:, :512]
    moe = upcycle_to_moe(model, 8, 2, calibration)
    text = tok(" ".join(essay_sentences()[300:340]), return_tensors="pt").input_ids[:, :256]
    chosen = []
    hook = moe.model.layers[10].mlp.experts.register_forward_pre_hook(lambda m, a: chosen.append(a[1][:, 0].clone()))
    with torch.no_grad():
        dense_logits = model(text).logits
        moe_logits = moe(text).logits
    hook.remove()
    assert (dense_logits - moe_logits).abs().max().item() < 1e-3
    assert torch.equal(dense_logits.argmax(-1), moe_logits.argmax(-1))
    assert len(torch.unique(chosen[0])) >= 4  # held-out tokens spread over the experts


def test_kvpress_pipeline_on_a_pikv_cache_answers_like_dynamic_cache(smollm2):
    from kvpress import SnapKVPress
    from transformers import DynamicCache, pipeline

    from pikv_hf import PiKVCache
    from pikv_hf.eval.haystack import essay_sentences

    model, tok = smollm2
    context = (
        " ".join(essay_sentences()[:40])
        + " The secret code of the vault is 4417. "
        + " ".join(essay_sentences()[40:80])
    )
    questions = ["What is the secret code of the vault?", "Who wrote these essays?"]
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")
    for press in (None, SnapKVPress(compression_ratio=0.5)):
        dyn = pipe(context, questions=questions, press=press, cache=DynamicCache(), max_new_tokens=12)["answers"]
        with PiKVCache(model) as cache:
            ours = pipe(context, questions=questions, press=press, cache=cache, max_new_tokens=12)["answers"]
        assert ours == dyn and all(dyn), (press, dyn, ours)
