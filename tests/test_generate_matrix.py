"""PiKVCache (exact mode) reproduces DynamicCache on every supported architecture and placement router."""

import pytest
import torch
from helpers import ARCH_ROUTER_CASES, TOL, DynamicCache, generate, max_logit_diff, model_pair, pikv, prompt


@pytest.mark.parametrize(("arch", "router"), ARCH_ROUTER_CASES)
def test_prefill_and_greedy_decode_match_dynamic_cache(arch, router):
    ref, model = model_pair(arch)
    ids = prompt(37)
    with torch.no_grad():
        full_ref = ref(ids, past_key_values=DynamicCache()).logits
        full = model(ids, past_key_values=pikv(model, router)).logits
    assert (full_ref - full).abs().max().item() < TOL  # every prefill position

    out_ref = generate(ref, ids, DynamicCache())
    cache = pikv(model, router)
    out = generate(model, ids, cache)
    assert torch.equal(out_ref.sequences, out.sequences)
    assert max_logit_diff(out_ref.logits, out.logits) < TOL  # every decode step
    n_tokens = ids.shape[1] + 7  # the last generated token is never fed back
    assert cache.get_seq_length() == n_tokens
    per_layer = cache.tokens_per_shard().sum(-1)
    heads = cache.layers[0].store.heads
    assert per_layer.tolist() == [n_tokens * heads] * len(cache.layers)
    if router == "expert":  # every layer after an MoE layer placed tokens by the captured expert choice
        for layer in cache.layers:
            if layer.placement.source is not None:
                assert layer.placement.fallback_tokens == 0


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3", "gpt_oss", "llama"])
def test_per_shard_partials_merged_by_lse_match_dynamic_cache(arch):
    # shard_groups = num_shards: one partial attention per shard at every step (prefill included), merged exactly
    ref, model = model_pair(arch)
    ids = prompt(33)
    cache = pikv(model, "key_cluster", num_shards=4, shard_groups=4)
    out_ref = generate(ref, ids, DynamicCache())
    out = generate(model, ids, cache)
    assert torch.equal(out_ref.sequences, out.sequences)
    assert max_logit_diff(out_ref.logits, out.logits) < TOL


def test_exact_after_kvpress_wrapped_the_pikv_attention():
    # importing kvpress wraps every registered attention function, "pikv" included (REFERENCE.md section 2)
    import kvpress  # noqa: F401
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from pikv_hf.hf import pikv_attention

    assert ALL_ATTENTION_FUNCTIONS["pikv"] is not pikv_attention
    ref, model = model_pair("qwen3_moe")
    ids = prompt(30)
    out_ref = generate(ref, ids, DynamicCache())
    out = generate(model, ids, pikv(model, "expert"))
    assert torch.equal(out_ref.sequences, out.sequences)
    assert max_logit_diff(out_ref.logits, out.logits) < TOL


@pytest.mark.parametrize(
    ("arch", "window"),
    [
        ("qwen2_moe", dict(use_sliding_window=True, sliding_window=6, max_window_layers=3)),
        ("phimoe", dict(sliding_window=6)),
        ("mixtral", dict(sliding_window=6)),
    ],
)
def test_a_window_applied_through_the_mask_alone_is_applied(arch, window):
    """Qwen2-MoE and PhiMoE pass no ``sliding_window`` to the attention function (their mask alone slides), and a
    PiKV forward builds no mask: their sliding layers read the whole past (logits 0.28 / 0.40 off DynamicCache)."""
    from pikv_hf.tiny import tiny_model

    ref, model = tiny_model(arch, seed=0, **window), tiny_model(arch, seed=0, **window)
    ids = prompt(20)
    cache = pikv(model)
    assert any(cache.is_sliding)
    with torch.no_grad():
        want, got = ref(ids, past_key_values=DynamicCache()).logits, model(ids, past_key_values=cache).logits
    assert (want - got).abs().max().item() < TOL
    out_ref, out = generate(ref, ids, DynamicCache()), generate(model, ids, pikv(model))
    assert torch.equal(out_ref.sequences, out.sequences) and max_logit_diff(out_ref.logits, out.logits) < TOL
