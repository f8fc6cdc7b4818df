"""PiKV Scheduling presses: kvpress's flow on a DynamicCache, the pipeline, PiKVCache prefill and decode-time budgets,
on tiny Mixtral, Qwen3-MoE, OLMoE and Llama; kept tokens against independent computations of each score."""

import math
import warnings

import kvpress
import pytest
import torch
from helpers import DynamicCache, byte_tokenizer, generate, max_logit_diff, model_pair, prompt
from kvpress.utils import compute_n_kept
from transformers import AttentionInterface, pipeline
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from pikv_hf import PiKVCache
from pikv_hf.presses import (
    AdaKVPress,
    ChannelPrunePress,
    DecodingBudgetPress,
    DuoAttentionPress,
    FlexGenPress,
    H2OPress,
    LRUPlusPress,
    LRUPress,
    PyramidPress,
    QuantPress,
    QuestPress,
    StreamingLLMPress,
    calibrate_heads,
    load_heads,
    save_heads,
)
from pikv_hf.presses.duo_attention_press import head_budgets
from pikv_hf.presses.pyramid_press import pyramid_budgets
from pikv_hf.presses.queries import model_queries
from pikv_hf.tiny import tiny_model

ARCHS = ["mixtral", "qwen3_moe", "olmoe", "llama"]
T, NEW, R, PAGE = 80, 4, 0.5, 8  # context, generated tokens, ratio, page size
EVICTING = ("h2o", "streaming_llm", "lru", "lru_plus", "adakv", "duo_attention")
_HEADS: dict[str, list] = {}


def _heads(arch: str) -> list:
    if arch not in _HEADS:
        ref, _ = model_pair(arch)
        _HEADS[arch] = calibrate_heads(ref, prompt(T, seed=7), n_sink=2, window=8)["scores"]
    return _HEADS[arch]


def _press(name: str, arch: str, ratio: float = R):
    return {
        "h2o": lambda: H2OPress(ratio),
        "streaming_llm": lambda: StreamingLLMPress(ratio, n_sink=2),
        "lru": lambda: LRUPress(ratio),
        "lru_plus": lambda: LRUPlusPress(ratio),
        "flexgen": lambda: FlexGenPress(ratio),
        "adakv": lambda: AdaKVPress(H2OPress(ratio)),
        "duo_attention": lambda: DuoAttentionPress(ratio, heads=_heads(arch), n_sink=2),
        "quest": lambda: QuestPress(compression_ratio=ratio, page_size=PAGE, n_sink=2, window=8),
    }[name]()


NAMES = ["h2o", "streaming_llm", "lru", "lru_plus", "flexgen", "adakv", "duo_attention", "quest"]


def _cache(model) -> PiKVCache:
    return PiKVCache(model, router="round_robin", page_size=PAGE, track_stats=True)


def _generate(model, cache, press):
    with press(model):
        return model.generate(prompt(T, seed=3), past_key_values=cache, max_new_tokens=NEW + 1, do_sample=False)


def _per_head(cache: PiKVCache, store: str = "hot") -> list[torch.Tensor]:
    """``[B, H]`` valid tokens per layer in the hot store (or a tier)."""
    out = []
    for layer in cache.layers:
        st = layer.store if store == "hot" else layer.tiers[store]
        out.append(st.tokens_per_shard().sum(-1))
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", NAMES)
def test_press_on_dynamic_cache_and_pikv_cache(name, arch):
    ref, model = model_pair(arch)
    dyn, cache = DynamicCache(), _cache(model)
    a = _generate(ref, dyn, _press(name, arch))
    b = _generate(model, cache, _press(name, arch))
    n_kept = compute_n_kept(T, R)
    heads = cache.layers[0].store.heads
    for layer, dyn_layer, held in zip(cache.layers, dyn.layers, _per_head(cache), strict=True):
        newest = int(layer.store.frame("pos").max())
        assert newest == T + NEW - 1  # the most recent token is never lost
        if name == "quest":  # selection, not eviction
            assert bool((held == T + NEW).all()) and dyn_layer.keys.shape[2] == T + NEW
        elif name == "flexgen":  # resident: the recent share; the rest is offloaded, not lost
            assert bool((held == n_kept + NEW).all())
            assert bool((layer.tiers["offload"].tokens_per_shard().sum(-1) == T - n_kept).all())
            assert dyn_layer.keys.shape[2] == n_kept + NEW  # a DynamicCache has no second tier: dropped
        elif name in ("adakv", "duo_attention"):  # budgets per head vary, per layer they are exact
            assert bool((held.sum(-1) == heads * (n_kept + NEW)).all())
            assert dyn_layer.keys.shape[2] == T + NEW  # kvpress masks these, it frees nothing
        else:
            assert bool((held == n_kept + NEW).all()) and dyn_layer.keys.shape[2] == n_kept + NEW
    if name == "flexgen":  # nothing is lost in the PiKVCache: it decodes as the uncompressed cache
        plain = model.generate(
            prompt(T, seed=3), past_key_values=_cache(model), max_new_tokens=NEW + 1, do_sample=False
        )
        assert torch.equal(b, plain)
    else:
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
@pytest.mark.parametrize("name", ["h2o", "streaming_llm", "lru_plus", "adakv", "quest"])
def test_press_in_kvpress_pipeline(name, arch):
    ref, model = model_pair(arch)
    context = "The quick brown fox jumps over the lazy dog near the river bank at dawn. " * 2
    questions = ["Who jumps?"] if name == "quest" else ["Who jumps?", "Where?"]  # kvpress: one question per decoder
    answers = []
    for m, cache in ((ref, DynamicCache()), (model, _cache(model))):
        pipe = pipeline("kv-press-text-generation", model=m, tokenizer=byte_tokenizer(), device="cpu")
        answers.append(pipe(context, questions=questions, press=_press(name, arch), cache=cache, max_new_tokens=5))
    assert answers[0] == answers[1]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", ["h2o", "streaming_llm", "lru", "lru_plus", "flexgen", "adakv"])
def test_decode_time_budget_holds_every_step(name, arch):
    _, model = model_pair(arch)
    budget = 40
    press = DecodingBudgetPress(_press(name, arch, 0.0), target_size=budget)
    cache = _cache(model)
    held_per_step = []

    def track(module, args, output):  # per step: the most any (row, head) holds, or any row's total for AdaKV
        held = _per_head(cache)
        held_per_step.append(max(int(h.sum(-1).max() / h.shape[-1] if name == "adakv" else h.max()) for h in held))

    handle = model.register_forward_hook(track)
    try:
        with press(model):
            model.generate(prompt(30, seed=2), past_key_values=cache, max_new_tokens=25, do_sample=False)
    finally:
        handle.remove()
    heads = cache.layers[0].store.heads
    assert held_per_step[0] == 30 and max(held_per_step[1:]) == budget  # prefill untouched, then never over
    # (AdaKV spreads a row's budget of heads * target_size over its heads, so it is checked per row)
    for layer, held in zip(cache.layers, _per_head(cache), strict=True):
        assert int(layer.store.frame("pos").max()) == 30 + 24 - 1 + 1 - 1  # the newest token is still there
        assert int(held.sum()) == heads * budget if name == "adakv" else bool((held == budget).all())


# ---------------------------------------------------------------------- kept tokens against independent scores
_CAPTURED: dict = {}


def _capture(module, query, key, value, attention_mask, **kwargs):
    _CAPTURED[module.layer_idx] = (query.detach().clone(), key.detach().clone())
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _captured_layer0(arch: str, ids: torch.Tensor):
    """Post-RoPE queries ``[Hq, T, D]`` and keys ``[H, T, D]`` of layer 0 on ``ids``, read from the attention call."""
    AttentionInterface.register("capture_qk", _capture)
    model = tiny_model(arch, seed=0)
    model.set_attn_implementation("capture_qk")
    with torch.no_grad():
        model(ids)
    query, key = _CAPTURED[0]
    return query[0].double(), key[0].double(), model.model.layers[0].self_attn.scaling


def _naive_statistics(query, key, scale):
    """Per KV head and key: summed probability, hits, last hitting query; loops over queries."""
    hq, t, _ = query.shape
    h = key.shape[0]
    g = hq // h
    mass, hits, last = torch.zeros(h, t, dtype=torch.float64), torch.zeros(h, t), torch.full((h, t), -1.0)
    for i in range(t):
        for kv in range(h):
            prob = sum(
                ((query[kv * g + j, i] @ key[kv, : i + 1].T) * scale).softmax(-1) for j in range(g)
            )  # the query heads of this KV head, summed
            mass[kv, : i + 1] += prob
            hit = prob > g / (i + 1)
            hits[kv, : i + 1] += hit
            last[kv, : i + 1][hit] = i
    return mass, hits, last


def _kept_positions(cache: PiKVCache) -> list[set]:
    view = cache.layers[0].view_index()
    return [set(view.pos[0, h][view.pos[0, h] >= 0].tolist()) for h in range(view.pos.shape[1])]


@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe", "llama"])
@pytest.mark.parametrize("name", ["h2o", "lru", "lru_plus", "streaming_llm"])
def test_kept_tokens_follow_an_independent_score(name, arch):
    t = 24
    ids = prompt(t, seed=11)
    query, key, scale = _captured_layer0(arch, ids)
    assert torch.allclose(query, _queries_from_press_helper(arch, ids), atol=1e-5)
    mass, hits, last = _naive_statistics(query, key, scale)
    n_kept = compute_n_kept(t, R)
    pos = torch.arange(t, dtype=torch.float64)
    expected = []
    for kv in range(key.shape[0]):
        if name == "h2o":
            n_recent = int(0.5 * n_kept)
            score = torch.where(pos >= t - n_recent, 1e9 + pos, mass[kv])
        elif name == "lru":
            score = torch.maximum(last[kv], pos) + pos / (2 * t)
        elif name == "lru_plus":
            score = (
                0.5 * torch.maximum(last[kv], pos) / (t - 1) + 0.5 * hits[kv] / hits[kv].max() + pos * 1e-9 / (t - 1)
            )
        else:
            score = torch.where(pos < 2, float("inf"), pos)
        score[-1] = float("inf")
        expected.append(set(score.topk(n_kept).indices.tolist()))
    _, model = model_pair(arch)
    cache = _cache(model)
    press = {
        "h2o": H2OPress(R),
        "lru": LRUPress(R),
        "lru_plus": LRUPlusPress(R),
        "streaming_llm": StreamingLLMPress(R, n_sink=2),
    }
    with torch.no_grad(), press[name](model):
        model(ids, past_key_values=cache)
    assert _kept_positions(cache) == expected


def _queries_from_press_helper(arch: str, ids: torch.Tensor) -> torch.Tensor:
    """Layer 0's queries as ``model_queries`` recomputes them from the layer input."""
    model = tiny_model(arch, seed=0)
    seen = {}
    handle = model.model.layers[0].self_attn.register_forward_hook(
        lambda m, a, kw, out: seen.update(q=model_queries(m, kw["hidden_states"], kw)), with_kwargs=True
    )
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    return seen["q"][0].double()


@pytest.mark.parametrize("arch", ["gpt_oss", "mixtral"])
def test_model_queries_equal_the_attention_inputs(arch):
    ids = prompt(20, seed=12)
    query, _, _ = _captured_layer0(arch, ids)
    assert torch.allclose(_queries_from_press_helper(arch, ids), query, atol=1e-5)


@pytest.mark.parametrize(
    "build",
    [
        lambda: AdaKVPress(H2OPress(R)),
        lambda: AdaKVPress(kvpress.KnormPress(0.9), alpha_safeguard=0.5),
        lambda: PyramidPress(0.9, scorer=kvpress.KnormPress(), slope=0.0),
        lambda: PyramidPress(0.8, scorer=LRUPress(), slope=0.5),
    ],
    ids=["adakv_h2o", "adakv_knorm", "pyramid_knorm", "pyramid_lru"],
)
def test_head_wise_budgets_keep_what_kvpress_masks_and_free_it(build):
    """AdaKV and Pyramid keep in a PiKVCache the tokens they leave unmasked on a DynamicCache (kvpress's
    ``masked_key_indices``), and decode alike: what the scores rank first is kept, nothing more is forced in (a kvpress
    scorer such as Knorm may drop the newest prompt token; H2O and LRU keep it by their own scores). The PiKVCache
    once forced the newest token in: logits off by up to 0.49 at 90% compression with Knorm."""
    ref, model = model_pair("llama")
    ids, tokens = prompt(T, seed=3), prompt(3, seed=4)
    dynamic, cache = DynamicCache(), _cache(model)
    with torch.no_grad(), build()(ref):
        ref(ids, past_key_values=dynamic)
        masked = ref.model.layers[0].self_attn.masked_key_indices  # (batch, head, seq) kvpress fakes at decode
        at = [torch.tensor([[T + i]]) for i in range(3)]
        want = [
            ref(tokens[:, i : i + 1], past_key_values=dynamic, position_ids=p, cache_position=p[0]).logits[0, -1]
            for i, p in enumerate(at)
        ]
    with torch.no_grad(), build()(model):
        model(ids, past_key_values=cache)
        dropped = [set(range(T)) - kept for kept in _kept_positions(cache)]
        got = [model(tokens[:, i : i + 1], past_key_values=cache).logits[0, -1] for i in range(3)]
    assert dropped == [set(masked[2][masked[1] == h].tolist()) for h in range(2)]
    assert max((a - b).abs().max().item() for a, b in zip(want, got, strict=True)) < 1e-4


def test_duo_attention_budgets_and_saved_heads(tmp_path):
    scores = [0.3, 0.01, 0.5, 0.02]
    budgets = head_budgets(scores, 100, 60, 5)
    assert sum(budgets) == 4 * 60 and budgets[0] == budgets[2] == 100 and budgets[1] + budgets[3] == 40
    ref, model = model_pair("llama")
    path = tmp_path / "heads.json"
    save_heads(calibrate_heads(ref, prompt(T, seed=7), n_sink=2, window=8), path)
    assert load_heads(path, model) == _heads("llama")
    other = tiny_model("llama", seed=1)
    with pytest.raises(ValueError, match="calibrated on another model"):
        DuoAttentionPress(0.5, heads=str(path)).post_init_from_model(other)


# ---------------------------------------------------------------------- offload tier
@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_offloaded_tokens_are_read_back_and_counted(target, shipped_sparse_from):
    _, model = model_pair("mixtral")
    ids = prompt(T, seed=3)
    plain = model.generate(ids, past_key_values=_cache(model), max_new_tokens=6, do_sample=False,
                           output_logits=True, return_dict_in_generate=True)  # fmt: skip
    cache = _cache(model)
    with FlexGenPress(R, offload=target)(model):
        out = model.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(out.sequences, plain.sequences)
    assert max((a - b).abs().max() for a, b in zip(out.logits, plain.logits, strict=True)) < 1e-5
    assert cache.layers[0].tiers["offload"].device.type == "cpu"
    whole = _cache(model)
    with torch.no_grad():
        model(ids, past_key_values=whole)
    # resident bytes: the recent half (+ partly filled pages, and the page a decode append reserves ahead: 1 of 10
    # here); the other half is held by the offload tier
    held = cache.kv_nbytes() - sum(layer.empty_nbytes() for layer in cache.layers)  # bytes of the tokens held
    assert held < 0.6 * whole.kv_nbytes() and cache.kv_nbytes() <= 0.7 * whole.kv_nbytes()
    assert cache.offloaded_nbytes() >= 0.4 * whole.kv_nbytes()
    # routed reads over both tiers: offloaded shards selected count as misses and their bytes as fetched
    routed = _cache(model)
    with FlexGenPress(R, offload=target)(model):
        model(ids, past_key_values=routed)
    routed.set_attention("routed", top_k_shards=2, n_sink=2, window=8, selector="cache_aware")
    with torch.no_grad():
        for step in range(3):
            model(prompt(1, seed=step), past_key_values=routed)
    stats = routed.routing_stats()["overall"]
    # far below sparse_from, the layers holding offloaded tokens still read sparsely (no fetch of the whole tier)
    assert stats["sparse_layer_steps"] == stats["layer_steps"] > 0
    assert stats["fraction_tokens_attended"] < 1.0 and stats["bytes_fetched_per_decode_step"] > 0
    # selected shards that held offloaded pages count as misses (what the cache-aware selector penalises)
    assert sum(int(layer.policy.misses.sum()) for layer in routed.layers) > 0


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: H2OPress(1.0), "compression_ratio must be a number in \\[0, 1\\)"),
        (lambda: LRUPress(-0.1), "compression_ratio must be a number in \\[0, 1\\)"),
        (lambda: H2OPress(0.5, recent_ratio=2), "recent_ratio must be a number in \\[0, 1\\]"),
        (lambda: StreamingLLMPress(0.5, n_sink=-1), "n_sink must be an integer >= 0"),
        (lambda: FlexGenPress(0.5, offload="tape"), "offload must be None or one of cpu, disk"),
        (lambda: DecodingBudgetPress(H2OPress(), target_size=0), "target_size must be an integer >= 1"),
        (lambda: DecodingBudgetPress(StreamingLLMPress(n_sink=8), target_size=8), "target_size must exceed"),
        (lambda: QuestPress(compression_ratio=0.5, page_size=0), "page_size must be an integer >= 1"),
        (lambda: H2OPress(0.5, shard_budget="even"), "shard_budget must be one of global, proportional"),
        (lambda: AdaKVPress(H2OPress(0.5), alpha_safeguard=2), "alpha_safeguard must be a number in \\[0, 1\\], got 2"),
        (lambda: AdaKVPress(H2OPress(0.5), alpha_safeguard=float("nan")), "alpha_safeguard must be a number in"),
        (lambda: DecodingBudgetPress(H2OPress(), hidden_states_buffer_size=-1), "hidden_states_buffer_size must be"),
        (lambda: DuoAttentionPress(0.5, heads="/no/such/heads.json"), "heads must be a file written by save_heads"),
    ],
)
def test_bad_arguments(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize("n_sink", [0, 2])
def test_decode_budget_by_index_on_a_dynamic_cache_keeps_position_order(n_sink):
    """DecodingBudgetPress over a press that scores by index, on a DynamicCache (kvpress's DecodingPress): each cut
    keeps the pairs in position order, so the next cut's sinks / recent window are the right tokens and every step
    equals the same press on a PiKVCache (kvpress gathered them in score order: the DynamicCache then kept stale
    prompt tokens and evicted the newest, logits off by up to 0.26)."""
    ref, model = model_pair("llama")
    ids, tokens = prompt(16, seed=3), prompt(5, seed=4)
    dynamic, cache = DynamicCache(), PiKVCache(model, page_size=16)
    with torch.no_grad():
        with DecodingBudgetPress(StreamingLLMPress(n_sink=n_sink), target_size=8)(ref):
            ref(ids, past_key_values=dynamic)
            at = [torch.tensor([[16 + i]]) for i in range(5)]  # a cut DynamicCache's length is no position
            want = [
                ref(tokens[:, i : i + 1], past_key_values=dynamic, position_ids=at[i], cache_position=at[i][0])
                .logits[0, -1]
                for i in range(5)
            ]
        with DecodingBudgetPress(StreamingLLMPress(n_sink=n_sink), target_size=8)(model):
            model(ids, past_key_values=cache)
            got = [model(tokens[:, i : i + 1], past_key_values=cache).logits[0, -1] for i in range(5)]
    assert max((a - b).abs().max().item() for a, b in zip(want, got, strict=True)) < 1e-4


def test_decode_budget_h2o_on_a_dynamic_cache_scores_with_the_queries_the_steps_used():
    """DecodingBudgetPress(H2OPress) on a DynamicCache (kvpress's DecodingPress): at every cut, H2O's mass of each
    key is the mass the buffered steps' real queries (captured from the attention calls) gave it. After the first cut
    the queries were rotated at the cut cache's index positions instead of their own (mass off by 0.01, another
    token kept)."""
    base, cuts, queries = H2OPress(0.0, recent_ratio=0.0), [], []

    def capture(module, query, *args, **kwargs):
        if module.layer_idx == 0 and query.shape[2] == 1:
            queries.append(query[0].double())  # [Hq, 1, D]
        return sdpa_attention_forward(module, query, *args, **kwargs)

    AttentionInterface.register("capture_steps", capture)
    model = tiny_model("llama", seed=0)
    model.set_attn_implementation("capture_steps")
    score = base.score

    def spy(module, hidden_states, keys, values, attentions, kwargs):
        out = score(module, hidden_states, keys, values, attentions, kwargs)
        if module.layer_idx == 0:
            cuts.append((keys[0].double(), out[0].double(), len(queries), hidden_states.shape[1]))
        return out

    base.score = spy
    t0, cache = 40, DynamicCache()
    with torch.no_grad(), DecodingBudgetPress(base, target_size=12, compression_interval=4)(model):
        model(prompt(t0), past_key_values=cache)
        for s in range(8):
            p = torch.tensor([t0 + s])
            model(torch.tensor([[5 + s]]), past_key_values=cache, cache_position=p, position_ids=p.view(1, 1))
    assert [(k.shape[1], n) for k, _, _, n in cuts] == [(44, 4), (16, 4)]
    scale, g = model.model.layers[0].self_attn.scaling, model.config.num_attention_heads // 2
    for keys, got, seen, n in cuts:
        t = keys.shape[1]
        q = torch.cat(queries[seen - n : seen], 1)  # [Hq, n, D]
        logits = q @ keys.repeat_interleave(g, 0).transpose(-1, -2) * scale
        causal = torch.arange(t) <= torch.arange(t - n, t).view(-1, 1)  # the queries are the last n keys' tokens
        want = logits.masked_fill(~causal, float("-inf")).softmax(-1).view(-1, g, n, t).sum((1, 2))
        torch.testing.assert_close(got[:, :-1], want[:, :-1], rtol=1e-4, atol=1e-5)  # the newest key is forced in


def test_query_scoring_press_after_a_cut_on_a_dynamic_cache_is_refused():
    """H2O / LRU / LRU+ second in a ComposedPress on a DynamicCache: the first press removed some of the prefill's
    own keys, whose positions the cache does not keep; refused naming the press (an IndexError from an empty
    reduction before)."""
    ref, _ = model_pair("llama")
    for second in (LRUPress(0.5), H2OPress(0.5)):
        press = kvpress.ComposedPress([kvpress.StreamingLLMPress(0.75, n_sink=2), second])
        with pytest.raises(ValueError, match=f"{type(second).__name__}: the layer holds 29 keys for the 118 queries"):
            with torch.no_grad(), press(ref):
                ref(prompt(118), past_key_values=DynamicCache())


def test_streaming_llm_budget_below_its_sinks_keeps_the_earliest_sinks_on_both_caches():
    """37 tokens at ratio 0.9 keep 3 per head, fewer than ``n_sink=4``: both caches keep positions 0-2 and decode the
    same logits (every sink scored +inf, kvpress's topk and PiKV's stable sort kept different sinks, logits off by
    up to 1)."""
    ref, model = model_pair("llama")
    ids, tokens = prompt(37, seed=0), prompt(4, seed=5)
    dynamic, cache = DynamicCache(), PiKVCache(model, num_shards=1, page_size=4)
    with torch.no_grad():
        with StreamingLLMPress(0.9, n_sink=4)(ref):
            ref(ids, past_key_values=dynamic)
        with StreamingLLMPress(0.9, n_sink=4)(model):
            model(ids, past_key_values=cache)
        view = cache.layers[0].view()
        assert view.pos[view.valid].view(-1, 3).eq(torch.arange(3)).all() and dynamic.layers[0].keys.shape[2] == 3
        at = [torch.tensor([[37 + i]]) for i in range(4)]  # a cut DynamicCache's length is no position
        want, got = [], []
        for i in range(4):
            step = dict(input_ids=tokens[:, i : i + 1], position_ids=at[i], cache_position=at[i][0])
            want.append(ref(**step, past_key_values=dynamic).logits[0, -1])
            got.append(model(**step, past_key_values=cache).logits[0, -1])
    assert max((a - b).abs().max().item() for a, b in zip(want, got, strict=True)) < 1e-4


@pytest.mark.parametrize("ratio", [1.0, -0.5])
@pytest.mark.parametrize("build", [lambda: H2OPress(0.5), lambda: AdaKVPress(H2OPress(0.5)),
                                   lambda: PyramidPress(0.5, scorer=H2OPress(), slope=0.5)])  # fmt: skip
def test_a_ratio_set_after_construction_is_checked_before_the_cache_changes(build, ratio):
    """kvpress's evaluation loops set ``press.compression_ratio`` on a built press: entering the press checks it again
    (1.0 emptied every layer through AdaKV, -0.5 kept everything, and PyramidPress's budgets never returned)."""
    model = tiny_model("llama", seed=0)
    cache, press = PiKVCache(model), build()
    press.compression_ratio = ratio
    with pytest.raises(ValueError, match="compression_ratio must be a number in \\[0, 1\\)"):
        with press(model):
            model(prompt(12), past_key_values=cache)
    assert cache.get_seq_length() == 0
    with pytest.raises(ValueError, match="compression_ratio must be a number in \\[0, 1\\)"):
        pyramid_budgets(37, 3, ratio, 0.5)


@pytest.mark.parametrize(
    ("build", "field", "value", "message"),
    [
        (lambda: H2OPress(0.5), "recent_ratio", 2, "recent_ratio must be a number in \\[0, 1\\]"),
        (lambda: LRUPlusPress(0.5), "frequency_weight", -1, "frequency_weight must be a number in \\[0, 1\\]"),
        (lambda: StreamingLLMPress(0.5), "n_sink", -1, "n_sink must be an integer >= 0"),
        (lambda: PyramidPress(0.5), "slope", 2, "slope must be a number in \\[0, 1\\]"),
        (lambda: FlexGenPress(0.5), "offload", "tape", "offload must be None or one of cpu, disk"),
        (lambda: DecodingBudgetPress(H2OPress(), target_size=8), "target_size", 0, "target_size must be an integer"),
        (lambda: DuoAttentionPress(0.5, heads=[[0.1, 0.2]] * 3), "n_sink", -2, "n_sink must be an integer >= 0"),
        (lambda: QuestPress(0.5), "page_size", 0, "page_size must be an integer >= 1"),
        (lambda: QuantPress(bits=4, group_size=16), "window", -1, "window must be an integer >= 0"),
        (lambda: QuantPress(bits=4, group_size=16), "bits", 3, "bits must be one of"),
        (lambda: ChannelPrunePress(channel_ratio=0.5), "channel_ratio", 1.0, "channel_ratio must be a number in"),
        (lambda: H2OPress(0.5), "shard_budget", "even", "shard_budget must be one of global, proportional"),
    ],
)  # fmt: skip
def test_a_field_set_after_construction_is_checked_before_the_cache_changes(build, field, value, message):
    """Every field is checked again on entering the press, before any forward stores anything (a QuantPress window
    set to -1 compressed the newest token; a channel_ratio of 1.0 failed inside a forward with a reshape error)."""
    model = tiny_model("llama", seed=0)
    cache, press = PiKVCache(model), build()
    setattr(press, field, value)
    with pytest.raises(ValueError, match=message):
        with press(model):
            model(prompt(12), past_key_values=cache)
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize(
    ("wrap", "message"),
    [
        (lambda p: kvpress.ComposedPress([kvpress.KnormPress(0.2), p]), "compression_ratio must be a number in"),
        (lambda p: kvpress.PerLayerCompressionPress(p, compression_ratios=[0.5] * 3), "recent_ratio must be"),
        (lambda p: DecodingBudgetPress(p, target_size=8), "recent_ratio must be a number in"),
        (lambda p: AdaKVPress(p), "recent_ratio must be a number in"),
        (lambda p: kvpress.KeyRerotationPress(p), "recent_ratio must be a number in"),
    ],
)  # fmt: skip
def test_a_field_of_a_wrapped_press_is_checked_on_entering_the_wrapper(wrap, message):
    """A press inside a wrapper (kvpress's, which calls its hook directly, or pikv_hf's) is checked on entering the
    wrapper as when entered alone: a ratio of 1.5 set on it emptied every layer, a NaN recent_ratio ran silently."""
    model = tiny_model("llama", seed=0)
    inner = H2OPress(0.5)
    press = wrap(inner)
    if "compression_ratio" in message:
        inner.compression_ratio = 1.5
    else:
        inner.recent_ratio = float("nan")
    cache = PiKVCache(model)
    with pytest.raises(ValueError, match=message):
        with press(model):
            model(prompt(12), past_key_values=cache)
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda n: FlexGenPress(0.5), "FlexGenPress removes keys, which the sliding-window layers of this Dynamic"),
        (lambda n: DecodingBudgetPress(H2OPress(), target_size=8), "DecodingBudgetPress removes keys"),
        (lambda n: DuoAttentionPress(0.5, heads=[[0.1, 0.9]] * n), "DuoAttentionPress masks the dropped keys on a "
         "DynamicCache through kvpress's attention patch, which attn_implementation='eager' does not go through"),
        (lambda n: PyramidPress(0.5, scorer=kvpress.KnormPress()), "PyramidPress masks the dropped keys"),
        (lambda n: AdaKVPress(kvpress.KnormPress(0.5)), "AdaKVPress masks the dropped keys"),
        # inside kvpress wrappers that hand them the layer (they call its hook: nothing was checked, and H2O failed
        # at decode with a size mismatch, Pyramid was a silent no-op)
        (lambda n: kvpress.ChunkPress(H2OPress(0.5), chunk_length=16), "H2OPress removes keys"),
        (lambda n: kvpress.ComposedPress([PyramidPress(0.5, scorer=kvpress.KnormPress())]),
         "PyramidPress masks the dropped keys"),
    ],
)  # fmt: skip
def test_presses_a_dynamic_cache_cannot_take_are_refused_before_it_changes(build, message):
    """GPT-OSS (eager attention, sliding-window layers in a DynamicCache built from its config): a press that removes
    keys failed inside the forward with a mask size mismatch, and one that masks them through kvpress's attention
    patch (which eager attention does not take) silently kept every key; both are refused before layer 0 stores."""
    model = tiny_model("gpt_oss", seed=0)
    cache = DynamicCache(config=model.config)
    with pytest.raises(ValueError, match=message), build(model.config.num_hidden_layers)(model):
        model(prompt(40), past_key_values=cache)
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize(
    ("heads", "message"),
    [
        ([[float("nan"), 0.2]] * 3, "heads must hold numbers in \\[0, 1\\].*got \\[nan, 0.2\\] for layer 0"),
        ([["high", "low"]] * 3, "heads must hold numbers in \\[0, 1\\]"),
        ([[-5.0, -7.0]] * 3, "heads must hold numbers in \\[0, 1\\]"),
        ("corrupt", "heads must be a file written by save_heads, got .* \\(not JSON"),
    ],
)  # fmt: skip
def test_duo_attention_head_scores_are_checked_before_the_cache_changes(heads, message, tmp_path):
    """NaN scores were taken (a NaN sorts as lowest or highest by its place: which heads streamed depended on it),
    strings failed inside the forward at layer 1 naming nothing, and a corrupt file raised a bare JSONDecodeError."""
    model = tiny_model("llama", seed=0)
    if heads == "corrupt":
        heads = tmp_path / "heads.json"
        heads.write_text("{not json")
    cache = PiKVCache(model)
    with pytest.raises(ValueError, match=message):
        with DuoAttentionPress(0.5, heads=heads)(model):
            model(prompt(24), past_key_values=cache)
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize(
    ("input_ids", "message"),
    [
        (torch.arange(3, 43).view(1, -1), "input_ids must hold more than n_sink \\+ window = 68 tokens .*got 40"),
        (torch.rand(1, 80), "input_ids must be an integer tensor \\[B, T\\] of token ids, got \\(1, 80\\)"),
        (torch.arange(3, 83), "input_ids must be an integer tensor \\[B, T\\] of token ids, got \\(80,\\)"),
    ],
)  # fmt: skip
def test_calibrate_heads_refuses_input_it_cannot_score(input_ids, message):
    """A text no longer than the sinks and window gave all-NaN scores without an error; float or 1-D ids failed
    deep inside the model naming no argument."""
    with pytest.raises(ValueError, match=message):
        calibrate_heads(tiny_model("llama", seed=0), input_ids)


def test_unsupported_model_is_refused_before_the_cache_changes():
    model = tiny_model("deepseek_v3", seed=0)
    cache = PiKVCache(model)
    with pytest.raises(ValueError, match="query path .* is not supported"):
        with H2OPress(0.5)(model):
            model(prompt(12), past_key_values=cache)
    assert cache.get_seq_length() == 0 and math.isclose(cache.kv_nbytes(), 0)


def test_quest_press_pages_a_left_padded_row_from_its_first_token_on_both_caches():
    """On a DynamicCache Quest's pages and sinks started at position 0, padding included: a left-padded row of a batch
    decoded 0.72 logits off the same row alone. Now its pages start at the row's first real token, as a PiKVCache's:
    each row of the batch gives what it gives alone, on both caches."""
    ref, model = model_pair("llama")
    lengths, width = [9, 21, 14], 21
    rows = [prompt(n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    ids, mask = torch.zeros(3, width, dtype=torch.long), torch.zeros(3, width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1

    def run(m, make, x, attention_mask=None):
        with QuestPress(0.5, page_size=4, n_sink=1, window=2)(m):
            return generate(m, x, make(), attention_mask=attention_mask, max_new_tokens=6).logits

    for m, make in ((ref, DynamicCache), (model, lambda: PiKVCache(model, page_size=4, num_shards=1, sparse_from=0))):
        batch = run(m, make, ids, mask)
        for i, row in enumerate(rows):
            alone = run(m, make, row[None])
            assert max_logit_diff([a[0] for a in alone], [b[i] for b in batch]) < 1e-5, (make, i)


def test_quest_press_below_sparse_from_warns_and_reads_densely(shipped_sparse_from):
    """Below the cache's ``sparse_from`` (shipped: 4096) a QuestPress on a PiKVCache reads every page: the output is
    the uncompressed cache's and the press says so, once, naming ``sparse_from``; with ``sparse_from=0`` it applies
    (the output is QuestPress's on a DynamicCache) and says nothing."""
    ref, model = model_pair("llama")
    press = QuestPress(compression_ratio=0.75, page_size=PAGE, n_sink=1, window=2)
    ids = prompt(T, seed=3)
    plain = generate(model, ids, PiKVCache(model, page_size=PAGE), max_new_tokens=NEW).logits
    with press(ref):
        quest = generate(ref, ids, DynamicCache(), max_new_tokens=NEW).logits
    assert max_logit_diff(plain, quest) > 1e-3  # the press changes the logits where it applies
    with pytest.warns(UserWarning, match="sparse_from=4096 positions") as caught, press(model):
        dense = generate(model, ids, PiKVCache(model, page_size=PAGE), max_new_tokens=NEW).logits
    assert max_logit_diff(dense, plain) < 1e-5
    assert sum("QuestPress" in str(w.message) for w in caught) == 1
    with warnings.catch_warnings(), press(model):
        warnings.simplefilter("error")
        sparse = generate(model, ids, PiKVCache(model, page_size=PAGE, sparse_from=0), max_new_tokens=NEW).logits
    assert max_logit_diff(sparse, quest) < 1e-5


@pytest.mark.parametrize("seed", range(6))
def test_attention_statistics_over_ragged_layouts_equal_a_dense_reference(seed, monkeypatch):
    """``attention_statistics`` (query chunks, the keys every query of a chunk sees left unmasked, the normalisation
    folded into the sums) against a float64 loop over every query: evicted gaps, left padding (keys invalid, queries
    taking no part), sliding windows, a query that sees nothing, many chunks."""
    from types import SimpleNamespace

    from pikv_hf.presses import queries as queries_mod

    gen = torch.Generator().manual_seed(seed)
    b, h, g, d, n = 2, 2, 3, 8, 12
    t = n + int(torch.randint(0, 6, (1,), generator=gen))
    window = [None, 5][seed % 2]
    pos = torch.full((b, h, t), -1)
    valid = torch.zeros(b, h, t, dtype=torch.bool)
    first = t - n  # positions of the context before these queries: 0 .. t - 1, the queries the last n of them
    query_pos = torch.arange(first, t)
    query_ok = torch.ones(b, n, dtype=torch.bool)
    query_ok[1, : 2 + seed % 3] = False  # row 1 is left padded
    for row in range(b):
        for head in range(h):
            kept = torch.sort(torch.randperm(t, generator=gen)[: t - int(torch.randint(0, 4, (1,), generator=gen))])
            kept = kept.values
            if row == 1:
                kept = kept[kept >= first + 2 + seed % 3]  # the padding's keys are not stored
            pos[row, head, : kept.numel()] = kept
            valid[row, head, : kept.numel()] = True
    keys = torch.randn(b, h, t, d, generator=gen)
    query = torch.randn(b, h * g, n, d, generator=gen) * 2
    module = SimpleNamespace(scaling=0.3, sliding_window=window)
    monkeypatch.setattr(queries_mod, "model_queries", lambda *args: query)
    layout = queries_mod.KeyLayout(pos, valid, query_pos, query_ok)
    hidden = torch.zeros(b, n, 1)  # a tiny input: chunks of one or two queries
    got = queries_mod._attention_statistics(module, hidden, keys, {}, True, layout)
    mass_only = queries_mod._attention_statistics(module, hidden, keys, {}, False, layout)

    mass = torch.zeros(b, h, t, dtype=torch.float64)
    hits = torch.zeros(b, h, t, dtype=torch.int64)
    last = torch.full((b, h, t), -1)
    for row in range(b):
        for head in range(h):
            for i in range(n):
                qp = int(query_pos[i])
                see = valid[row, head] & (pos[row, head] <= qp) & bool(query_ok[row, i])
                if window:
                    see &= pos[row, head] > qp - window
                if not see.any():
                    continue
                scores = query[row, head * g : (head + 1) * g, i].double() @ keys[row, head, see].double().T * 0.3
                prob = scores.softmax(-1).sum(0)
                mass[row, head, see] += prob
                hit = prob > g / int(see.sum())
                idx = see.nonzero().squeeze(1)[hit]
                hits[row, head, idx] += 1
                last[row, head, idx] = qp
    assert torch.allclose(got.mass.double(), mass, atol=1e-5)
    assert torch.allclose(mass_only.mass.double(), mass, atol=1e-5)
    assert torch.equal(got.hits, hits) and torch.equal(got.last_hit, last)


def test_a_decoding_budget_with_a_compressed_tier_is_refused():
    """The budget cuts the hot store: tokens a compressor moved into its tier are resident and read but were not
    counted, so each (row, KV head) grew to 69 tokens under target_size=20, silently."""
    model = tiny_model("llama", seed=0)
    ids = prompt(40)
    cache = PiKVCache(model, page_size=4)
    budget = DecodingBudgetPress(StreamingLLMPress(n_sink=2), target_size=20)
    with budget(model), QuantPress(bits=4, group_size=8, window=8)(model):
        with pytest.raises(ValueError, match="also holds tokens in tier\\(s\\) \\['compressed'\\] .* cannot cut"):
            model.generate(ids, past_key_values=cache, max_new_tokens=30, do_sample=False)
