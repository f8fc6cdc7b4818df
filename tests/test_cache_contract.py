"""The transformers Cache contract: lengths, mask sizes, batch operations, crop, eviction, bytes."""

import pytest
import torch
from helpers import TOL, DynamicCache, model_pair, pikv, prompt

from pikv_hf import PiKVCache


def _prefilled(arch="mixtral", router="expert", batch=3, length=30):
    ref, model = model_pair(arch)
    ids = prompt(length, batch=batch)
    ref_cache, cache = DynamicCache(), pikv(model, router)
    with torch.no_grad():
        ref(ids, past_key_values=ref_cache)
        model(ids, past_key_values=cache)
    return ref, model, ref_cache, cache


def _step(ref, model, ref_cache, cache, tokens):
    with torch.no_grad():
        a = ref(tokens, past_key_values=ref_cache).logits
        b = model(tokens, past_key_values=cache).logits
    return (a - b).abs().max().item()


def test_lengths_and_mask_sizes_match_dynamic_cache():
    ref, model, ref_cache, cache = _prefilled()
    cache_position = torch.arange(30, 32)
    for layer_idx in range(len(cache.layers)):
        assert cache.get_seq_length(layer_idx) == ref_cache.get_seq_length(layer_idx) == 30
        assert cache.get_mask_sizes(cache_position, layer_idx) == ref_cache.get_mask_sizes(cache_position, layer_idx)
    assert cache.is_compileable is False and cache.is_sliding == [False] * 3


@pytest.mark.parametrize(
    "operation",
    [
        ("reorder_cache", torch.tensor([2, 0, 0])),
        ("batch_select_indices", torch.tensor([2, 1])),
        ("batch_repeat_interleave", 2),
    ],
)
def test_batch_operations_act_like_dynamic_cache(operation):
    name, arg = operation
    ref, model, ref_cache, cache = _prefilled()
    getattr(ref_cache, name)(arg)
    getattr(cache, name)(arg)
    batch = ref_cache.layers[0].keys.shape[0]
    assert cache.layers[0].store.batch == batch
    assert _step(ref, model, ref_cache, cache, prompt(3, batch=batch, seed=5)) < TOL


@pytest.mark.parametrize("max_length", [20, -7])
def test_crop_then_continue_matches_dynamic_cache(max_length):
    ref, model, ref_cache, cache = _prefilled(router="key_cluster")
    bytes_before = cache.kv_nbytes()
    ref_cache.crop(max_length)
    cache.crop(max_length)
    assert cache.get_seq_length() == ref_cache.get_seq_length()
    assert cache.kv_nbytes() < bytes_before  # cropped pages are released
    assert _step(ref, model, ref_cache, cache, prompt(4, batch=3, seed=6)) < TOL


def test_crop_after_eviction_keeps_the_positions_below_the_cut():
    _, _, _, cache = _prefilled()
    layer = cache.layers[1]
    layer.evict(layer.store.frame("valid") & (layer.store.frame("pos") != 3))
    cache.crop(10)
    assert cache.get_seq_length() == 10 and layer.evicted.unique().tolist() == [1]
    stored = layer.view().pos
    assert stored.shape[-1] == 9 and torch.equal(stored, torch.tensor([0, 1, 2, 4, 5, 6, 7, 8, 9]).expand_as(stored))
    assert layer.get_mask_sizes(torch.tensor([10])) == (10, 1)
    cache.crop(2)  # the evicted position is cut too: nothing evicted below the new length
    assert layer.evicted.unique().tolist() == [0] and layer.get_mask_sizes(torch.tensor([2])) == (3, 0)


def test_a_crop_into_a_rows_left_padding_evicts_nothing_and_the_row_starts_again():
    """Row 0: 8 pads then 4 tokens, cropped to 5 (only pads left): nothing counts as evicted (its padding did, -3:
    mask sizes off DynamicCache's) and its next token is its first real one (row_start stayed 8, past it)."""
    ref, model = model_pair("llama")
    ids = prompt(12, batch=2, seed=7)
    mask = torch.ones_like(ids)
    mask[0, :8] = 0
    cache, dynamic = PiKVCache(model, page_size=4), DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        ref(input_ids=ids, attention_mask=mask, past_key_values=dynamic)
        for c in (cache, dynamic):
            c.crop(5)
        step = torch.tensor([[11], [12]])
        mask = torch.cat([mask[:, :5], torch.ones(2, 1, dtype=torch.long)], 1)
        assert cache.get_mask_sizes(torch.tensor([5]), 0) == dynamic.get_mask_sizes(torch.tensor([5]), 0)
        got = model(input_ids=step, attention_mask=mask, past_key_values=cache).logits[:, -1]
        want = ref(input_ids=step, attention_mask=mask, past_key_values=dynamic).logits[:, -1]
    layer = cache.layers[0]
    assert layer.evicted.min().item() == 0 and layer.row_start.tolist() == [5, 0]
    assert (got - want).abs().max().item() < TOL


def test_attention_after_ragged_eviction_equals_dense_attention_over_kept_tokens():
    gen = torch.Generator().manual_seed(0)
    _, model = model_pair("llama")
    cache = PiKVCache(model.config, router="key_cluster", page_size=4)
    layer = cache.layers[0]
    b, h, t, d = 2, 2, 25, 16
    keys, values = torch.randn(b, h, t, d, generator=gen), torch.randn(b, h, t, d, generator=gen)
    cache.update(keys, values, 0)
    keep = torch.rand(b, h, t, generator=gen) < 0.5  # a different budget per (row, head)
    keep[..., -1] = True
    frame_pos = layer.store.frame("pos").long().clamp(min=0, max=t - 1)
    layer.evict(layer.store.frame("valid") & keep.gather(2, frame_pos))
    new_k, new_v = torch.randn(b, h, 1, d, generator=gen), torch.randn(b, h, 1, d, generator=gen)
    cache.update(new_k, new_v, 0)
    query = torch.randn(b, 2 * h, 1, d, generator=gen)
    out = cache.layers[0].attend(query, d**-0.5, None, None)  # [B, 1, Hq, D]
    for bi in range(b):
        for hq in range(2 * h):
            hi = hq // 2
            k = torch.cat([keys[bi, hi][keep[bi, hi]], new_k[bi, hi]])
            v = torch.cat([values[bi, hi][keep[bi, hi]], new_v[bi, hi]])
            expected = ((query[bi, hq] @ k.T) * d**-0.5).softmax(-1) @ v
            assert (out[bi, 0, hq] - expected[0]).abs().max() < 1e-5
    assert torch.equal(layer.evicted, (~keep).sum(-1))


def test_kv_bytes_are_the_bytes_held_and_close_to_dynamic_cache():
    ref, model, ref_cache, cache = _prefilled(arch="llama", router="round_robin", batch=1, length=500)
    dyn = sum(la.keys.nbytes + la.values.nbytes for la in ref_cache.layers)
    held = sum(la.store.pool["keys"].nbytes + la.store.pool["values"].nbytes for la in cache.layers)
    assert cache.kv_nbytes() == held
    assert "attn_mass" not in cache.layers[0].store.pool.fields  # statistics are held only with track_stats
    assert dyn <= held <= 1.05 * dyn


def test_track_stats_accumulates_attention_mass():
    _, model = model_pair("llama")
    cache = pikv(model, "round_robin", track_stats=True)
    with torch.no_grad():
        model(prompt(12), past_key_values=cache)
    store = cache.layers[0].store
    heads_per_kv = model.config.num_attention_heads // model.config.num_key_value_heads
    # every query row distributes a probability mass of 1 over the slots it attends to
    assert torch.allclose(store.frame("attn_mass").sum(-1), torch.full((1, 2), 12.0 * heads_per_kv))
    first = store.frame("valid") & (store.frame("pos") == 0)
    assert (store.frame("hits")[first] >= 1).all() and store.frame("hits").sum() > 0


def test_decode_mass_beside_an_offload_tier_is_a_share_of_everything_read():
    """A decode step over a hot store and an offload tier records each hot slot's share of the attention over both
    (eager attention of the whole sequence is the reference): it was normalised over the hot store alone, 1.999
    where the true mass is 1.685, so H2O and LRU budgets ranked hot tokens by an inflated, query-dependent mass."""
    from pikv_hf.presses import FlexGenPress
    from pikv_hf.tiny import tiny_model

    model, ref = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
    ref.set_attn_implementation("eager")
    ids, new = prompt(8), torch.tensor([[17], [42]])
    cache = PiKVCache(model, num_shards=1, page_size=4, track_stats=True)
    with torch.no_grad():
        with FlexGenPress(0.5, offload="cpu")(model):  # positions 0..3 to the offload tier, still attended
            model(ids, past_key_values=cache)
        store = cache.layers[0].store
        store.pool["attn_mass"].zero_()  # the decode steps' mass only
        store.pool["hits"].zero_()
        for t in new:
            model(t.view(1, 1), past_key_values=cache)
        att = ref(torch.cat([ids, new.view(1, -1)], 1), output_attentions=True).attentions[0][0, :, -2:]
    assert sorted(cache.layers[0].stores.tiers) == ["offload"]
    g = model.config.num_attention_heads // model.config.num_key_value_heads
    valid, pos = store.frame("valid"), store.frame("pos").long()
    for h in range(model.config.num_key_value_heads):
        want = att[h * g : (h + 1) * g].sum((0, 1))  # [T]: this KV head's query heads, both steps
        got = store.frame("attn_mass")[0, h][valid[0, h]]
        torch.testing.assert_close(got, want[pos[0, h][valid[0, h]]], rtol=1e-4, atol=1e-5)
        # a hit: more than a uniform share of a step's mass over all the tokens it read (hot and offloaded)
        steps = att[h * g : (h + 1) * g].sum(0)  # [2, T]
        share = steps > g / torch.tensor([[9.0], [10.0]])
        hits = share.sum(0)[pos[0, h][valid[0, h]]]
        assert torch.equal(store.frame("hits")[0, h][valid[0, h]].long(), hits)


def test_reset_and_reuse():
    ref, model, _, cache = _prefilled(batch=1)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.kv_nbytes() == 0
    fresh = DynamicCache()
    ids = prompt(9, seed=3)
    with torch.no_grad():
        a = ref(ids, past_key_values=fresh).logits
        b = model(ids, past_key_values=cache).logits
    assert (a - b).abs().max() < TOL


def test_batch_and_length_limits_and_integer_layer_indices_as_transformers_caches_give_them():
    """StaticCache's max_batch_size (read by generate to reuse a cache) was an AttributeError on a reserved
    PiKVCache, a growing one's max_cache_len a TypeError; numpy / 0-d tensor layer indices were called out of
    range."""
    import numpy as np
    from transformers import StaticCache

    from pikv_hf.tiny import tiny_model

    ref, model = tiny_model("llama"), tiny_model("llama")
    ids = torch.randint(3, 200, (3, 5), generator=torch.Generator().manual_seed(0))
    static, reserved = StaticCache(config=ref.config, max_cache_len=32), PiKVCache(model, max_cache_len=32)
    with torch.no_grad():
        ref(ids, past_key_values=static, cache_position=torch.arange(5))
        model(ids, past_key_values=reserved, cache_position=torch.arange(5))
    assert (reserved.max_batch_size, reserved.max_cache_len) == (static.max_batch_size, static.max_cache_len) == (3, 32)
    growing = PiKVCache(model)
    assert growing.max_cache_len is None
    k = torch.randn(1, 2, 3, 16)
    for index in (np.int64(1), torch.tensor(1)):
        keys, _ = PiKVCache(model.config).update(k, k, index)
        assert torch.equal(keys, k)
    with pytest.raises(TypeError, match="layer_idx must be an integer, got float"):
        growing.update(k, k, 1.0)
