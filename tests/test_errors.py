"""Bad input raises a clear error naming the parameter, before any state changes."""

import pytest
import torch
from helpers import model_pair

from pikv_hf import PiKVCache
from pikv_hf.tiny import tiny_config


def _snapshot(cache):
    layer = cache.layers[0]
    st = layer.store
    return layer.seen, st.frame("keys").clone(), st.frame("valid").clone(), st.table.n_pages.clone()


def _unchanged(cache, snap):
    now = _snapshot(cache)
    return now[0] == snap[0] and all(torch.equal(a, b) for a, b in zip(now[1:], snap[1:], strict=True))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(router="nearest"), "router must be one of round_robin, hash, expert, key_cluster; got 'nearest'"),
        (dict(num_shards=0), "num_shards must be an integer >= 1, got 0"),
        (dict(num_shards=2.5), "num_shards must be an integer >= 1"),
        (dict(num_shards=32768), "num_shards must be at most 32767 \\(a page's shard id is int16\\), got 32768"),
        (dict(page_size=0), "page_size must be an integer >= 1, got 0"),
        (dict(shard_groups=9, num_shards=4), "shard_groups must be an integer in \\[1, num_shards=4\\]"),
    ],
)
def test_bad_constructor_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PiKVCache(tiny_config("mixtral"), **kwargs)


def test_expert_router_needs_a_model_and_an_moe():
    with pytest.raises(ValueError, match="router='expert' needs the model"):
        PiKVCache(tiny_config("mixtral"), router="expert")
    _, dense = model_pair("llama")
    suggestion = "router='expert' needs an MoE model; LlamaConfig declares no experts: use router='key_cluster'"
    with pytest.raises(ValueError, match=f"{suggestion} .* or 'round_robin'"):
        PiKVCache(dense, router="expert")
    with pytest.raises(TypeError, match="model must be a transformers model or config"):
        PiKVCache("mixtral")


def _cache_with_tokens():
    cache = PiKVCache(tiny_config("mixtral"), page_size=4)
    cache.update(torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16), 0)
    return cache


@pytest.mark.parametrize(
    ("keys", "values", "message"),
    [
        (torch.randn(3, 2, 1, 16), torch.randn(3, 2, 1, 16), "batch size of key/value_states is 3, cache holds 2"),
        (
            torch.randn(2, 4, 1, 16),
            torch.randn(2, 4, 1, 16),
            "number of KV heads of key/value_states is 4, cache holds 2",
        ),
        (torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 16), "key head dim of key/value_states is 8, cache holds 16"),
        (torch.randn(2, 2, 1, 16).double(), torch.randn(2, 2, 1, 16).double(), "dtype changed mid-sequence"),
        (torch.randn(2, 2, 1, 16), torch.randn(2, 2, 2, 16), "must agree on \\[B, H_kv, q\\]"),
        (torch.randn(2, 2, 16), torch.randn(2, 2, 16), "must be \\[B, H_kv, q, D\\]"),
        (torch.randn(2, 2, 0, 16), torch.randn(2, 2, 0, 16), "at least one new token"),
        (torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16).half(), "key_states dtype torch.float32 != value_states"),
    ],
)
def test_bad_updates_raise_before_changing_state(keys, values, message):
    cache = _cache_with_tokens()
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match=message):
        cache.update(keys, values, 0)
    assert _unchanged(cache, snap)


@pytest.mark.parametrize("layer_idx", [3, -1, 10])
def test_layer_index_out_of_range(layer_idx):
    cache = _cache_with_tokens()
    snap = _snapshot(cache)
    with pytest.raises(IndexError, match=f"layer_idx must be in \\[0, 3\\), got {layer_idx}"):
        cache.update(torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16), layer_idx)
    assert _unchanged(cache, snap)


def test_bad_eviction_mask():
    cache = _cache_with_tokens()
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match="keep must be a bool tensor of shape"):
        cache.layers[0].evict(torch.ones(2, 2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="keep must be a bool tensor of shape \\(2, 2, 8\\)"):
        cache.layers[0].evict(torch.ones(2, 2, 8, dtype=torch.int64))
    assert _unchanged(cache, snap)
