"""Routed decode attention: k = all shards is exact attention; k < S attends exactly to the routed tokens."""

import pytest
import torch
from helpers import DynamicCache, generate, max_logit_diff, model_pair, pikv, prompt

from pikv_hf import PiKVCache
from pikv_hf.routing import SELECTORS
from pikv_hf.tiny import tiny_config


@pytest.mark.parametrize(
    ("arch", "router"),
    [("mixtral", "expert"), ("llama", "key_cluster"), ("gpt_oss", "expert"), ("deepseek_v3", "round_robin")],
)
@pytest.mark.parametrize("selector", sorted(SELECTORS))
def test_all_shards_selected_equals_exact_mode(arch, router, selector):
    ref, model = model_pair(arch)
    ids = prompt(41)
    out_ref = generate(ref, ids, DynamicCache())
    cache = pikv(model, router, attention="routed", top_k_shards=_shards(model), selector=selector, n_sink=2, window=3)
    out = generate(model, ids, cache)
    assert torch.equal(out_ref.sequences, out.sequences)
    assert max_logit_diff(out_ref.logits, out.logits) < 1e-5
    stats = cache.routing_stats()["overall"]
    assert stats["steps"] == 7 * len(cache.layers) and stats["fraction_pages_read"] == 1.0


def _shards(model):
    return PiKVCache(model.config).num_shards


def test_routed_step_attends_exactly_to_selected_shards_sinks_and_window():
    gen = torch.Generator().manual_seed(0)
    b, h, g, t, d, s, k, n_sink, window = 2, 2, 3, 70, 16, 6, 2, 3, 5
    cache = PiKVCache(
        tiny_config("llama", num_attention_heads=h * g, num_key_value_heads=h, head_dim=d),
        router="key_cluster",
        num_shards=s,
        page_size=4,
        attention="routed",
        top_k_shards=k,
        n_sink=n_sink,
        window=window,
        measure_recall=True,
    )
    keys, values = torch.randn(b, h, t, d, generator=gen), torch.randn(b, h, t, d, generator=gen)
    cache.update(keys, values, 0)
    new_k, new_v = torch.randn(b, h, 1, d, generator=gen), torch.randn(b, h, 1, d, generator=gen)
    view, _ = cache.update(new_k, new_v, 0)
    layer = view.layer
    query = torch.randn(b, h * g, 1, d, generator=gen)
    out = layer.attend(query, d**-0.5, None, None, None)

    all_k, all_v = torch.cat([keys, new_k], 2), torch.cat([values, new_v], 2)
    store = layer.store
    shard_of = torch.empty(b, h, t + 1, dtype=torch.long)  # shard of every token, read back from the store
    for bi in range(b):
        for hi in range(h):
            v = store.valid[bi, hi]
            shard_of[bi, hi, store.pos[bi, hi][v].long()] = store.slot_shard()[bi, hi][v]
    recalls = []
    for bi in range(b):
        for hi in range(h):
            # independent top-k selection: max over the KV head's query rows of q . centroid
            onehot = torch.nn.functional.one_hot(shard_of[bi, hi], s).float()
            centroids = (onehot.T @ all_k[bi, hi]) / onehot.sum(0).clamp(min=1)[:, None]
            score = (query[bi, hi * g : (hi + 1) * g, 0] @ centroids.T).amax(0)
            chosen = score.topk(k).indices
            pos = torch.arange(t + 1)
            keep = torch.isin(shard_of[bi, hi], chosen) | (pos < n_sink) | (pos > t - window)
            for gi in range(g):
                qv = query[bi, hi * g + gi, 0]
                logits = (all_k[bi, hi] @ qv) * d**-0.5
                expected = logits.masked_fill(~keep, float("-inf")).softmax(-1) @ all_v[bi, hi]
                assert (out[bi, 0, hi * g + gi] - expected).abs().max() < 1e-5
                recalls.append(logits.softmax(-1)[keep].sum())
    stats = cache.routing_stats()["overall"]
    assert abs(stats["recall"] - torch.stack(recalls).mean().item()) < 1e-5
    assert stats["fraction_tokens_attended"] < 1.0 and stats["fraction_pages_read"] < 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(top_k_shards=5), "top_k_shards must be an integer in \\[1, num_shards=4\\]"),
        (dict(top_k_shards=0), "top_k_shards must be an integer in \\[1, num_shards=4\\]"),
        (dict(top_k_shards=None), "top_k_shards must be an integer"),
        (dict(top_k_shards=2, selector="oracle"), "selector must be one of"),
        (dict(top_k_shards=2, n_sink=-1), "n_sink must be an integer >= 0"),
        (dict(top_k_shards=2, window=0), "window must be an integer >= 1"),
        (dict(attention="sparse"), "attention must be 'exact' or 'routed'"),
    ],
)
def test_bad_routed_arguments(kwargs, message):
    kwargs.setdefault("attention", "routed")
    with pytest.raises(ValueError, match=message):
        PiKVCache(tiny_config("mixtral"), **kwargs)


def test_set_attention_switches_a_filled_cache_and_rejects_bad_input_first():
    _, model = model_pair("mixtral")
    cache = pikv(model, "key_cluster")
    with torch.no_grad():
        model(prompt(40), past_key_values=cache)
        with pytest.raises(ValueError, match="top_k_shards must be an integer in \\[1, num_shards=4\\]"):
            cache.set_attention("routed", top_k_shards=9)
        assert cache.routed is None and all(layer.routed is None for layer in cache.layers)
        cache.set_attention("routed", top_k_shards=1, n_sink=0, window=1)
        model(prompt(1, seed=3), past_key_values=cache)
    stats = cache.routing_stats()
    assert stats["overall"]["steps"] == len(cache.layers) == len(stats["per_layer"])
    assert stats["overall"]["fraction_tokens_attended"] < 0.5
