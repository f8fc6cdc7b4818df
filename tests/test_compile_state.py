"""A compiled decode step of a reserved cache (``max_cache_len``) writes its state in place: no tensor the cache keeps
between steps is replaced by one the step made. CUDA graphs (``mode="reduce-overhead"``) replay over fixed addresses;
a state tensor replaced by a graph output is overwritten by the next replay (on an H200: "accessing tensor output of
CUDAGraphs that has been overwritten by a subsequent run"). On the CPU the same property is checked on identities."""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_memory import reachable_tensors

from pikv_hf import PiKVCache
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
