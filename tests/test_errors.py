"""Bad input raises a clear error naming the parameter, before any state changes."""

import pytest
import torch
from helpers import TOL, DynamicCache, model_pair

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
        # a slot's position is int32 (10**30 overflowed at the first forward)
        (dict(max_cache_len=10**30), "max_cache_len must be an integer in \\[1, 2147483648\\]"),
        # every shard opens a page at its first token: this asked the allocator for 2**47 bytes
        (dict(page_size=2**40), "page_size must be at most 65536 tokens, got 1099511627776"),
        (dict(shard_groups=9, num_shards=4), "shard_groups must be an integer in \\[1, num_shards=4\\]"),
        (dict(shard_groups=True), "shard_groups must be an integer in \\[1, num_shards=4\\], got True"),
        (dict(page_size=True), "page_size must be an integer >= 1, got True"),
        (dict(dense_layers=True), "dense_layers must be an integer in \\[0, 3\\], got True"),
        (dict(n_sink=False), "n_sink must be an integer in \\[0, 65536\\], got False"),
        # every layer keeps a slot per (row, KV head) for each sink and window position: 2**20 held 126 MB for 21
        # tokens, 10**30 overflowed at the first forward
        (dict(attention="routed", top_k_shards=2, window=2**20), "window must be an integer in \\[1, 65536\\]"),
        (dict(attention="quest", n_sink=10**30), "n_sink must be an integer in \\[0, 65536\\], got 1000000"),
        (dict(attention="routed", top_k_shards=2, selector=["topk"]), "selector must be one of .*got \\['topk'\\]"),
        (dict(attention_backend=["torch"]), "attention_backend must be one of .*got \\['torch'\\]"),
    ],
)
def test_bad_constructor_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PiKVCache(tiny_config("mixtral"), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(track_stats="yes"), "track_stats must be a bool, got 'yes'"),
        (dict(measure_recall=1), "measure_recall must be a bool, got 1"),
        (dict(attention="routed", top_k_shards=2, selector_kwargs="a"), "selector_kwargs must be a dict"),
        (dict(attention="routed", top_k_shards=2, selector_kwargs=0), "selector_kwargs must be a dict.*got 0"),
        (dict(attention="routed", top_k_shards=2, selector_kwargs=[]), "selector_kwargs must be a dict.*got \\[\\]"),
    ],
)
def test_flags_and_option_dicts_of_the_wrong_type(kwargs, message):
    with pytest.raises(TypeError, match=message):
        PiKVCache(tiny_config("mixtral"), **kwargs)


def _model_state(model):
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    return model.config._attn_implementation, hooks


@pytest.mark.parametrize("kind", ["gpt2", "mamba"])
def test_a_model_without_attention_layers_is_refused_and_left_as_it_was(kind):
    """GPT-2 (no ``.model.layers``) and Mamba (decoder layers without self-attention: it was accepted and stayed
    empty) are refused; the model keeps its attention implementation and hooks (GPT-2 was switched to "pikv" and
    hooked before the refusal)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dims = dict(n_layer=2, n_embd=32, n_head=2) if kind == "gpt2" else dict(num_hidden_layers=2, hidden_size=32)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, vocab_size=64, **dims))
    before = _model_state(model)
    with pytest.raises(ValueError, match="decoder layers|self-attention module in every decoder layer"):
        PiKVCache(model)
    assert _model_state(model) == before


def test_expert_router_needs_a_model_and_an_moe():
    with pytest.raises(ValueError, match="router='expert' needs the model"):
        PiKVCache(tiny_config("mixtral"), router="expert")
    _, dense = model_pair("llama")
    suggestion = "router='expert' needs an MoE model; LlamaConfig declares no experts: use router='key_cluster'"
    with pytest.raises(ValueError, match=f"{suggestion} .* or 'round_robin'"):
        PiKVCache(dense, router="expert")
    with pytest.raises(TypeError, match="model must be a transformers model or config"):
        PiKVCache("mixtral")


def test_a_module_that_is_not_a_transformers_model_is_refused_and_left_as_it_was():
    """A plain torch module: a bare AttributeError ('Linear' object has no attribute 'config'), and attach() had
    installed two forward hooks on it before failing."""
    import pikv_hf

    module = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match="model must be a transformers model or config, got Linear"):
        PiKVCache(module)
    with pytest.raises(TypeError, match="model must be a transformers model, got Linear"):
        pikv_hf.attach(module)
    assert not module._forward_pre_hooks and not module._forward_hooks


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
        # keys and values of two dtypes are stored in the wider (autocast leaves keys float32 beside bfloat16 values)
        (torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16).double(), "dtype changed .*got torch.float64, cache holds"),
        (torch.ones(2, 2, 1, 16, dtype=torch.int64),) * 2 + ("must be floating point, got torch.int64",),
    ],
)
def test_bad_updates_raise_before_changing_state(keys, values, message):
    cache = _cache_with_tokens()
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match=message):
        cache.update(keys, values, 0)
    assert _unchanged(cache, snap)


@pytest.mark.parametrize(
    ("states", "message"),
    [
        (torch.ones(2, 2, 3, 16, dtype=torch.bool), "must be floating point, got torch.bool"),
        (torch.ones(2, 2, 3, 16, dtype=torch.uint8), "must be floating point, got torch.uint8"),
        (torch.randn(2, 2, 3, 16, device="meta"), "must lie on one real device"),
        (torch.randn(0, 2, 3, 16), "must have B, H_kv and D >= 1"),
    ],
)
def test_a_bad_first_update_leaves_the_layer_empty_for_a_good_one(states, message):
    """The first update of a layer builds its store: refused inputs build nothing (a meta or empty batch left a
    half-built layer that refused the next good update; bool keys were stored)."""
    cache = PiKVCache(tiny_config("mixtral"), page_size=4)
    with pytest.raises(ValueError, match=message):
        cache.update(states, states, 0)
    keys, values = torch.randn(2, 2, 3, 16), torch.randn(2, 2, 3, 16)
    got_k, got_v = cache.update(keys, values, 0)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values) and cache.get_seq_length() == 3


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda c: c.batch_repeat_interleave(0), ValueError, "repeats must be an integer >= 1, got 0"),
        (lambda c: c.batch_repeat_interleave(True), ValueError, "repeats must be an integer >= 1, got True"),
        (lambda c: c.reorder_cache(torch.tensor([0, 1], device="meta")), ValueError, "beam_idx must be on the CPU"),
        (lambda c: c.batch_select_indices(torch.tensor([0], device="meta")), ValueError, "indices must be on the CPU"),
        (lambda c: c.update(torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16), True), IndexError, "got True"),
    ],
)
def test_bad_batch_edits_raise_before_any_layer_changes(call, error, message):
    """``batch_repeat_interleave(0)`` emptied layer 0 before failing on layer 1 (batches [0, 2, 2], every later
    forward failed); a meta index failed reading its values; ``layer_idx=True`` wrote layer 1."""
    cache = _cache_with_tokens()
    for i in (1, 2):
        cache.update(torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16), i)
    snap = _snapshot(cache)
    with pytest.raises(error, match=message):
        call(cache)
    assert _unchanged(cache, snap) and [la.store.batch for la in cache.layers] == [2, 2, 2]
    assert [la.seen for la in cache.layers] == [5, 5, 5]


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


def test_a_reserved_cache_whose_pages_cannot_be_reserved_is_left_as_before(monkeypatch):
    """The first forward of a reserved cache fails to reserve its pages (no memory for max_cache_len): every layer
    is left uninitialised, no hook fails after it, and the next forward (memory found) equals a DynamicCache's. The
    layer was left initialised with an empty store: the forward's post-hook failed on a missing attribute (a torch
    warning) and the next forward failed with an unrelated storage error."""
    import warnings

    from pikv_hf.store import PagedStore
    from pikv_hf.tiny import tiny_model

    ref, model = tiny_model("llama"), tiny_model("llama")
    cache, ids = PiKVCache(model, max_cache_len=32), torch.randint(3, 200, (1, 8), generator=torch.Generator())
    real = PagedStore.reserve

    def no_memory(self, *args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(PagedStore, "reserve", no_memory)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failing post-hook is reported as a warning by torch
        with pytest.raises(RuntimeError, match="can't allocate memory"), torch.no_grad():
            model(ids, past_key_values=cache)
    assert not any(layer.is_initialized or layer.store is not None for layer in cache.layers)
    monkeypatch.setattr(PagedStore, "reserve", real)
    with torch.no_grad():
        got = model(ids, past_key_values=cache).logits
        want = ref(ids, past_key_values=DynamicCache()).logits
    assert (got - want).abs().max() < TOL


def test_autocast_keys_and_values_of_two_dtypes_are_stored_as_dynamic_cache_holds_them():
    """Under torch.autocast(bfloat16) on a float32 model RoPE leaves the keys float32 beside bfloat16 values:
    DynamicCache takes them, every PiKVCache raised "key_states dtype torch.float32 != value_states dtype"."""
    from pikv_hf.tiny import tiny_model

    ref, model = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = []
    for m, cache in ((ref, DynamicCache()), (model, PiKVCache(model)), (model, PiKVCache(model, max_cache_len=24))):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            m(ids, past_key_values=cache)
            logits.append(m(ids[:, :1], past_key_values=cache).logits.float())
        if isinstance(cache, PiKVCache):
            assert cache.layers[0].store.dtype == torch.float32
    # bfloat16 rounding apart (the o_proj input is bfloat16 on both): within two bfloat16 ulps of logits of ~0.3
    assert (logits[1] - logits[0]).abs().max() < 4e-3 and (logits[2] - logits[0]).abs().max() < 4e-3
