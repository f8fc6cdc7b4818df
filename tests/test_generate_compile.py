"""``generate`` compiles a ``PiKVCache(max_cache_len=N)`` decode step by itself.

On CUDA transformers' ``generate`` compiles the decode step whenever the cache reports ``is_compileable`` (its
``_valid_auto_compile_criteria``), with ``generation_config.compile_config``. On a CPU it does so only when the compile
configuration says ``_compile_all_devices``; the tests force that path with ``fullgraph=True`` (a graph break is an
error, not a silent split) and a backend that counts the calls of the compiled graph, so a decode step that fell back
to eager code would be missed in the count. Tokens are compared with the same generate run eagerly and, for the
exact cache, with DynamicCache.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import prompt
from torch import _dynamo as dynamo
from torch._dynamo.utils import counters
from transformers import CompileConfig, DynamicCache, GenerationConfig

from pikv_hf import PiKVCache
from pikv_hf.presses import DecodingBudgetPress, QuantPress, QuestPress, StreamingLLMPress
from pikv_hf.tiny import tiny_model

NEW_TOKENS = 5
READS = {
    "exact": {},
    "routed": dict(
        router="key_cluster", attention="routed", top_k_shards=2, n_sink=2, window=4, num_shards=4, page_size=4
    ),
}


def counting_backend(calls: list[int]):
    """A ``torch.compile`` backend: ``aot_eager`` whose compiled graphs append to ``calls`` each time they run."""
    aot_eager = dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        compiled = aot_eager(gm, example_inputs)

        def run(*args):
            calls.append(1)
            return compiled(*args)

        return run

    return backend


def generate(model, cache, config: GenerationConfig) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(prompt(24, batch=2), past_key_values=cache, generation_config=config)


@pytest.mark.parametrize("read", sorted(READS))
def test_generate_compiles_the_pikv_decode_step_by_itself(read):
    model = tiny_model("llama", seed=0)
    common = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    eager = generate(
        model, PiKVCache(model, max_cache_len=64, **READS[read]), GenerationConfig(disable_compile=True, **common)
    )
    assert not hasattr(model, "_compiled_call")  # the eager reference did not compile

    calls: list[int] = []
    compile_config = CompileConfig(backend=counting_backend(calls), fullgraph=True, mode=None)
    compile_config._compile_all_devices = True  # what makes generate compile on a CPU (on CUDA it compiles anyway)
    dynamo.reset()
    counters.clear()
    cache = PiKVCache(model, max_cache_len=64, **READS[read])
    got = generate(model, cache, GenerationConfig(compile_config=compile_config, **common))

    assert hasattr(model, "_compiled_call")  # generate took its automatic-compile branch
    assert len(calls) == NEW_TOKENS - 1  # every decode step (the prefill runs eagerly) ran the compiled graph
    assert not counters["graph_break"]
    assert torch.equal(got, eager)
    if read == "exact":
        reference = generate(model, DynamicCache(), GenerationConfig(disable_compile=True, **common))
        assert torch.equal(got, reference)
    else:  # the compiled steps read sparsely and counted it on the device
        stats = cache.routing_stats()["overall"]
        assert stats["sparse_layer_steps"] == (NEW_TOKENS - 1) * len(cache.layers)
        assert stats["fraction_tokens_attended"] < 1.0


def _compiled_generate(model, cache, presses, calls: list[int], **common) -> torch.Tensor:
    compile_config = CompileConfig(backend=counting_backend(calls), fullgraph=True, mode=None)
    compile_config._compile_all_devices = True
    dynamo.reset()
    with contextlib.ExitStack() as stack:
        for press in presses:
            stack.enter_context(press(model))
        return generate(model, cache, GenerationConfig(compile_config=compile_config, **common))


@pytest.mark.parametrize("name", ["streaming_llm", "quest"])
def test_a_press_held_around_generate_leaves_the_decode_step_compiled(name):
    """A press that evicts at prefill only (StreamingLLM) or sets the read (Quest) is held around a generate that
    compiles its decode steps: the steps run the compiled graph and give the eager tokens (the hooks read the step's
    position or the layer's length, data-dependent branches that broke the graph)."""
    model = tiny_model("llama", seed=0)
    common = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    make = {"streaming_llm": lambda: StreamingLLMPress(0.5, n_sink=2), "quest": lambda: QuestPress(0.5)}[name]
    with make()(model):
        eager = generate(model, PiKVCache(model, max_cache_len=64), GenerationConfig(disable_compile=True, **common))
    calls: list[int] = []
    cache = PiKVCache(model, max_cache_len=64)
    got = _compiled_generate(model, cache, [make()], calls, **common)
    assert len(calls) == NEW_TOKENS - 1 and torch.equal(got, eager)
    held = int(cache.layers[0].held().max())  # half of the 24-token prompt kept, or all of it read by pages
    assert held == (12 if name == "streaming_llm" else 24) + NEW_TOKENS - 1


@pytest.mark.parametrize(
    ("press", "message"),
    [
        (lambda: QuantPress(bits=4, group_size=8, window=8), "QuantPress moves tokens into its compressed tier while"),
        (lambda: DecodingBudgetPress(StreamingLLMPress(n_sink=2), target_size=16), "DecodingBudgetPress evicts"),
    ],
)
def test_a_press_that_acts_while_decoding_refuses_a_compiled_decode_step(press, message):
    """What such a press does at a decode step changes the cache's shapes by data; inside a compiled step it raises
    its own ValueError, which names the way out (Dynamo reports it as the exception the step raised)."""
    model = tiny_model("llama", seed=0)
    common = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    with pytest.raises(Exception, match=message) as info:  # noqa: PT011 (Dynamo wraps the press's ValueError)
        _compiled_generate(model, PiKVCache(model, max_cache_len=64), [press()], [], **common)
    assert "disable_compile=True" in str(info.value)


@pytest.mark.parametrize(
    ("read", "message"),
    [
        (dict(measure_recall=True), "cannot read with measure_recall=True"),
        (dict(selector="adaptive"), "cannot read with selector 'adaptive' \\(it learns from recall\\)"),
    ],
)
def test_a_read_that_measures_recall_refuses_a_compiled_decode_step(read, message):
    """Recall is read back to the host and counted in Python every step: a compiled step with measure_recall
    recompiled at every step (falling back to eager at the recompile limit), one with the adaptive selector failed
    inside Dynamo on its sampling generator. Both now raise a ValueError that names the way out."""
    model = tiny_model("llama", seed=0)
    common = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    routed = dict(attention="routed", top_k_shards=2, num_shards=4, page_size=4, n_sink=2, window=4, sparse_from=0)
    cache = PiKVCache(model, max_cache_len=64, **routed, **read)
    with pytest.raises(Exception, match=message) as info:  # noqa: PT011 (Dynamo wraps the step's ValueError)
        _compiled_generate(model, cache, [], [], **common)
    assert "disable_compile=True" in str(info.value)
    eager = PiKVCache(model, max_cache_len=64, **routed, **read)  # eagerly the same reads run
    generate(model, eager, GenerationConfig(disable_compile=True, **common))


def test_a_compiled_forward_before_any_prefill_is_refused_clearly():
    """The first tokens set a reserved layer up on the host (its batch, its pages); a traced first forward failed
    inside Dynamo on a data-dependent guard. It now raises a ValueError saying to prefill eagerly; the cache is left
    as it was, and after an eager prefill the same compiled step runs and equals eager."""
    model = tiny_model("llama", seed=0)
    cache = PiKVCache(model, max_cache_len=32)
    dynamo.reset()
    step = torch.compile(
        lambda t, p: model(t, past_key_values=cache, cache_position=p).logits, backend="aot_eager", fullgraph=True
    )
    ids = prompt(12)
    with torch.no_grad(), pytest.raises(Exception, match="holds no tokens yet; prefill it eagerly first"):  # noqa: PT011
        step(ids, torch.arange(12))
    assert all(layer.store is None for layer in cache.layers)
    twin = PiKVCache(model, max_cache_len=32)
    with torch.no_grad():
        for c in (cache, twin):
            model(ids, past_key_values=c)
        compiled = step(torch.tensor([[5]]), torch.tensor([12]))
        eager = model(torch.tensor([[5]]), past_key_values=twin).logits
    assert (compiled - eager).abs().max().item() < 1e-5
