"""One test per defect found in review of the first storage (shared/DESIGN.md); each failed on that code."""

import gc
import weakref

import kvpress
import pytest
import torch
from helpers import TOL, DynamicCache, generate, max_logit_diff, model_pair, pikv, prompt, shard_of_positions

from pikv_hf import PiKVCache
from pikv_hf.attention import backend as backend_module
from pikv_hf.tiny import tiny_config, tiny_model

B, H, G, T, D, PAGE = 2, 2, 3, 60, 16, 4


def _layer0_cache(**kwargs) -> PiKVCache:
    return PiKVCache(
        tiny_config("llama", num_attention_heads=H * G, num_key_value_heads=H, head_dim=D), page_size=PAGE, **kwargs
    )


def test_1_topk_routed_steps_run_no_recall_pass():
    # the learning check compared a bound method with a function, so every 16th step ran exact attention too
    cache = _layer0_cache(router="key_cluster", num_shards=4, attention="routed", top_k_shards=1, selector="topk")
    gen = torch.Generator().manual_seed(0)
    cache.update(torch.randn(1, H, T, D, generator=gen), torch.randn(1, H, T, D, generator=gen), 0)
    layer = cache.layers[0]
    calls = []
    original = layer.step.recall
    layer.step.recall = lambda *a, **k: calls.append(1) or original(*a, **k)
    for _ in range(33):
        kv = torch.randn(1, H, 1, D, generator=gen)
        cache.update(kv, kv, 0)
        cache.layers[0].attend(torch.randn(1, H * G, 1, D, generator=gen), D**-0.5, None, None)
    assert calls == [] and layer.read_stats.recall_heads == 0
    # a learning selector still gets its reward every reward_every steps
    cache.set_attention("routed", top_k_shards=1, selector="adaptive", reward_every=16)
    layer.step.recall = lambda *a, **k: calls.append(1) or layer.step.__class__.recall(layer.step, *a, **k)
    for _ in range(32):
        kv = torch.randn(1, H, 1, D, generator=gen)
        cache.update(kv, kv, 0)
        cache.layers[0].attend(torch.randn(1, H * G, 1, D, generator=gen), D**-0.5, None, None)
    assert len(calls) == 2


def test_2_evicted_counts_are_per_row_and_head_and_lengths_stay_consistent():
    # evicted used to add per-call maxima over heads, so alternating per-head evictions drove lengths negative
    cache = _layer0_cache()
    gen = torch.Generator().manual_seed(1)
    n = 10
    cache.update(torch.randn(1, H, n, D, generator=gen), torch.randn(1, H, n, D, generator=gen), 0)
    layer = cache.layers[0]
    for head in (0, 1, 0):
        st = layer.store
        keep = st.frame("valid").clone()
        pos = st.frame("pos")
        drop = (pos < n - 1) & keep  # drop 3 of this head's oldest remaining tokens
        for h_ in range(H):
            if h_ != head:
                drop[0, h_] = False
        first3 = drop[0, head].nonzero().squeeze(-1)[pos[0, head][drop[0, head]].argsort()][:3]
        keep[0, head, first3] = False
        layer.evict(keep)
    assert layer.evicted.tolist() == [[6, 3]]
    assert torch.equal(layer.store.tokens_per_shard().sum(-1), torch.tensor([[n - 6, n - 3]]))
    kv_length, kv_offset = layer.get_mask_sizes(torch.tensor([n]))
    assert (kv_length, kv_offset) == (n + 1 - 3, 3)
    keys, _ = cache.update(torch.randn(1, H, 1, D, generator=gen), torch.randn(1, H, 1, D, generator=gen), 0)
    assert keys.shape[2] == n + 1 - 3 >= 0  # the longest (row, head): head 1, 3 evicted


def test_3_prefill_keys_are_not_held_after_the_forward():
    # _fresh_kv kept every layer's prefill K/V alive until the first decode step (about twice the KV memory)
    _, model = model_pair("llama")
    cache = pikv(model, "round_robin")
    refs = []
    original = cache.layers[1].update

    def spy(key_states, value_states, cache_kwargs=None):
        refs.append(weakref.ref(key_states))
        return original(key_states, value_states, cache_kwargs)

    cache.layers[1].update = spy
    with torch.no_grad():
        model(prompt(40), past_key_values=cache)
    gc.collect()
    assert len(refs) == 1 and refs[0]() is None
    assert all(layer._fresh_kv is None for layer in cache.layers)


def test_4_left_padded_rows_get_their_first_real_tokens_as_sinks():
    # sinks were positions < n_sink in a frame that counts pads, so a left-padded row had no sinks at all
    pads, n_sink, window = 7, 3, 4
    cache = _layer0_cache(
        router="key_cluster", num_shards=6, attention="routed", top_k_shards=1, n_sink=n_sink, window=window
    )
    gen = torch.Generator().manual_seed(2)
    keys, values = torch.randn(B, H, T + 1, D, generator=gen), torch.randn(B, H, T + 1, D, generator=gen)
    padding = torch.ones(B, T + 1, dtype=torch.bool)
    padding[1, :pads] = False
    layer = cache.layers[0]
    cache.begin_forward(padding[:, :T], T, True)  # what the forward hook hands over: pads take no slot
    cache.update(keys[:, :, :T], values[:, :, :T], 0)
    layer.attend(torch.randn(B, H * G, T, D, generator=gen), D**-0.5, None, None)
    cache.end_forward()
    cache.update(keys[:, :, T:], values[:, :, T:], 0)
    query = torch.randn(B, H * G, 1, D, generator=gen)
    out = layer.attend(query, D**-0.5, None, None)
    shards = shard_of_positions(layer.store, T + 1)
    # [B, H, 1] the selected shard of each row and head, chosen again from the same statistics
    chosen, _ = layer.policy.choose(layer._group(), query[:, :, 0].reshape(B, H, G, D), D**-0.5)
    pos = torch.arange(T + 1)
    for bi in range(B):
        start = pads if bi == 1 else 0
        for hi in range(H):
            keep = (
                (shards[bi, hi] == chosen[bi, hi, 0]) | ((pos >= start) & (pos < start + n_sink)) | (pos > T - window)
            )
            keep &= padding[bi]
            for gi in range(G):
                logits = keys[bi, hi] @ query[bi, hi * G + gi, 0] * D**-0.5
                expected = logits.masked_fill(~keep, float("-inf")).softmax(-1) @ values[bi, hi]
                assert (out[bi, 0, hi * G + gi] - expected).abs().max() < 1e-5


def test_5_routed_reads_update_the_attention_statistics():
    # track_stats was ignored on routed and Quest reads, so recency and attention mass went stale
    for attention, extra in (("routed", {"top_k_shards": 1}), ("quest", {"read_fraction": 0.3})):
        cache = _layer0_cache(
            router="key_cluster", num_shards=4, attention=attention, track_stats=True, n_sink=2, window=4, **extra
        )
        gen = torch.Generator().manual_seed(3)
        cache.update(torch.randn(1, H, T, D, generator=gen), torch.randn(1, H, T, D, generator=gen), 0)
        layer = cache.layers[0]
        before = layer.store.frame("attn_mass").sum(-1)
        kv = torch.randn(1, H, 1, D, generator=gen)
        cache.update(kv, kv, 0)
        layer.attend(torch.randn(1, H * G, 1, D, generator=gen), D**-0.5, None, None)
        after = layer.store.frame("attn_mass")
        # each of the G query rows of a KV head hands out a probability mass of 1, only to tokens it read
        assert torch.allclose(after.sum(-1) - before, torch.full((1, H), float(G)), atol=1e-5)
        read_tokens = layer.read_stats.counts()["tokens_attended"]
        assert int((after > 0).sum()) <= read_tokens < H * (T + 1)
        last = layer.store.frame("last_access")
        assert int((last == T).sum()) > 0  # tokens hit by this step's query record its position


def test_7_pikv_attention_hands_other_caches_to_the_previous_implementation():
    # the dense fallback assumed the last t_kv positions were cached: wrong for kvpress-compressed caches with
    # padding; the model stayed on "pikv" for every later cache
    ref = tiny_model("llama", seed=0)
    attached = tiny_model("llama", seed=0)
    PiKVCache(attached)  # switches it to "pikv"
    ids = torch.zeros(2, 30, dtype=torch.long)
    mask = torch.zeros(2, 30, dtype=torch.long)
    ids[0], mask[0] = prompt(30)[0], 1
    ids[1, 9:], mask[1, 9:] = prompt(21, seed=4)[0], 1
    press = kvpress.StreamingLLMPress(compression_ratio=0.5, n_sink=2)
    outs = []
    for model in (ref, attached):
        with press(model):
            outs.append(generate(model, ids, DynamicCache(), attention_mask=mask, max_new_tokens=5))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert max_logit_diff(outs[0].logits, outs[1].logits) < TOL


def test_8_gather_scratch_is_kept_only_for_eager_cpu_reads(monkeypatch):
    # one workspace shared by every layer is unsafe once layers run on several streams or devices, and a key made of
    # the current stream does not compile: only eager CPU reads (one stream) keep a scratch; reads on an accelerator
    # and compiled ones allocate their gathers
    cache = _layer0_cache(router="round_robin", num_shards=4, attention="routed", top_k_shards=1)
    gen = torch.Generator().manual_seed(4)
    cache.update(torch.randn(1, H, T, D, generator=gen), torch.randn(1, H, T, D, generator=gen), 0)
    layer = cache.layers[0]
    kv = torch.randn(1, H, 1, D, generator=gen)
    cache.update(kv, kv, 0)
    query = torch.randn(1, H * G, 1, D, generator=gen)
    one = layer.attend(query, D**-0.5, None, None)
    assert cache.workspace_nbytes() > 0
    cache.backend.reset()
    monkeypatch.setattr(backend_module.torch.compiler, "is_compiling", lambda: True)  # as if compiled
    cache.layers[0]._last_qpos = torch.tensor([T])
    other = layer.attend(query, D**-0.5, None, None)
    assert torch.equal(one, other)
    assert cache.workspace_nbytes() == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_after_ragged_eviction_grows_runs_and_stays_exact(page_size):
    # after a ragged per-head eviction the runs differ in length; each decode step then grows them, and attention
    # must stay the dense softmax over exactly the kept and new tokens
    gen = torch.Generator().manual_seed(5)
    cache = PiKVCache(
        tiny_config("llama", num_attention_heads=H * G, num_key_value_heads=H, head_dim=D),
        router="key_cluster",
        num_shards=3,
        page_size=page_size,
    )
    layer = cache.layers[0]
    keys, values = torch.randn(B, H, T, D, generator=gen), torch.randn(B, H, T, D, generator=gen)
    cache.update(keys, values, 0)
    keep = torch.rand(B, H, T, generator=gen) < torch.tensor([0.9, 0.125]).view(1, H, 1)  # ragged per head
    frame_pos = layer.store.frame("pos").long().clamp(min=0, max=T - 1)
    layer.evict(layer.store.frame("valid") & keep.gather(2, frame_pos))
    assert not layer.store.table.uniform
    for step in range(3 * page_size + 5):
        k, v = torch.randn(B, H, 1, D, generator=gen), torch.randn(B, H, 1, D, generator=gen)
        cache.update(k, v, 0)
        keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)
        keep = torch.cat([keep, torch.ones(B, H, 1, dtype=torch.bool)], 2)
        query = torch.randn(B, H * G, 1, D, generator=gen)
        out = cache.layers[0].attend(query, D**-0.5, None, None)
        for bi in range(B):
            for hq in range(H * G):
                hi = hq // G
                kk, vv = keys[bi, hi][keep[bi, hi]], values[bi, hi][keep[bi, hi]]
                expected = ((query[bi, hq] @ kk.T) * D**-0.5).softmax(-1) @ vv
                assert (out[bi, 0, hq] - expected[0]).abs().max() < 1e-5, step
    per_head = layer.store.tokens_per_shard().sum(-1)
    assert torch.equal(per_head, keep.sum(-1))
    # bytes held follow each head's own tokens: at most one partly filled page per (row, head, shard)
    per_shard = layer.store.tokens_per_shard()  # [B, H, S]
    whole_pages = per_shard.add(page_size - 1).div(page_size, rounding_mode="floor").sum(-1)
    cap = layer.store.table.cap
    assert torch.equal(layer.store.table.n_pages, whole_pages)
    # growth headroom: 1/64, at least one page once a decode append found its run full (reserved a step ahead)
    assert bool((cap >= whole_pages).all() and (cap <= whole_pages + (whole_pages // 64).clamp(min=1)).all())
    assert layer.store.kv_nbytes() == int(cap.sum()) * page_size * 2 * D * 4
