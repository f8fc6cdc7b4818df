"""No silent wrong result: mode switches, press arguments, reserved and offloaded caches, eager models, opaque inputs,
``update`` outside a forward, and what differs from a DynamicCache on purpose (issue 25, items 2-7 and 9)."""

import gc
import os
import tempfile

import kvpress
import pytest
import torch
from helpers import DynamicCache, byte_tokenizer, model_pair, pikv, prompt
from transformers import pipeline

from pikv_hf import PiKVCache
from pikv_hf.presses import (
    DecodingBudgetPress,
    DuoAttentionPress,
    FlexGenPress,
    H2OPress,
    QuestPress,
    StreamingLLMPress,
    calibrate_heads,
)
from pikv_hf.tiny import tiny_model


def _decode(model, cache, ids, steps=3, **kwargs):
    with torch.no_grad():
        return model.generate(
            ids, past_key_values=cache, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True, **kwargs,
        )  # fmt: skip


# ------------------------------------------------------------------ 2. no silent switch of attention
def test_detached_cache_after_eviction_refuses_instead_of_reading_zero_keys():
    _, model = model_pair("llama")
    evicted = PiKVCache(model, page_size=4)
    with StreamingLLMPress(0.5, n_sink=2)(model), torch.no_grad():
        model(prompt(40), past_key_values=evicted)
    other = PiKVCache(model, page_size=4)
    other.detach()  # another PiKVCache on the same model gives the model its previous attention back
    with pytest.raises(RuntimeError, match="detached from the cache .* Call cache.attach\\(\\)"):
        with torch.no_grad():
            model(torch.tensor([[5]]), past_key_values=evicted)
    evicted.attach()  # the fix the message names
    with torch.no_grad():
        model(torch.tensor([[5]]), past_key_values=evicted)
    assert evicted.get_seq_length() == 41


def test_detached_cache_without_eviction_reads_exactly_with_padding():
    ref, model = model_pair("llama")
    ids = prompt(20, batch=2)
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    with PiKVCache(model, page_size=4) as cache:  # the `with` block ends: the model is detached
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=cache)
    assert model.config._attn_implementation == "sdpa"
    want = _decode(ref, DynamicCache(), ids, attention_mask=mask)
    with torch.no_grad():  # the same model forward again, from the detached cache: tokens at their positions
        dyn = DynamicCache()
        ref(ids, attention_mask=mask, past_key_values=dyn)
        step = torch.tensor([[9], [9]])
        full = torch.cat([mask, torch.ones_like(step)], -1)
        a = ref(step, attention_mask=full, past_key_values=dyn).logits
        b = model(step, attention_mask=full, past_key_values=cache).logits
    assert (a - b).abs().max() < 1e-5 and want.sequences.shape[0] == 2


# ------------------------------------------------------------------ 3. press arguments mean what they say
def test_quest_ratio_is_its_first_argument_and_wins_over_the_cache_mode():
    _, model = model_pair("llama")
    assert QuestPress(0.5).compression_ratio == 0.5
    with pytest.raises(TypeError, match="QuestPress.compression_ratio must be float, got str"):
        QuestPress("0.5")
    with pytest.raises(TypeError, match="H2OPress.recent_ratio must be float"):
        H2OPress(0.5, recent_ratio="half")
    cache = pikv(model)
    ids = prompt(60)
    with QuestPress(0.25, page_size=4)(model), torch.no_grad():  # prefill in Quest mode, reading 75%
        model(ids, past_key_values=cache)
    assert cache.read.read_fraction == 0.75
    # decoded under another ratio: it reads 25% (its sink / window pages, always read, fit in that budget)
    with QuestPress(0.75, n_sink=1, window=2)(model), torch.no_grad():
        for token in (5, 6, 7):
            model(torch.tensor([[token]]), past_key_values=cache)
    assert cache.read.read_fraction == 0.25
    overall = cache.routing_stats()["overall"]
    assert overall["sparse_layer_steps"] > 0 and overall["fraction_pages_read"] <= 0.25 + 1 / 8


def test_duo_attention_takes_what_calibrate_heads_returns():
    _, model = model_pair("llama")
    heads = calibrate_heads(model, prompt(48, seed=3), n_sink=2, window=8)
    cache = pikv(model)
    with DuoAttentionPress(0.5, heads=heads)(model), torch.no_grad():
        model(prompt(40), past_key_values=cache)
    assert int(cache.layers[0].tokens_per_shard().sum()) == 2 * 20  # H * compute_n_kept(40, 0.5) per row
    other = tiny_model("llama", seed=5)
    with pytest.raises(ValueError, match="calibrated on another model"):
        DuoAttentionPress(0.5, heads=heads).post_init_from_model(other)


def test_decoding_budget_turns_on_the_statistics_it_needs():
    # it used to fail at the first over-budget step, hundreds of tokens in, asking for track_stats=True
    _, model = model_pair("llama")
    cache = PiKVCache(model, page_size=4)  # no track_stats
    with DecodingBudgetPress(H2OPress(), target_size=24)(model):
        out = _decode(model, cache, prompt(20), steps=12)
    assert out.sequences.shape[1] == 32
    assert int(cache.layers[0].held().max()) <= 24 + 1 and "attn_mass" in cache.layers[0].store.pool.fields
    with pytest.raises(ValueError, match="base_press SnapKVPress has none"):
        with DecodingBudgetPress(kvpress.SnapKVPress(), target_size=24)(model):
            _decode(model, PiKVCache(model), prompt(20))


# ------------------------------------------------------------------ 4. reserved and offloaded caches
def test_more_tokens_than_max_cache_len_are_refused_before_storing():
    _, model = model_pair("llama")
    cache = PiKVCache(model, max_cache_len=16)
    with pytest.raises(ValueError, match="40 tokens .* exceed max_cache_len=16"), torch.no_grad():
        model(prompt(40, batch=2), past_key_values=cache)
    # nothing set up (layer 0 was, for a batch of 2, and refused a later batch of 1)
    assert all(layer.store is None for layer in cache.layers) and cache.kv_nbytes() == 0
    with torch.no_grad():
        model(prompt(16), past_key_values=cache)
        with pytest.raises(ValueError, match="17 tokens \\(16 stored \\+ 1 new\\) exceed max_cache_len=16"):
            model(torch.tensor([[5]]), past_key_values=cache)
    assert cache.get_seq_length() == 16


def test_disk_offload_leaves_no_files(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    _, model = model_pair("llama")
    cache = pikv(model)
    with FlexGenPress(0.5, offload="disk")(model), torch.no_grad():
        model(prompt(40), past_key_values=cache)
        model(torch.tensor([[5]]), past_key_values=cache)
    assert cache.offloaded_nbytes() > 0 and os.listdir(tmp_path) == []  # mapped and unlinked at once
    cache.reset()
    del cache
    gc.collect()
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ 5. eager-loaded models
@pytest.mark.parametrize("attention", ["routed", "quest"])
def test_sparse_steps_of_an_eager_model_compute_no_dense_weights(attention, monkeypatch):
    model = tiny_model("llama", seed=0)
    model.set_attn_implementation("eager")
    sparse = dict(top_k_shards=2) if attention == "routed" else dict(read_fraction=0.5)
    cache = pikv(model, "key_cluster", attention=attention, n_sink=1, window=2, **sparse)
    calls = []
    original = type(cache.layers[0]).attention_weights
    monkeypatch.setattr(type(cache.layers[0]), "attention_weights", lambda *a: calls.append(1) or original(*a))
    with torch.no_grad():
        model(prompt(40), past_key_values=cache)
        assert len(calls) == len(cache.layers)  # eager consumers (kvpress's ObservedAttention) read prefill weights
        for token in (5, 6, 7):
            model(torch.tensor([[token]]), past_key_values=cache)
        overall = cache.routing_stats()["overall"]
        assert len(calls) == len(cache.layers) and overall["sparse_layer_steps"] > 0 and overall["dense_passes"] == 0
        model(torch.tensor([[8]]), past_key_values=cache, output_attentions=True)  # asked for: computed, counted
    assert cache.routing_stats()["overall"]["dense_passes"] == len(cache.layers)


# ------------------------------------------------------------------ 6. opaque inputs
def test_opaque_inputs_raise_named_errors_and_change_nothing():
    _, model = model_pair("llama")
    cache = pikv(model)
    with torch.no_grad():
        model(prompt(12, batch=2), past_key_values=cache)
    before = [int(layer.held().sum()) for layer in cache.layers]
    with pytest.raises(TypeError, match="key_states must be a torch.Tensor, got list"):
        cache.update([[1.0]], torch.zeros(2, 2, 1, 16), 0)
    with pytest.raises(IndexError, match="indices must index at least one batch row, each in \\[0, 2\\), got \\[0, 5"):
        cache.batch_select_indices(torch.tensor([0, 5]))
    with pytest.raises(IndexError, match="beam_idx must index at least one batch row, each in \\[0, 2\\)"):
        cache.reorder_cache(torch.tensor([2, 0]))
    with pytest.raises(IndexError, match="got \\[-1, 0\\]"):  # passed the check, then failed in index_select
        cache.reorder_cache(torch.tensor([-1, 0]))
    with pytest.raises(IndexError, match="got \\[\\]"):  # an obscure error inside the stores before
        cache.batch_select_indices(torch.tensor([], dtype=torch.int64))
    with pytest.raises(IndexError, match="indices must select at least one batch row"):
        cache.batch_select_indices(torch.zeros(2, dtype=torch.bool))
    with pytest.raises(TypeError, match="max_length must be an int"):
        cache.crop("10")
    assert [int(layer.held().sum()) for layer in cache.layers] == before and cache.get_seq_length() == 12


def test_layer_batch_operations_check_their_rows():
    """A layer's own reorder_cache / batch_select_indices / batch_repeat_interleave (what transformers' Cache calls
    per layer) refuse what the cache refuses; before, a layer took -1 as the last row and an empty index as a batch
    of none."""
    _, model = model_pair("llama")
    cache = pikv(model)
    with torch.no_grad():
        model(prompt(12, batch=2), past_key_values=cache)
    layer = cache.layers[0]
    keys = layer.keys.clone()
    with pytest.raises(IndexError, match="beam_idx must index at least one batch row, each in .*got \\[-1, 0"):
        layer.reorder_cache(torch.tensor([-1, 0]))
    with pytest.raises(IndexError, match="indices must index at least one batch row"):
        layer.batch_select_indices(torch.tensor([], dtype=torch.int64))
    with pytest.raises(TypeError, match="indices must be a 1-D integer tensor"):
        layer.batch_select_indices(torch.tensor([0.0]))
    with pytest.raises(ValueError, match="repeats must be"):
        layer.batch_repeat_interleave(0)
    assert torch.equal(layer.keys, keys)
    layer.batch_select_indices(torch.tensor([1]))  # valid: the layer's rows follow (the reference: the slice)
    assert torch.equal(layer.keys, keys[1:])


# ------------------------------------------------------------------ 7. update outside a forward
def test_update_outside_a_forward_returns_the_dense_tensors():
    _, model = model_pair("llama")
    cache = PiKVCache(model, page_size=4)
    k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    keys, values = cache.update(k, v, 0)
    assert isinstance(keys, torch.Tensor) and torch.equal(keys, k) and torch.equal(values, v)
    keys, _ = cache.update(k[:, :, :1], v[:, :, :1], 0)
    assert torch.equal(keys, torch.cat([k, k[:, :, :1]], 2))


# ------------------------------------------------------------------ 9. what differs from a DynamicCache on purpose
def test_seq_length_counts_positions_after_compression():
    # kvpress's pipeline logs get_seq_length() as "Compressed Context Length": a PiKVCache reports positions seen
    _, model = model_pair("llama")
    cache = pikv(model)
    with kvpress.KnormPress(0.5)(model), torch.no_grad():
        model(prompt(64), past_key_values=cache)
    assert cache.get_seq_length() == 64 and cache.layers[0].keys.shape[2] == 32


def test_decode_time_compression_answers_are_trimmed_by_position():
    # kvpress's pipeline trims each answer by slicing to the pre-question length; a PiKVCache crops positions, so
    # after a decoding press every answer token is gone (a DynamicCache slice keeps some of them)
    _, model = model_pair("llama")
    cache = PiKVCache(model, page_size=4)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=byte_tokenizer(), device="cpu")
    press = kvpress.DecodingPress(kvpress.KnormPress(), compression_interval=2, target_size=30)
    context = "abcdefghij" * 6
    pipe(context, question="what?", press=press, cache=cache, max_new_tokens=8)
    assert all(int(layer.view().pos.max()) <= len(context) for layer in cache.layers)


def test_dms_masks_are_positions_and_their_tokens_are_freed():
    # DMS (decoding=True) names the tokens it masks by position and keeps adding to them; a PiKVCache evicts them
    _, model = model_pair("llama")
    press = kvpress.DMSPress(press=kvpress.RandomPress(), threshold=0.5, sliding_window_size=0, decoding=True)
    cache = pikv(model)
    torch.manual_seed(0)
    with press(model):
        _decode(model, cache, prompt(30), steps=6)
    with torch.no_grad():  # one more step: kvpress's attention patch hands over the masks of the last step too
        model(torch.tensor([[5]]), past_key_values=cache)
    held = [int(layer.held().sum()) for layer in cache.layers]
    masked = [len(layer.self_attn.masked_key_indices[0]) for layer in model.model.layers]  # 2 KV heads, 36 tokens
    assert all(0 < m for m in masked) and all(h == 2 * 36 - m for h, m in zip(held, masked, strict=True))


def test_structured_kvcompose_with_two_rows_is_refused_by_name():
    # kvpress's structured KVCompose writes one row back for a batch of two (a DynamicCache silently loses row 1)
    _, model = model_pair("llama")
    with pytest.raises(ValueError, match="KVComposePress: layer 0: rewritten keys / values must be"):
        with kvpress.KVComposePress(compression_ratio=0.9)(model), torch.no_grad():
            model(prompt(12, batch=2), past_key_values=pikv(model))
