"""Cold tiers: a layer's tokens split over its hot store and tiers attend exactly as if they were in one store."""

import pytest
import torch

from pikv_hf import PiKVCache
from pikv_hf.tiny import tiny_config

B, H, G, T, D = 2, 2, 3, 60, 16


def _layer(split: bool, seed: int = 0, **kwargs):
    """A layer-0 cache holding ``T`` random tokens (positions >= 30 moved to a tier when ``split``), plus one new
    token: (cache, layer, keys, values)."""
    gen = torch.Generator().manual_seed(seed)
    cfg = tiny_config("llama", num_attention_heads=H * G, num_key_value_heads=H, head_dim=D)
    cache = PiKVCache(cfg, router="key_cluster", num_shards=4, page_size=4, **kwargs)
    keys, values = torch.randn(B, H, T + 1, D, generator=gen), torch.randn(B, H, T + 1, D, generator=gen)
    cache.update(keys[:, :, :T], values[:, :, :T], 0)
    layer = cache.layers[0]
    if split:
        view = layer.view_index()
        moved = layer.move_to_tier("cold", view, view.pos < 30)
        assert moved.tolist() == [[30, 30], [30, 30]]
    cache.update(keys[:, :, T:], values[:, :, T:], 0)
    return cache, layer, keys, values


@pytest.mark.parametrize(
    "read", [{}, dict(attention="routed", top_k_shards=2, n_sink=2, window=4), dict(attention="quest", read_fraction=1)]
)
def test_split_layer_attends_as_the_single_store(read):
    query = torch.randn(B, H * G, 1, D, generator=torch.Generator().manual_seed(9))
    one, one_layer, keys, values = _layer(False, **read)
    two, two_layer, _, _ = _layer(True, **read)
    a = one_layer.attend(query, D**-0.5, None, None)
    b = two_layer.attend(query, D**-0.5, None, None)
    assert (a - b).abs().max() < 1e-5
    if not read:  # exact: the dense softmax over every token
        logits = (query.view(B, H, G, D) @ keys.transpose(-1, -2)) * D**-0.5
        dense = (logits.softmax(-1) @ values).view(B, H * G, D)
        assert (b[:, 0] - dense).abs().max() < 1e-5
    assert torch.equal(one.tokens_per_shard(), two.tokens_per_shard())
    if read.get("attention") == "routed":  # the same shards are chosen from the statistics of both stores together
        assert one.routing_stats()["overall"]["fraction_tokens_attended"] == pytest.approx(
            two.routing_stats()["overall"]["fraction_tokens_attended"]
        )


def test_tier_bytes_crop_and_batch_ops_follow_the_tokens():
    cache, layer, keys, values = _layer(True)
    tier = layer.tiers["cold"]
    view = layer.view()  # both stores, in position order, as the single store's view
    assert torch.equal(view.pos, torch.arange(T + 1).expand(B, H, -1))
    assert torch.equal(view.keys, keys) and torch.equal(view.values, values)
    assert cache.kv_nbytes() == layer.store.kv_nbytes() + tier.kv_nbytes() > 0  # a tier on the same device
    assert layer.offloaded_nbytes() == 0
    cache.crop(40)  # positions 30 .. 59 sat in the tier, 0 .. 29 and 60 in the hot store: 40 .. 60 go
    assert int(tier.tokens_per_shard().sum()) == B * H * 10 and int(layer.store.tokens_per_shard().sum()) == B * H * 30
    cache.batch_select_indices(torch.tensor([1]))
    assert tier.batch == layer.store.batch == 1
    assert torch.equal(layer.keys, keys[1:, :, :40])
    with pytest.raises(ValueError, match="holds tokens in tiers"):  # a selection of a view that spans tiers
        layer.keys, layer.values = layer.keys[:, :, ::2], layer.values[:, :, ::2]
        layer.keys  # noqa: B018 (the assignment is applied at the next access)


def test_offload_checks_its_arguments_before_creating_the_tier():
    cache, layer, _, _ = _layer(False)
    st = layer.store
    view = layer.view_index()
    good = torch.ones(B, H, T + 1, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"keep must be a bool tensor of shape \(2, 2, 61\)"):
        layer.offload_tokens(view, good[..., :-1], "disk")
    with pytest.raises(ValueError, match="target must be one of cpu, disk, got 'gpu'"):
        layer.offload_tokens(view, good, "gpu")
    assert not layer.tiers and int(st.tokens_per_shard().sum()) == B * H * (T + 1)


def _frame_moments(stores, num_shards: int):
    """Valid tokens and float64 key sums, squares, min and max per (row, head, shard) over every store's frame."""
    counts = torch.zeros(B, H, num_shards, dtype=torch.int64)
    sums = torch.zeros(B, H, num_shards, D, dtype=torch.float64)
    squares = torch.zeros_like(sums)
    low, high = torch.full_like(sums, float("inf")), torch.full_like(sums, -float("inf"))
    for st in stores:
        keys = st.frame_kv()[0].double()
        valid = st.frame("valid")
        shard = st.frame("shard").long().repeat_interleave(st.page_size, dim=-1)
        for b in range(B):
            for h in range(H):
                for k, s in zip(keys[b, h][valid[b, h]], shard[b, h][valid[b, h]].tolist(), strict=True):
                    counts[b, h, s] += 1
                    sums[b, h, s] += k
                    squares[b, h, s] += k * k
                    low[b, h, s] = torch.minimum(low[b, h, s], k)
                    high[b, h, s] = torch.maximum(high[b, h, s], k)
    return counts, sums, squares, low, high


@pytest.mark.parametrize("selector", ["topk", "topk_balanced"])  # one operator over sums; a summary with bounds
def test_the_hot_store_keeps_the_shard_statistics_of_every_store_once(selector):
    """With a tier, the layer's shard key sums, squares and bounds are kept once, in the hot store, over the tokens of
    both stores (the tier counts its own tokens only): after a move, decode steps and a crop they are those of the
    two frames together, the counts are the sum of the stores' own, and the summary the selector reads has them."""
    read = dict(attention="routed", top_k_shards=2, n_sink=2, window=4, selector=selector)
    cache, layer, keys, values = _layer(True, **read)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        layer.attend(torch.randn(B, H * G, 1, D, generator=gen), D**-0.5, None, None)
        cache.update(torch.randn(B, H, 1, D, generator=gen), torch.randn(B, H, 1, D, generator=gen), 0)
    hot, tier = layer.stores.hot, layer.stores.tiers["cold"]
    assert tier.stats.sum is None and tier.stats.min is None  # counts only
    for cropped in (False, True):
        if cropped:
            cache.crop(50)
        group = layer.stores.group()
        summary = group.summary(torch.zeros(B, H, 4, dtype=torch.int64))
        sums, squares, counts = group.key_stats()
        per_shard, want_sums, want_squares, low, high = _frame_moments([hot, tier], 4)
        assert torch.equal(counts, hot.stats.count + tier.stats.count)
        assert torch.equal(counts, per_shard)
        assert torch.allclose(sums.double(), want_sums, atol=1e-5)
        assert torch.allclose(squares.double(), want_squares, atol=1e-4)
        assert torch.allclose(summary.centroids.double() * counts.clamp(min=1).unsqueeze(-1), want_sums, atol=1e-5)
        filled = counts > 0
        # bounds hold every key (exactly, until a crop removed keys: then they may bound a superset)
        assert bool((summary.key_min.double()[filled] <= low[filled]).all())
        assert bool((summary.key_max.double()[filled] >= high[filled]).all())
        if not cropped:
            assert torch.equal(summary.key_min.double()[filled], low[filled])



def _tiered(press, page_size: int = 16, **read):
    from pikv_hf.tiny import tiny_model

    model, ref = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    cache = PiKVCache(model, num_shards=2, page_size=page_size, **read)
    with torch.no_grad(), press(model):
        model(ids, past_key_values=cache)
    return model, ref, ids, cache


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("which", ["quant", "offload"])
def test_a_tier_emptied_by_a_crop_is_gone_and_the_cache_decodes_as_dynamic_cache(which, page_size):
    """A crop that keeps only the exact sinks empties the compressed (or offload) tier: the tier is dropped (its
    empty pool once failed a second crop, the dense view and the next routed or Quest step) and decoding goes on as
    a DynamicCache cropped alike; a crop to 0 then takes a new prefill under the same press (refused before as a
    layer already holding tiers)."""
    from transformers import DynamicCache

    from pikv_hf.presses import QuantPress, StreamingLLMPress

    def press():
        if which == "quant":
            return QuantPress(bits=4, group_size=8, window=8, n_sink=2)
        return StreamingLLMPress(compression_ratio=0.5, n_sink=2, offload="cpu")

    read = dict(attention="routed", top_k_shards=2, sparse_from=0)
    model, ref, ids, cache = _tiered(press(), page_size, **read)
    assert cache.layers[0].tiers
    dynamic = DynamicCache()
    with torch.no_grad():
        ref(ids, past_key_values=dynamic)
    cache.crop(2)
    dynamic.crop(2)
    assert not any(layer.tiers for layer in cache.layers)
    cache.crop(1)
    dynamic.crop(1)
    assert torch.equal(cache.layers[0].keys, dynamic.layers[0].keys)
    with torch.no_grad():
        for token in (7, 9):
            at = torch.tensor([[dynamic.get_seq_length()]])
            want = ref(torch.tensor([[token]]), past_key_values=dynamic, position_ids=at, cache_position=at[0]).logits
            got = model(torch.tensor([[token]]), past_key_values=cache).logits
            assert (got - want).abs().max() < 1e-4
    cache.crop(0)
    fresh = PiKVCache(model, num_shards=2, page_size=page_size, **read)
    with torch.no_grad(), press()(model):
        again = model(ids, past_key_values=cache).logits
        want = model(ids, past_key_values=fresh).logits
    assert (again - want).abs().max() < 1e-5 and list(cache.layers[0].tiers) == list(fresh.layers[0].tiers)


def test_an_offload_press_that_moves_nothing_makes_no_tier():
    """A one-token prompt under an offload press keeps its token: no empty offload tier is left behind (it once
    forced sparse reads whose packed read of the empty tier failed inside generate)."""
    from transformers import DynamicCache

    from pikv_hf.presses import H2OPress
    from pikv_hf.tiny import tiny_model

    model, ref = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
    one = torch.tensor([[42]])
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    cache = PiKVCache(model, num_shards=2, page_size=1, attention="routed", top_k_shards=2)
    with torch.no_grad(), H2OPress(compression_ratio=0.5, offload="cpu")(model):
        out = model.generate(one, past_key_values=cache, **kw)
    want = ref.generate(one, past_key_values=DynamicCache(), **kw)
    assert not cache.layers[0].tiers
    assert max((a - b).abs().max().item() for a, b in zip(out.logits, want.logits, strict=True)) < 1e-4


@pytest.mark.parametrize("bits", [2, 4])
def test_a_crop_keeps_the_quantised_tokens_it_keeps(bits):
    """A crop that cuts through quantised pages keeps the kept tokens' values exactly (the view before the crop,
    cut), as a DynamicCache's crop does: a page that only loses tokens keeps its codes and key range (it was once
    re-quantised from its decoded content over a narrower range, values off by up to 0.1 at 2 bits)."""
    from pikv_hf.presses import QuantPress
    from pikv_hf.tiny import tiny_model

    model = tiny_model("llama", seed=0)
    ids = torch.randint(3, 256, (2, 100), generator=torch.Generator().manual_seed(bits))
    cache = PiKVCache(model, num_shards=2, page_size=4)
    with torch.no_grad(), QuantPress(bits=bits, group_size=8, window=8)(model):
        model(ids, past_key_values=cache)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    for cut in (90, 57, 33, 9):
        cache.crop(cut)
        for layer, (keys, values) in zip(cache.layers, before, strict=True):
            assert torch.equal(layer.keys, keys[:, :, :cut]) and torch.equal(layer.values, values[:, :, :cut])
