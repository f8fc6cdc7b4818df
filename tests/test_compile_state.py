"""A compiled decode step of a reserved cache (``max_cache_len``) writes its state in place: no tensor the cache keeps
between steps is replaced by one the step made. CUDA graphs (``mode="reduce-overhead"``) replay over fixed addresses;
a state tensor replaced by a graph output is overwritten by the next replay (on an H200: "accessing tensor output of
CUDAGraphs that has been overwritten by a subsequent run"). On the CPU the same property is checked on identities."""

from __future__ import annotations

import contextlib

import pytest
import torch

from pikv_hf import PiKVCache
from pikv_hf.memory import reachable_tensors
from pikv_hf.presses import QuantPress
from pikv_hf.tiny import tiny_model

WAYS = {
    "exact": (dict(), None),
    "quest": (dict(attention="quest", read_fraction=0.25, sparse_from=0, page_size=4), None),
    "routed": (
        dict(router="key_cluster", num_shards=8, page_size=1, attention="routed", top_k_shards=2, sparse_from=0,
             dense_layers=0),
        None,
    ),  # fmt: skip
    "quant4": (dict(page_size=4), QuantPress(bits=4, group_size=8, window=8)),
}


@pytest.mark.parametrize("way", list(WAYS))
def test_compiled_decode_step_replaces_no_state_tensor(way):
    kwargs, press = WAYS[way]
    model = tiny_model("llama", seed=0).eval()
    cache = PiKVCache(model, max_cache_len=64, **kwargs)
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    step = torch.compile(
        lambda t, p: model(t, past_key_values=cache, cache_position=p).logits, backend="aot_eager", fullgraph=True
    )
    with torch.no_grad():
        with press(model) if press is not None else contextlib.nullcontext():
            model(ids, past_key_values=cache)
        step(ids[:, :1], torch.tensor([24]))
        held = {i: path for i, (path, _) in reachable_tensors(cache).items()}
        for s in range(3):
            step(ids[:, s + 1 : s + 2], torch.tensor([25 + s]))
            now = {i: path for i, (path, _) in reachable_tensors(cache).items()}
            replaced = sorted(path for i, path in now.items() if i not in held)
            assert not replaced, f"{way}: state tensors replaced by a compiled step: {replaced}"
    assert cache.get_seq_length() == 28


@pytest.mark.parametrize("way", ["exact", "quest"])
def test_a_step_appending_and_folding_through_the_operators_as_on_cuda_compiles_and_equals_eager(way, monkeypatch):
    """On CUDA a compiled step appends through ``torch.ops.pikv.append_one``, which also folds Quest's page bounds
    (``kernels._triton.traced_as_operator``); forced here on the CPU, inductor compiles the step with that operator
    mutating the state in one graph, and three compiled steps give the logits, the stored tokens and the page bounds
    of the same steps taken eagerly."""
    from pikv_hf.kernels import _triton

    monkeypatch.setattr(_triton, "traced_as_operator", lambda t: True)
    kwargs, _ = WAYS[way]
    model = tiny_model("llama", seed=0).eval()
    cache = PiKVCache(model, max_cache_len=64, **kwargs)
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    graphs = []

    def inductor(gm, example_inputs):
        graphs.append(gm)
        return torch._inductor.compile(gm, example_inputs)

    step = torch.compile(
        lambda t, p: model(t, past_key_values=cache, cache_position=p).logits, backend=inductor, fullgraph=True
    )
    with torch.no_grad():
        model(ids, past_key_values=cache)
        reference = cache.fork()
        for s in range(3):
            token, pos = ids[:, s : s + 1], torch.tensor([24 + s])
            got = step(token, pos)
            want = model(token, past_key_values=reference, cache_position=pos).logits
            assert (got - want).abs().max() < 1e-5
    ops = {n.target for n in graphs[0].graph.nodes}
    assert len(graphs) == 1 and torch.ops.pikv.append_one.default in ops
    assert torch.ops.pikv.fold_page_bounds.default not in ops  # the append folds a decode token's page bounds
    for layer, ref in zip(cache.layers, reference.layers, strict=True):
        for name in ("pos", "valid"):
            assert torch.equal(layer.store.pool[name], ref.store.pool[name]), name
        for name in ("keys", "values", *(("key_min", "key_max") if way == "quest" else ())):  # inductor's rounding
            torch.testing.assert_close(layer.store.pool[name], ref.store.pool[name], rtol=1e-5, atol=1e-5)
