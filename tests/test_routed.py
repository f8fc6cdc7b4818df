"""Routed decode attention: k = all shards is exact attention; k < S attends exactly to the routed tokens."""

import math

import pytest
import torch
from helpers import DynamicCache, generate, max_logit_diff, model_pair, pikv, prompt, shard_of_positions

from pikv_hf import PiKVCache
from pikv_hf.read.plan import compact, prefix_sum
from pikv_hf.routing import SELECTORS
from pikv_hf.tiny import tiny_config, tiny_model


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
    assert stats["layer_steps"] == 7 * len(cache.layers) and stats["decode_steps"] == 7
    assert stats["fraction_pages_read"] == 1.0


def _shards(model):
    return PiKVCache(model.config).num_shards


B, H, G, T, D, PAGE = 2, 2, 3, 70, 16, 4  # batch, KV heads, query heads per KV head, context, head dim, page size


def _one_decode_step(seed, page_size=PAGE, **cache_kwargs):
    """A layer-0 cache filled with ``T`` random tokens, then one decode step: (cache, all keys, all values,
    query, routed output)."""
    gen = torch.Generator().manual_seed(seed)
    cache = PiKVCache(
        tiny_config("llama", num_attention_heads=H * G, num_key_value_heads=H, head_dim=D),
        page_size=page_size,
        measure_recall=True,
        **cache_kwargs,
    )
    keys, values = torch.randn(B, H, T + 1, D, generator=gen), torch.randn(B, H, T + 1, D, generator=gen)
    cache.update(keys[:, :, :T], values[:, :, :T], 0)
    cache.update(keys[:, :, T:], values[:, :, T:], 0)
    query = torch.randn(B, H * G, 1, D, generator=gen)
    return cache, keys, values, query, cache.layers[0].attend(query, D**-0.5, None, None)


def test_routed_step_attends_exactly_to_selected_shards_sinks_and_window():
    b, h, g, t, d = B, H, G, T, D
    s, k, n_sink, window = 6, 2, 3, 5
    cache, all_k, all_v, query, out = _one_decode_step(
        0, router="key_cluster", num_shards=s, attention="routed", top_k_shards=k, n_sink=n_sink, window=window
    )
    shard_of = shard_of_positions(cache.layers[0].store, t + 1)  # shard of every token, read back from the store
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


def test_page_size_changes_only_the_padding_read_not_the_attended_tokens():
    kwargs = dict(router="key_cluster", num_shards=6, attention="routed", top_k_shards=2, n_sink=2, window=3)
    stats, outs = {}, {}
    for page in (1, PAGE):
        cache, *_, outs[page] = _one_decode_step(5, page_size=page, **kwargs)
        stats[page] = cache.routing_stats()["overall"]
    assert (outs[1] - outs[PAGE]).abs().max() < 1e-6
    assert stats[1]["fraction_tokens_attended"] == stats[PAGE]["fraction_tokens_attended"] < 1.0
    # pages of one token move exactly the attended tokens; larger pages also move the empty slots of open pages
    assert stats[1]["kv_read_vs_dense"] == stats[1]["fraction_tokens_attended"]
    assert stats[PAGE]["kv_read_vs_dense"] > stats[PAGE]["fraction_tokens_attended"]


def test_reset_frees_the_gather_workspace_shared_by_the_layers():
    cache, *_ = _one_decode_step(3, router="round_robin", num_shards=4, attention="routed", top_k_shards=1)
    layer = cache.layers[0]
    # the routed read's slots (padded to the largest per-head read): K and V (fp32), pos (int32), valid (bool)
    assert cache.workspace_nbytes() >= layer.read_stats.counts()["slots_gathered"] * (2 * D * 4 + 4 + 1) > 0
    assert all(la.backend is cache.backend for la in cache.layers)
    cache.reset()
    assert cache.workspace_nbytes() == 0 and all(layer.store is None for layer in cache.layers)


def test_mass_target_reads_the_shortest_ranked_prefix_reaching_the_estimated_mass():
    b, h, g, t, d = B, H, G, T, D
    s, k, n_sink, window, target = 8, 6, 2, 3, 0.6
    cache, all_k, all_v, query, out = _one_decode_step(
        4, router="key_cluster", num_shards=s, attention="routed", top_k_shards=k, n_sink=n_sink, window=window,
        mass_target=target,
    )  # fmt: skip
    shards = shard_of_positions(cache.layers[0].store, t + 1)
    lengths = []
    for bi in range(b):
        for hi in range(h):
            shard_of = shards[bi, hi]
            keys, qs = all_k[bi, hi], query[bi, hi * g : (hi + 1) * g, 0]  # [T+1, D], [G, D]
            log_mass = torch.full((g, s), float("-inf"))  # Gaussian estimate of each shard's mass, per query row
            for si in range(s):
                members = keys[shard_of == si]
                if len(members):
                    mu, var = members.mean(0), members.var(0, unbiased=False)
                    log_mass[:, si] = math.log(len(members)) + d**-0.5 * qs @ mu + 0.5 / d * qs.square() @ var
            share = log_mass.softmax(-1).mean(0)
            onehot = torch.nn.functional.one_hot(shard_of, s).float()
            centroids = (onehot.T @ keys) / onehot.sum(0).clamp(min=1)[:, None]
            ranked = (qs @ centroids.T).amax(0).topk(k).indices
            n_read = 1
            while n_read < k and share[ranked[:n_read]].sum() < target:
                n_read += 1
            lengths.append(n_read)
            pos = torch.arange(t + 1)
            keep = torch.isin(shard_of, ranked[:n_read]) | (pos < n_sink) | (pos > t - window)
            for gi in range(g):
                logits = (keys @ qs[gi]) * d**-0.5
                expected = logits.masked_fill(~keep, float("-inf")).softmax(-1) @ all_v[bi, hi]
                assert (out[bi, 0, hi * g + gi] - expected).abs().max() < 1e-5
    assert min(lengths) < k and max(lengths) > 1, lengths  # cut short of the cap, yet more than one shard


@pytest.mark.parametrize("attention", ["routed", "quest"])
def test_dense_layers_decode_exactly_and_count_a_full_read(attention):
    ref, model = model_pair("mixtral")
    ids = prompt(41)
    out_ref = generate(ref, ids, DynamicCache())
    sparse = dict(top_k_shards=1) if attention == "routed" else dict(read_fraction=0.2)
    n_layers = model.config.num_hidden_layers
    common = dict(attention=attention, n_sink=1, window=2, measure_recall=True, **sparse)
    every = pikv(model, "key_cluster", dense_layers=n_layers, **common)
    out = generate(model, ids, every)
    assert torch.equal(out_ref.sequences, out.sequences)
    assert max_logit_diff(out_ref.logits, out.logits) < 1e-5
    overall = every.routing_stats()["overall"]
    assert overall["fraction_pages_read"] == overall["fraction_tokens_attended"] == 1.0
    assert abs(overall["recall"] - 1.0) < 1e-6
    first = pikv(model, "key_cluster", dense_layers=1, **common)
    generate(model, ids, first)
    dense, sparse_layer = first.routing_stats()["per_layer"][:2]
    assert dense["fraction_tokens_attended"] == 1.0 and abs(dense["recall"] - 1.0) < 1e-6
    assert sparse_layer["fraction_tokens_attended"] < 1.0


@pytest.mark.parametrize("attention", ["routed", "quest"])
def test_below_sparse_from_steps_read_densely_and_are_counted(attention, shipped_sparse_from):
    """A step reads sparsely once the layer has seen ``sparse_from`` positions per row: before, it equals exact
    attention (DynamicCache) and ``routing_stats`` counts it as a dense step. Unset, the threshold is the mode's
    measured default."""
    ref, model = model_pair("mixtral")
    ids = prompt(41)  # 41 prompt tokens, then 7 decode steps that see 42 .. 48 positions (their own token included)
    out_ref = generate(ref, ids, DynamicCache())
    sparse = dict(top_k_shards=1) if attention == "routed" else dict(read_fraction=0.2)
    default = pikv(model, "key_cluster", attention=attention, n_sink=1, window=2, **sparse)
    assert default.read.sparse_threshold == {"routed": 8192, "quest": 4096}[attention]
    out = generate(model, ids, default)
    assert torch.equal(out_ref.sequences, out.sequences) and max_logit_diff(out_ref.logits, out.logits) < 1e-5
    overall = default.routing_stats()["overall"]
    assert overall["layer_steps"] == 7 * len(default.layers) and overall["sparse_layer_steps"] == 0
    assert overall["fraction_tokens_attended"] == 1.0
    from_46 = pikv(model, "key_cluster", attention=attention, n_sink=1, window=2, sparse_from=46, **sparse)
    generate(model, ids, from_46)
    overall = from_46.routing_stats()["overall"]
    assert overall["sparse_layer_steps"] == 3 * len(from_46.layers)  # the steps that see 46, 47, 48 positions
    assert overall["fraction_tokens_attended"] < 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(top_k_shards=2, sparse_from=-1), "sparse_from must be an integer >= 0"),
        (dict(top_k_shards=2, dense_layers=4), "dense_layers must be an integer in \\[0, 3\\], got 4"),
        (dict(top_k_shards=2, mass_target=0.0), "mass_target must be None or a number in \\(0, 1\\], got 0.0"),
        (dict(top_k_shards=2, mass_target=1.5), "mass_target must be None or a number in \\(0, 1\\], got 1.5"),
        (dict(attention="quest", read_fraction=0.5, mass_target=0.9), "mass_target applies to attention='routed'"),
        (dict(top_k_shards=2, dense_layers=-1), "dense_layers must be an integer in \\[0, 3\\], got -1"),
        (dict(top_k_shards=5), "top_k_shards must be an integer in \\[1, num_shards=4\\]"),
        (dict(top_k_shards=0), "top_k_shards must be an integer in \\[1, num_shards=4\\]"),
        (dict(top_k_shards=None), "top_k_shards must be an integer"),
        (dict(top_k_shards=2, selector="oracle"), "selector must be one of"),
        (dict(top_k_shards=2, selector="adaptive", selector_kwargs={"score": "bound"}), "do not fit selector"),
        (dict(top_k_shards=2, n_sink=-1), "n_sink must be an integer in \\[0, 65536\\]"),
        (dict(top_k_shards=2, window=0), "window must be an integer in \\[1, 65536\\]"),
        (dict(attention="sparse"), "attention must be one of exact, routed, quest"),
        (dict(attention="quest"), "read_fraction must be a number in \\(0, 1\\]"),
        (dict(attention="quest", read_fraction=0.0), "read_fraction must be a number in \\(0, 1\\]"),
        (dict(attention="quest", read_fraction=1.5), "read_fraction must be a number in \\(0, 1\\]"),
        (dict(attention="quest", read_fraction=0.5, window=0), "window must be an integer in \\[1, 65536\\]"),
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
        assert not cache.read.sparse and all(not layer.read.sparse for layer in cache.layers)
        cache.set_attention("routed", top_k_shards=1, n_sink=0, window=1, selector_kwargs={"score": "bound"})
        assert all(layer.policy.selector.score == "bound" for layer in cache.layers)
        model(prompt(1, seed=3), past_key_values=cache)
    stats = cache.routing_stats()
    assert stats["overall"]["layer_steps"] == len(cache.layers) == len(stats["per_layer"])
    assert stats["overall"]["fraction_tokens_attended"] < 0.5


@pytest.mark.parametrize(("arch", "router"), [("llama", "key_cluster"), ("gpt_oss", "expert"), ("mixtral", "hash")])
def test_quest_reading_every_page_equals_exact_mode(arch, router):
    ref, model = model_pair(arch)
    ids = prompt(41)
    out_ref = generate(ref, ids, DynamicCache())
    cache = pikv(model, router, attention="quest", read_fraction=1.0, n_sink=2, window=3)
    out = generate(model, ids, cache)
    assert torch.equal(out_ref.sequences, out.sequences)
    assert max_logit_diff(out_ref.logits, out.logits) < 1e-5
    assert cache.routing_stats()["overall"]["fraction_pages_read"] == 1.0


@pytest.mark.parametrize(
    ("n_sink", "window", "frac"),
    # the second: 5 sink / window pages against a budget of 2 (they were cut to the budget, the newest first: the
    # query did not read its own token)
    [(3, 5, 0.4), (2, 14, 0.1)],
)
def test_quest_step_reads_the_pages_of_largest_bound_plus_sink_and_window_pages(n_sink, window, frac):
    b, h, g, t, d = B, H, G, T, D
    p = PAGE
    cache, all_k, all_v, query, out = _one_decode_step(
        1, router="round_robin", num_shards=3, attention="quest", read_fraction=frac, n_sink=n_sink, window=window
    )
    st = cache.layers[0].store
    n_pages = -(-(t + 1) // p)  # round robin gives whole pages in position order across shards
    budget = -(-n_pages * frac // 1)
    recalls = []
    for bi in range(b):
        for hi in range(h):
            # independent Quest: per page of the store, bound = max_g sum_d max(q_d min_d, q_d max_d)
            v, pos = st.frame("valid")[bi, hi], st.frame("pos")[bi, hi].long()
            page_of = torch.full((t + 1,), -1)
            page_of[pos[v]] = torch.arange(v.shape[-1])[v] // p
            qs = query[bi, hi * g : (hi + 1) * g, 0]
            scores = {}
            for pg in page_of.unique().tolist():
                members = all_k[bi, hi][page_of == pg]
                lo, hi_ = members.amin(0), members.amax(0)
                bound = torch.maximum(qs * lo, qs * hi_).sum(-1).amax()
                at = torch.arange(t + 1)[page_of == pg]
                special = bool(((at < n_sink) | (at > t - window)).any())
                scores[pg] = float("inf") if special else float(bound)
            order = sorted(scores, key=lambda pg: (-scores[pg], pg))
            ranked = [pg for k, pg in enumerate(order) if k < budget or scores[pg] == float("inf")]
            keep = torch.isin(page_of, torch.tensor(ranked)) | (torch.arange(t + 1) > t - window)
            for gi in range(g):
                logits = (all_k[bi, hi] @ query[bi, hi * g + gi, 0]) * d**-0.5
                expected = logits.masked_fill(~keep, float("-inf")).softmax(-1) @ all_v[bi, hi]
                assert (out[bi, 0, hi * g + gi] - expected).abs().max() < 1e-5
                recalls.append(logits.softmax(-1)[keep].sum())
    stats = cache.routing_stats()["overall"]
    assert stats["fraction_pages_read"] == max(budget, len(ranked)) / n_pages
    assert abs(stats["recall"] - torch.stack(recalls).mean().item()) < 1e-5


def test_fork_is_independent_and_decodes_like_the_original():
    _, model = model_pair("mixtral")
    cache = pikv(model, "expert")
    nxt = prompt(1, seed=3)
    with torch.no_grad():
        model(prompt(30), past_key_values=cache)
        fork = cache.fork()
        fork.set_attention("routed", top_k_shards=1, n_sink=1, window=2)
        routed = model(nxt, past_key_values=fork).logits
        assert cache.get_seq_length() == 30 and fork.get_seq_length() == 31 and not cache.read.sparse
        assert fork.layers[1].placement.tap is cache.layers[1].placement.tap
        exact = model(nxt, past_key_values=cache).logits
        again = cache.fork()
        again.crop(30)
        assert torch.equal(model(nxt, past_key_values=again).logits, exact)
    assert not torch.allclose(routed, exact, atol=1e-6)


def test_deepcopy_shares_the_expert_tap_and_continues_like_the_original():
    """``copy.deepcopy`` (transformers' prefix-cache reuse recipe) is ``fork``: a plain deep copy took its own copy of
    the model's expert tap, which no hook calls again, so the copy placed its new tokens by stale expert choices
    (routed logits 0.66 off the original's continuation, shard counts apart, no fallback counted)."""
    import copy

    _, model = model_pair("qwen3_moe")
    kwargs = dict(router="expert", attention="routed", top_k_shards=2, sparse_from=0, page_size=2, window=2, n_sink=1)
    cache = PiKVCache(model, **kwargs)
    first = generate(model, prompt(25, batch=2, seed=4), cache, max_new_tokens=5)
    copied = copy.deepcopy(cache)
    assert copied.layers[1].placement.tap is cache.layers[1].placement.tap
    assert copied.backend is not cache.backend and copied.layers[0].store is not cache.layers[0].store
    again = generate(model, first.sequences, copied, max_new_tokens=8)
    original = generate(model, first.sequences, cache, max_new_tokens=8)
    assert max_logit_diff(again.logits, original.logits) < 1e-5
    assert torch.equal(copied.tokens_per_shard(), cache.tokens_per_shard())


def test_routing_stats_name_layer_steps_and_decode_steps():
    """Overall figures a user reads per decode step are per decode step (summed over layers); per-layer ones per
    layer-step. Reference: the offload tier's pages (every routed read of all shards fetches all of them)."""
    from pikv_hf.presses import FlexGenPress

    model = tiny_model("llama", seed=0)
    cache = PiKVCache(model, page_size=4, attention="routed", top_k_shards=8, n_sink=2, window=4, sparse_from=0)
    steps = 5
    with torch.no_grad():
        with FlexGenPress(0.5)(model):
            out = model(prompt(64, seed=3), past_key_values=cache)
        for _ in range(steps):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache)
    per_layer_bytes = []
    for layer in cache.layers:
        tier = layer.tiers["offload"]
        page_bytes = tier.pool.nbytes(tier.kv_fields) // tier.pool.num_pages
        per_layer_bytes.append(int(tier.table.n_pages.sum()) * page_bytes)
    assert sum(per_layer_bytes) == cache.offloaded_nbytes() > 0
    stats = cache.routing_stats()
    overall = stats["overall"]
    assert overall["decode_steps"] == steps and overall["layer_steps"] == steps * len(cache.layers)
    assert overall["bytes_fetched_per_decode_step"] == sum(per_layer_bytes)
    assert overall["bytes_fetched_per_layer_step"] == sum(per_layer_bytes) / len(cache.layers)
    for layer_stats, want in zip(stats["per_layer"], per_layer_bytes, strict=True):
        assert layer_stats["layer_steps"] == steps and layer_stats["bytes_fetched_per_layer_step"] == want


def test_exact_and_many_shard_reads_report_at_most_what_is_stored():
    """An exact cache reads everything (fractions 1.0). With 64 shards over 41 tokens most page slots are empty: a
    read of every shard moves all stored slots (``kv_read_vs_dense`` 1.0, not slots over tokens) and ``page_fill`` is
    the stored tokens over the stored pages' slots."""
    model = tiny_model("llama", seed=0)
    exact = PiKVCache(model, page_size=4)
    every = PiKVCache(
        model, "key_cluster", page_size=4, num_shards=64, attention="routed", top_k_shards=64, sparse_from=0
    )
    with torch.no_grad():
        for cache in (exact, every):
            model(prompt(40), past_key_values=cache)
            model(prompt(1, seed=2), past_key_values=cache)
    overall = exact.routing_stats()["overall"]
    assert overall["decode_steps"] == 0
    assert overall["fraction_tokens_attended"] == overall["fraction_pages_read"] == overall["kv_read_vs_dense"] == 1.0
    overall = every.routing_stats()["overall"]
    assert overall["decode_steps"] == 1 and overall["kv_read_vs_dense"] == overall["fraction_tokens_attended"] == 1.0
    tokens = sum(int(la.store.stats.count.sum()) for la in every.layers)
    slots = sum(int(la.store.table.n_pages.sum()) * la.store.page_size for la in every.layers)
    assert tokens == 41 * 2 * len(every.layers) and overall["page_fill"] == pytest.approx(tokens / slots)
    assert overall["page_fill"] < 0.5


@pytest.mark.parametrize("width", [7, 256, 1000, 33041])
def test_prefix_sum_compiled_in_chunks_equals_cumsum(width):
    """The compiled prefix sum (two short scans) equals ``cumsum``, and so does ``compact`` built on it."""
    need = torch.rand(2, 3, width, generator=torch.Generator().manual_seed(width)) < 0.3
    compiled = torch.compile(prefix_sum, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(need), need.cumsum(-1))
    assert torch.equal(compiled(need.long() * 3), (need.long() * 3).cumsum(-1))
    keep = min(width, 500)
    got = torch.compile(lambda n: compact(n, keep), backend="aot_eager", fullgraph=True)(need)
    want = torch.full((2, 3, keep), -1)
    for b in range(2):
        for h in range(3):
            idx = need[b, h].nonzero().flatten()[:keep]
            want[b, h, : idx.numel()] = idx
    assert torch.equal(got, want)


def test_a_shard_emptied_by_eviction_carries_no_key_bounds():
    """Bounds are not recomputed on removal, so a shard whose every token was evicted kept its old keys' bounds:
    hierarchical(score='bound') merged them into its group and read the wrong shard. The summary a selector reads
    gives an empty shard +inf / -inf bounds; the read equals attention over the shard the held keys rank first."""
    d, shards = 2, 4
    config = tiny_config("llama", num_attention_heads=1, num_key_value_heads=1, head_dim=d)
    selector_kwargs = dict(num_groups=2, top_groups=1, grouping="contiguous", score="bound")
    cache = PiKVCache(
        config, router="round_robin", num_shards=shards, page_size=1, attention="routed", top_k_shards=1,
        selector="hierarchical", selector_kwargs=selector_kwargs, n_sink=0, window=1, sparse_from=0,
    )  # fmt: skip
    layer = cache.layers[0]
    big = [[1.0, 1.0], [0.5, 0.5], [0.1, 0.1], [5.0, 5.0]]  # token t goes to shard t % 4: shard 3 holds the big keys
    keys = torch.tensor(big * 2).view(1, 1, 8, d)
    values = torch.arange(8.0).view(1, 1, 8, 1).expand(1, 1, 8, d).contiguous()
    query = torch.tensor([1.0, 1.0]).view(1, 1, 1, d)
    cache.update(keys, values, 0)
    cache.update(torch.zeros(1, 1, 1, d), torch.full((1, 1, 1, d), 100.0), 0)
    layer.attend(query, 1.0, None, None)  # the first routed step keeps the shard bounds from here on
    view = layer.view_index()
    layer.keep(view, view.pos % 4 != 3)  # every token of shard 3 evicted
    cache.update(torch.zeros(1, 1, 1, d), torch.full((1, 1, 1, d), 200.0), 0)  # position 9
    summary = layer.policy._summary(layer._group())
    assert summary.counts[0, 0].tolist() == [3, 3, 2, 0]
    assert torch.isinf(summary.key_max[0, 0, 3]).all() and (summary.key_max[0, 0, 3] < 0).all()
    out = layer.attend(query, 1.0, None, None)[0, 0, 0]
    # held: positions 0, 4, 8 (shard 0: keys 1, 1, 0), 1, 5, 9 (shard 1), 2, 6 (shard 2); shard 0's group {0, 1}
    # wins on its bound and shard 0 on its own; the window adds position 9
    held_keys = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    held_values = torch.tensor([[0.0, 0.0], [4.0, 4.0], [100.0, 100.0], [200.0, 200.0]])
    expected = (held_keys @ query.view(d)).softmax(-1) @ held_values
    assert torch.allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize("read", [dict(selector="adaptive", reward_every=1), dict(measure_recall=True)])
def test_reads_that_measure_recall_refuse_tiers_before_anything_moves(read):
    """Recall is measured against exact attention over the hot store alone: a press moving tokens into a tier was
    accepted, then the first rewarded decode step raised a RuntimeError mid-forward. The press is refused (the
    prefill undone), and so is switching such a read onto a cache that holds tiers."""
    from pikv_hf.presses import FlexGenPress

    model = tiny_model("llama", seed=0)
    ids = prompt(40)
    routed = dict(attention="routed", top_k_shards=2, sparse_from=0)
    cache = PiKVCache(model, page_size=4, **routed, **read)
    with torch.no_grad(), FlexGenPress(0.5)(model), pytest.raises(ValueError, match="FlexGenPress: layer 0 reads"):
        model(ids, past_key_values=cache)
    assert cache.get_seq_length() == 0 and not any(layer.tiers for layer in cache.layers)
    offloaded = PiKVCache(model, page_size=4, **routed)
    with torch.no_grad(), FlexGenPress(0.5)(model):
        model(ids, past_key_values=offloaded)
    with pytest.raises(ValueError, match="holds tokens in tiers .* measures recall"):
        offloaded.set_attention("routed", top_k_shards=2, sparse_from=0, **read)
    assert offloaded.read.measure_recall is False and offloaded.read.selector == "topk"


def test_a_learning_selector_is_rewarded_by_the_rows_that_read_their_selection():
    """In a left-padded batch where one row has reached sparse_from and the other reads densely, the dense row's
    recall (1.0 by construction) was handed to AdaptiveSelector.update as the reward of shards it never read alone;
    now only the sparse row's recall is."""
    model = tiny_model("llama", seed=0)
    gen = torch.Generator().manual_seed(0)
    ids, mask = torch.zeros(2, 40, dtype=torch.long), torch.zeros(2, 40, dtype=torch.long)
    ids[0], mask[0] = torch.randint(3, 256, (40,), generator=gen), 1
    ids[1, 32:], mask[1, 32:] = torch.randint(3, 256, (8,), generator=gen), 1
    cache = PiKVCache(
        model, router="key_cluster", num_shards=8, page_size=1, attention="routed", top_k_shards=1,
        selector="adaptive", reward_every=1, n_sink=0, window=1, sparse_from=20,
    )  # fmt: skip
    policy = cache.layers[1].policy
    calls = []
    original = policy.selector.update
    policy.selector.update = lambda q, summary, selected, reward: (
        calls.append((q.shape[0], selected.clone(), reward.clone())) or original(q, summary, selected, reward)
    )
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
        model(
            input_ids=out.logits[:, -1:].argmax(-1), attention_mask=torch.cat([mask, mask.new_ones(2, 1)], 1),
            position_ids=positions[:, -1:] + 1, past_key_values=cache,
        )  # fmt: skip
    ((rows, selected, reward),) = calls
    _, chosen = policy._last
    assert rows == 1 and torch.equal(selected, chosen[:1]) and reward.shape[0] == 1
    assert float(reward.max()) < 1.0  # the sparse row's own recall: one shard of eight does not hold every token


def test_page_fill_and_read_fraction_count_each_stores_own_page_size():
    """A hot store of pages of 16 and a QuantPress tier of pages of 4: ``page_fill`` and ``kv_read_vs_dense``
    took the page size of the pages read for every page stored (0.685 / 0.778 here against 0.750 / 0.852)."""
    from pikv_hf.presses import QuantPress

    model = tiny_model("llama", seed=0)
    cache = PiKVCache(model, page_size=16, attention="routed", top_k_shards=4, n_sink=1, window=2, sparse_from=0)
    with torch.no_grad():
        with QuantPress(bits=8, group_size=4, window=20)(model):
            out = model(prompt(80), past_key_values=cache)
        model(out.logits[:, -1:].argmax(-1), past_key_values=cache)  # one routed decode step
    layer = cache.layers[0]
    stores = [layer.store, *layer.tiers.values()]
    assert sorted({s.page_size for s in stores}) == [4, 16]
    tokens = sum(int(s.stats.count.sum()) for s in stores)
    slots = sum(int(s.table.n_pages.sum()) * s.page_size for s in stores)
    stats = cache.routing_stats()["per_layer"][0]
    assert stats["page_fill"] == pytest.approx(tokens / slots)
    assert stats["kv_read_vs_dense"] == pytest.approx(layer.read_stats.counts()["slots_gathered"] / slots)
