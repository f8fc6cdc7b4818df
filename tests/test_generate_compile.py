"""``generate`` compiles a ``PiKVCache(max_cache_len=N)`` decode step by itself.

On CUDA transformers' ``generate`` compiles the decode step whenever the cache reports ``is_compileable`` (its
``_valid_auto_compile_criteria``), with ``generation_config.compile_config``. On a CPU it does so only when the compile
configuration says ``_compile_all_devices``; the tests force that path with ``fullgraph=True`` (a graph break is an
error, not a silent split) and a backend that counts the calls of the compiled graph, so a decode step that fell back
to eager code would be missed in the count. Tokens are compared with the same generate run eagerly and, for the
exact cache, with DynamicCache.
"""

from __future__ import annotations

import pytest
import torch
from helpers import prompt
from torch import _dynamo as dynamo
from torch._dynamo.utils import counters
from transformers import CompileConfig, DynamicCache, GenerationConfig

from pikv_hf import PiKVCache
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
