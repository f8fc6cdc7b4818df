"""transformers-native behaviour: the "pikv" attention leaves every other computation alone, layer K/V views, the
Cache contract extras (iteration, offload, sliding flags), kvpress's pipeline, torch.compile and torch.export."""

import contextlib

import kvpress
import pytest
import torch
import torch._dynamo as dynamo
from helpers import TOL, DynamicCache, byte_tokenizer, generate, max_logit_diff, prompt
from transformers import StaticCache, pipeline

from pikv_hf import PiKVCache
from pikv_hf.presses import H2OPress, QuantPress
from pikv_hf.tiny import tiny_model


def _eager(arch: str):
    model = tiny_model(arch, seed=0)
    model.set_attn_implementation("eager")
    return model


def _twins(arch: str):
    """(untouched model, identical model that a PiKVCache attached), both built from the same seed."""
    ref, model = tiny_model(arch, seed=0), tiny_model(arch, seed=0)
    PiKVCache(model)
    return ref, model


CALLS = {
    "static cache": lambda m: dict(past_key_values=StaticCache(config=m.config, max_cache_len=32)),
    "no cache": lambda m: dict(use_cache=False),
    "packed sequences": lambda m: dict(
        use_cache=False, position_ids=torch.cat([torch.arange(8), torch.arange(12)])[None]
    ),
    "4-D mask": lambda m: dict(
        use_cache=False, attention_mask=torch.tril(torch.ones(20, 20, dtype=torch.bool))[None, None]
    ),
    "output_attentions": lambda m: dict(past_key_values=DynamicCache(), output_attentions=True),
}


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
@pytest.mark.parametrize("call", sorted(CALLS))
def test_attached_model_computes_other_caches_exactly_as_before(arch, call):
    ref, model = _twins(arch)
    ids = prompt(20)
    with torch.no_grad():
        a, b = ref(ids, **CALLS[call](ref)), model(ids, **CALLS[call](model))
    assert torch.equal(a.logits, b.logits)
    assert len(a.attentions or ()) == len(b.attentions or ())
    for x, y in zip(a.attentions or (), b.attentions or (), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
@pytest.mark.parametrize("implementation", ["static", "sliding_window", "hybrid_chunked"])
def test_attached_model_generates_with_other_cache_implementations(arch, implementation):
    ref, model = _twins(arch)
    ids = prompt(20)
    kw = dict(max_new_tokens=4, do_sample=False, cache_implementation=implementation, pad_token_id=0)
    assert torch.equal(ref.generate(ids, **kw), model.generate(ids, **kw))


def test_detach_and_context_manager_restore_the_previous_attention():
    model = _eager("llama")
    cache = PiKVCache(model)
    assert model.config._attn_implementation == "pikv"
    cache.detach()
    assert model.config._attn_implementation == "eager"
    with PiKVCache(model) as cache:
        assert model.config._attn_implementation == "pikv"
        out = generate(model, prompt(12), cache)
    assert model.config._attn_implementation == "eager"
    ref = generate(_eager("llama"), prompt(12), DynamicCache())
    assert torch.equal(out.sequences, ref.sequences)


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_output_attentions_and_custom_4d_mask_with_a_pikv_cache(arch):
    ref, model = _eager(arch), _eager(arch)
    ids = prompt(16)
    mask = torch.tril(torch.ones(16, 16, dtype=torch.bool))
    mask[5:, :3] = False  # a custom pattern: later tokens do not see the first three
    with torch.no_grad():
        a = ref(ids, past_key_values=DynamicCache(), output_attentions=True)
        b = model(ids, past_key_values=PiKVCache(model), output_attentions=True)
        assert (a.logits - b.logits).abs().max() < TOL
        assert all((x - y).abs().max() < 1e-5 for x, y in zip(a.attentions, b.attentions, strict=True))
        eager_mask = torch.zeros(1, 1, 16, 16).masked_fill(~mask, torch.finfo(torch.float32).min)
        c = ref(ids, past_key_values=DynamicCache(), attention_mask=eager_mask)
        cache = PiKVCache(model)
        d = model(ids, past_key_values=cache, attention_mask=eager_mask)
        assert (c.logits - d.logits).abs().max() < TOL
        layer = cache.layers[0]
        layer.evict(layer.store.frame("valid") & (layer.store.frame("pos") != 2))
        with pytest.raises(ValueError, match="custom 4-D attention_mask indexes the positions of a contiguous cache"):
            model(prompt(1, seed=3), past_key_values=cache, attention_mask=torch.zeros(1, 1, 1, 17))


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_output_attentions_of_a_left_padded_batch_are_laid_out_by_position(arch):
    """Column j is position j, as over a DynamicCache (zero at the padding): the weights were over each row's tokens
    packed from its first real one, [2, Hq, 10, 8] where eager over a DynamicCache returns [2, Hq, 10, 10]."""
    ref, model = _eager(arch), _eager(arch)
    ids = prompt(10, batch=2)
    mask = torch.ones_like(ids)
    mask[0, :3] = mask[1, :2] = 0
    cache = PiKVCache(model)
    with torch.no_grad():
        a = ref(ids, attention_mask=mask, past_key_values=(dyn := DynamicCache()), output_attentions=True)
        b = model(ids, attention_mask=mask, past_key_values=cache, output_attentions=True)
        step = dict(attention_mask=torch.cat([mask, mask.new_ones(2, 1)], 1), output_attentions=True)
        c = ref(prompt(1, batch=2, seed=4), past_key_values=dyn, **step)
        d = model(prompt(1, batch=2, seed=4), past_key_values=cache, **step)
    real = mask.bool()[:, None, :, None]  # padding queries see nothing: zeros here, a uniform row over DynamicCache
    for x, y in zip(a.attentions, b.attentions, strict=True):
        assert x.shape == y.shape and torch.where(real, x - y, 0).abs().max() < 1e-5
        assert torch.equal(torch.where(real, 0, y), torch.zeros_like(y))
    assert all((x - y).abs().max() < 1e-5 for x, y in zip(c.attentions, d.attentions, strict=True))


def test_eager_only_press_runs_on_a_pikv_cache():
    # ObservedAttentionPress reads the attention weights that only an eager attention returns
    ref, model = _eager("llama"), _eager("llama")
    press = kvpress.ObservedAttentionPress(compression_ratio=0.5)
    ids = prompt(60, seed=2)
    dyn, cache = DynamicCache(), PiKVCache(model, page_size=4)
    with torch.no_grad():
        with press(ref):
            a = generate(ref, ids, dyn, max_new_tokens=5)
        with press(model):
            b = generate(model, ids, cache, max_new_tokens=5)
    assert torch.equal(a.sequences, b.sequences) and max_logit_diff(a.logits, b.logits) < TOL
    # 50% of the 60 context tokens per KV head, plus the 4 tokens fed back while generating 5
    assert all(int(la.store.tokens_per_shard().sum()) == 2 * (30 + 4) for la in cache.layers)


def test_layer_views_iteration_offload_and_sliding_flags_behave_as_dynamic_cache():
    ref, model = _twins("gpt_oss")
    ids = prompt(30, batch=2)
    dyn, cache = DynamicCache(config=ref.config), PiKVCache(model, router="round_robin", page_size=4)
    with torch.no_grad():
        ref(ids, past_key_values=dyn)
        model(ids, past_key_values=cache)
    assert cache.is_sliding == dyn.is_sliding and any(cache.is_sliding) and not all(cache.is_sliding)
    for (k, v, _), layer, dyn_layer in zip(cache, cache.layers, dyn.layers, strict=True):
        if dyn_layer.is_sliding:  # DynamicCache keeps only the window there; PiKVCache keeps every token
            k, v = k[:, :, -dyn_layer.keys.shape[2] :], v[:, :, -dyn_layer.keys.shape[2] :]
        # equal up to the float noise of a different attention kernel (eager there) in the layers before
        assert (k - dyn_layer.keys).abs().max() < 1e-5 and (v - dyn_layer.values).abs().max() < 1e-5
        assert isinstance(layer.keys, torch.Tensor) and layer.keys.shape[2] == 30
    before = model(prompt(1, batch=2, seed=4), past_key_values=cache.fork()).logits
    for layer in cache.layers:
        layer.offload()
        assert layer.store.pool["keys"].device.type == "cpu"
        layer.prefetch()
    assert torch.equal(model(prompt(1, batch=2, seed=4), past_key_values=cache).logits, before)


def test_kvpress_pipeline_answers_several_questions_like_dynamic_cache():
    for arch in ("llama", "mixtral"):
        ref, model = _twins(arch)
        context = "The quick brown fox jumps over the lazy dog near the river bank at dawn. " * 2
        questions = ["Who jumps?", "Where?", "When?"]
        answers = []
        for m, cache in ((ref, DynamicCache()), (model, PiKVCache(model, page_size=4))):
            pipe = pipeline("kv-press-text-generation", model=m, tokenizer=byte_tokenizer(), device="cpu")
            answers.append(pipe(context, questions=questions, cache=cache, max_new_tokens=6)["answers"])
            assert cache.get_seq_length() == len(context) + 1  # each answer was trimmed off (+1: bos)
        assert answers[0] == answers[1]


def test_pipeline_trims_answers_after_compression_by_position():
    # after compression a PiKVCache stores fewer tokens than it has seen; the answer trim must still cut only answers
    _, model = _twins("llama")
    cache = PiKVCache(model, page_size=4)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=byte_tokenizer(), device="cpu")
    context = "abcdefghij" * 10
    pipe(context, questions=["q1", "q2"], press=kvpress.KnormPress(0.75), cache=cache, max_new_tokens=20)
    for layer in cache.layers:
        assert int(layer.view().pos.max()) <= len(context)  # bos + context (positions 0..100): answers are gone
        assert int(layer.store.tokens_per_shard().sum()) == 2 * 25  # int(25% of 101) per KV head, nothing more


def _decode_fn(model, cache):
    return lambda t, pos: model(t, past_key_values=cache, cache_position=pos).logits


SPARSE_READS = {
    "exact": {},
    "routed": dict(attention="routed", top_k_shards=2, n_sink=2, window=4, num_shards=4, page_size=4),
    # one-token pages: a compiled CPU step reads the plan packed (torch.ops.pikv.packed_read)
    "routed_page1": dict(attention="routed", top_k_shards=2, n_sink=2, window=4, num_shards=4, page_size=1),
    "quest": dict(attention="quest", read_fraction=0.5, n_sink=2, window=4, page_size=4),
}


COMPILED_STEPS, WARMUP_STEPS = 18, 2  # the first compiled step creates the read statistics' counters: one recompile


QUANT_READS = {"4-bit": dict(page_size=8), "quest+4-bit": dict(attention="quest", read_fraction=0.5, page_size=8)}


@pytest.mark.parametrize("read", [*sorted(SPARSE_READS), *QUANT_READS])
def test_decode_step_compiles_once_without_graph_breaks(read):
    # no host read inside a step (plans of fixed width, read statistics as device tensors) and no Python state that
    # dynamo guards on changes from step to step: after the warm-up every step reuses the graph
    model = tiny_model("llama", seed=0)
    options = QUANT_READS.get(read) or SPARSE_READS[read]
    cache = PiKVCache(model, router="key_cluster", max_cache_len=64, **options)
    assert cache.is_compileable
    press = QuantPress(bits=4, group_size=8, window=8) if read in QUANT_READS else contextlib.nullcontext
    with torch.no_grad():
        with press(model):
            model(prompt(20), past_key_values=cache)
        assert ("compressed" in cache.layers[0].tiers) == (read in QUANT_READS)
        reference, probe = cache.fork(), cache.fork()
        dynamo.reset()
        explained = dynamo.explain(_decode_fn(model, probe))(torch.tensor([[5]]), torch.tensor([20]))
        assert explained.graph_break_count == 0 and explained.graph_count == 1
        # one-token pages and a Quest plan over a 4-bit tier (as wide as the frame) are read by an operator that
        # trims them on the CPU
        trims = {"routed_page1": "packed_read", "quest+4-bit": "quant_read"}.get(read)
        assert trims is None or trims in explained.graphs[0].code
        dynamo.reset()
        compiled = torch.compile(_decode_fn(model, cache), backend="aot_eager", fullgraph=True)
        for step in range(COMPILED_STEPS):
            token, pos = torch.tensor([[7 + step]]), torch.tensor([20 + step])
            with torch.compiler.set_stance("fail_on_recompile" if step >= WARMUP_STEPS else "default"):
                got = compiled(token, pos)
            want = model(token, past_key_values=reference, cache_position=pos).logits
            assert (got - want).abs().max() < 1e-5
    assert cache.get_seq_length() == reference.get_seq_length() == 20 + COMPILED_STEPS
    if read not in ("exact", "4-bit"):  # the compiled steps read sparsely, and counted it
        assert cache.routing_stats()["overall"]["sparse_layer_steps"] == COMPILED_STEPS * len(cache.layers)


@pytest.mark.parametrize("read", ["routed", "quest"])
def test_compiled_sparse_step_does_not_recompile_while_a_short_row_fills(read):
    """A left-padded row with fewer real tokens than sinks (2 of 8) beside a long one: its next tokens become sinks
    in the store's special slots as they arrive. Before, the store scanned its whole frame inside every compiled step
    while the row was short, and the step recompiled once the row held its 8 sinks."""
    options = SPARSE_READS[read] | dict(n_sink=8, sparse_from=16)
    model = tiny_model("llama", seed=0)
    cache = PiKVCache(model, router="key_cluster", max_cache_len=96, **options)
    t0 = 40
    ids = prompt(t0, batch=2)
    mask = torch.ones_like(ids)
    mask[1, : t0 - 2] = 0
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
        reference = cache.fork()
        dynamo.reset()
        compiled = torch.compile(
            lambda t, m, p: model(t, attention_mask=m, past_key_values=cache, cache_position=p).logits,
            backend="aot_eager", fullgraph=True,
        )  # fmt: skip
        for step in range(8):  # the short row holds its 8 sinks from step 6 on
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            token, pos = torch.tensor([[7 + step], [9 + step]]), torch.tensor([t0 + step])
            with torch.compiler.set_stance("fail_on_recompile" if step >= WARMUP_STEPS else "default"):
                got = compiled(token, mask, pos)
            want = model(token, attention_mask=mask, past_key_values=reference, cache_position=pos).logits
            assert (got - want).abs().max() < 1e-5
    assert cache.routing_stats()["overall"]["sparse_layer_steps"] == 8 * len(cache.layers)


EXPORTED = {  # (cache options, prefill press, prompt length)
    "exact": ({}, None, 20),
    "4-bit tier": (dict(router="key_cluster", page_size=8), lambda: QuantPress(bits=4, group_size=8, window=8), 20),
    "offload tier": ({}, lambda: H2OPress(0.5, offload="cpu"), 20),
    "key_cluster, fewer tokens than shards": (dict(router="key_cluster", page_size=4), None, 5),
}


@pytest.mark.parametrize("way", list(EXPORTED))
def test_decode_step_exports_and_runs_on_another_cache(way):
    """The exported step reads every store of a layer: a compressed or offload tier a press made was dropped from
    the pytree (logits off by 0.27 / 0.15, no error); a key-cluster cache with centroids still unseeded read a
    flag back to the host while tracing (export failed)."""
    model = tiny_model("llama", seed=0)
    options, press, t = EXPORTED[way]

    class Step(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, token, pos, cache):
            return self.m(token, past_key_values=cache, cache_position=pos).logits

    caches = [PiKVCache(model, max_cache_len=64, **options) for _ in range(3)]
    with torch.no_grad():
        for c in caches:
            with press()(model) if press else contextlib.nullcontext():
                model(prompt(t), past_key_values=c)
        assert bool(caches[0].layers[0].tiers) == (press is not None)
        program = torch.export.export(Step(model), (torch.tensor([[5]]), torch.tensor([t]), caches[0]), strict=False)
        got = program.module()(torch.tensor([[7]]), torch.tensor([t]), caches[1])
        want = model(torch.tensor([[7]]), past_key_values=caches[2], cache_position=torch.tensor([t])).logits
    assert (got - want).abs().max() < 1e-5 and caches[1].get_seq_length() == t + 1


@pytest.mark.parametrize("arch", ["gpt_oss", "llama"])
def test_generate_with_max_cache_len_equals_dynamic_and_static_caches(arch):
    """generate hands a compileable cache prepared masks (on GPT-OSS, sliding and full layers: a dict of them)."""
    ref, model = tiny_model(arch, seed=0), tiny_model(arch, seed=0)
    ids = prompt(30, batch=2, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # row 1: left padding
    kw = dict(attention_mask=mask, max_new_tokens=6)
    with torch.no_grad():
        dynamic = generate(ref, ids, DynamicCache(), **kw)
        static = generate(ref, ids, StaticCache(config=ref.config, max_cache_len=48), **kw)
        got = generate(model, ids, PiKVCache(model, page_size=4, max_cache_len=48), **kw)
    assert torch.equal(got.sequences, dynamic.sequences) and torch.equal(got.sequences, static.sequences)
    assert max_logit_diff(got.logits, dynamic.logits) < TOL
