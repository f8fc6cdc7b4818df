"""The Triton attention backend behind ``PiKVCache``: decoding through the fused kernel (on the GPU, or interpreted
on CPU, see ``conftest.py``) equals DynamicCache for exact reads and the torch backend for routed reads, also after
a ragged eviction; the default dispatch keeps the torch reference on CPU; on a GPU the kernel's attention takes no
host sync and replays from a CUDA graph."""

import copy

import pytest
import torch
from helpers import KERNEL_DEVICE as DEVICE
from helpers import TOL, DynamicCache, generate, max_logit_diff, model_pair, pikv, prompt
from torch._dynamo.backends.debugging import aot_eager

from pikv_hf import PiKVCache
from pikv_hf.attention import TorchBackend
from pikv_hf.attention.triton_backend import AutoBackend, TritonBackend, make_backend
from pikv_hf.codecs.quant import QuantCodec
from pikv_hf.kernels import _triton
from pikv_hf.presses import QuantPress
from pikv_hf.read import ReadPlan
from pikv_hf.store import PagedStore
from pikv_hf.tiny import tiny_config, tiny_model


def _models():
    """The tiny llama pair of ``helpers`` on ``DEVICE`` (copies when that is a GPU: other tests share the CPU ones)."""
    return tuple(m if DEVICE.type == "cpu" else copy.deepcopy(m).to(DEVICE) for m in model_pair("llama"))


def _left_padded(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = prompt(n, seed=20 + i)[0]
        mask[i, width - n :] = 1
    return ids.to(DEVICE), mask.to(DEVICE)


def test_exact_decode_through_the_kernel_equals_dynamic_cache():
    ref, model = _models()
    ids, mask = _left_padded([9, 14])  # rows of different lengths: padding is invalid, prefill goes through attend
    cache = pikv(model, page_size=4, attention_backend="triton")
    assert isinstance(cache.backend, TritonBackend)
    out = generate(model, ids, cache, attention_mask=mask, max_new_tokens=4)
    out_ref = generate(ref, ids, DynamicCache(), attention_mask=mask, max_new_tokens=4)
    assert torch.equal(out.sequences, out_ref.sequences)
    assert max_logit_diff(out.logits, out_ref.logits) < TOL


def test_routed_decode_through_the_kernel_equals_the_torch_backend():
    _, model = _models()
    ids, mask = _left_padded([30, 17])
    # recall needs attention mass: those reads take the inherited torch path
    kwargs = dict(
        num_shards=8, attention="routed", top_k_shards=2, n_sink=2, window=3, page_size=2, measure_recall=True
    )
    outs, stats = {}, {}
    for name in ("torch", "triton"):
        cache = pikv(model, "key_cluster", attention_backend=name, **kwargs)
        outs[name] = generate(model, ids, cache, attention_mask=mask, max_new_tokens=4)
        stats[name] = cache.routing_stats()["overall"]
    assert torch.equal(outs["torch"].sequences, outs["triton"].sequences)
    assert max_logit_diff(outs["torch"].logits, outs["triton"].logits) < 1e-5
    # tokens attended: counted by the kernel, on the device (integers); recall is a float ratio of sums
    assert stats["triton"] == pytest.approx(stats["torch"], rel=1e-6)
    assert stats["torch"]["fraction_tokens_attended"] < 0.8 and 0 < stats["torch"]["recall"] < 1


@pytest.mark.parametrize("attention", ["exact", "routed"])
def test_ragged_runs_after_eviction_read_through_the_kernel(attention):
    b, h, g, t, d = 3, 2, 4, 60, 16
    gen = torch.Generator().manual_seed(0)
    caches = {}
    keys, values = torch.randn(b, h, t, d, generator=gen), torch.randn(b, h, t, d, generator=gen)
    keep = torch.rand(b, h, t, generator=gen) < torch.tensor([0.9, 0.2]).view(1, h, 1)
    k, v = torch.randn(b, h, 1, d, generator=gen), torch.randn(b, h, 1, d, generator=gen)
    query = torch.randn(b, h * g, 1, d, generator=gen)
    keys, values, keep, k, v, query = (x.to(DEVICE) for x in (keys, values, keep, k, v, query))
    outs = {}
    for name in ("torch", "triton"):
        cache = PiKVCache(
            tiny_config("llama", num_attention_heads=h * g, num_key_value_heads=h, head_dim=d),
            router="round_robin", num_shards=4, page_size=4, attention=attention, top_k_shards=2, n_sink=2,
            window=5, measure_recall=True, attention_backend=name,
        )  # fmt: skip
        layer = cache.layers[0]
        cache.update(keys, values, 0)
        frame_pos = layer.store.frame("pos").long().clamp(max=t - 1)
        layer.evict(layer.store.frame("valid") & keep.gather(2, frame_pos))
        assert not layer.store.table.uniform
        cache.update(k, v, 0)
        outs[name] = layer.attend(query, d**-0.5, None, None)
        caches[name] = cache
    assert (outs["torch"] - outs["triton"]).abs().max() < 1e-5
    if attention == "exact":  # the dense softmax over the kept tokens and the new one
        kk, vv = torch.cat([keys, k], 2), torch.cat([values, v], 2)
        kept = torch.cat([keep, torch.ones(b, h, 1, dtype=torch.bool, device=DEVICE)], 2).repeat_interleave(g, 1)
        logits = (query @ kk.repeat_interleave(g, 1).transpose(-1, -2)) * d**-0.5
        expected = logits.masked_fill(~kept.unsqueeze(2), float("-inf")).softmax(-1) @ vv.repeat_interleave(g, 1)
        assert (outs["triton"] - expected.transpose(1, 2)).abs().max() < 1e-5
    else:
        torch_stats, triton_stats = (caches[n].routing_stats()["per_layer"][0] for n in ("torch", "triton"))
        assert triton_stats == pytest.approx(torch_stats, rel=1e-6) and torch_stats["fraction_tokens_attended"] < 0.9


def test_default_dispatch_keeps_the_torch_reference_on_cpu_and_names_are_checked():
    config = tiny_config("llama")
    cache = PiKVCache(config)
    assert isinstance(cache.backend, AutoBackend) and cache.fork().backend.name == "auto"
    cache.update(torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16), 0)
    store = cache.layers[0].store
    assert not cache.backend.fused(store, queries=1, groups=1, want_mass=False)  # CPU store: torch path
    triton = make_backend("triton")
    assert triton.fused(store, 1, 1, False) and not triton.fused(store, 17, 1, False)  # prefill chunks: torch
    assert type(make_backend("torch")) is TorchBackend
    with pytest.raises(ValueError, match=r"attention_backend must be one of \('auto', 'torch', 'triton'\)"):
        PiKVCache(config, attention_backend="cuda")


@pytest.mark.skipif(DEVICE.type != "cuda", reason="host syncs and CUDA graphs are GPU notions")
def test_kernel_attention_takes_no_host_sync_and_replays_from_a_cuda_graph():
    b, h, g, t, d, p = 2, 2, 4, 300, 64, 16
    gen = torch.Generator().manual_seed(0)
    store = PagedStore(b, h, d, d, 4, p, torch.float16, DEVICE)
    keys, values = (torch.randn(b, h, t, d, generator=gen).half().to(DEVICE) for _ in range(2))
    store.append(
        keys, values, (torch.arange(t, device=DEVICE) // p % 4).expand(b, h, t), torch.arange(t, device=DEVICE)
    )
    query = torch.randn(b, h * g, 1, d, generator=gen).half().to(DEVICE)
    qpos = torch.tensor([t - 1], device=DEVICE)
    local = torch.arange(0, t // p, 3, device=DEVICE).expand(b, h, -1).contiguous()  # every third page
    full = torch.rand(local.shape, generator=gen).to(DEVICE) < 0.5
    sparse = ReadPlan(local, full, n_sink=4, window=20, row_start=torch.zeros(b, dtype=torch.int64, device=DEVICE))
    backend = TritonBackend()
    assert make_backend("auto").fused(store, 1, 1, False)  # the default dispatch fuses on CUDA
    for plan in (ReadPlan(), sparse):
        eager = backend.attend(query, store, plan, qpos, d**-0.5, count=True)  # compiles the kernels
        ref = TorchBackend().attend(query, store, plan, qpos, d**-0.5, count=True)
        # the torch backend rounds fp16 logits to fp16 (the kernel keeps them in fp32): a looser bound than 1e-3
        assert (eager.o - ref.o).abs().max() < 1e-2 and torch.equal(eager.attended, ref.attended)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            backend.attend(query, store, plan, qpos, d**-0.5, count=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = backend.attend(query, store, plan, qpos, d**-0.5, count=True)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured.o, eager.o) and torch.equal(captured.attended, eager.attended)


COMPILED_READS = {
    "exact": {},
    "routed": dict(attention="routed", top_k_shards=2, n_sink=2, window=4, num_shards=4, page_size=4),
    "quest": dict(attention="quest", read_fraction=0.5, n_sink=2, window=4, page_size=4),
    "4bit": dict(page_size=8),
}


@pytest.mark.parametrize("read", sorted(COMPILED_READS))
def test_decode_step_through_the_kernel_operator_compiles_in_one_graph_and_equals_eager(read, monkeypatch):
    """With the Triton backend (the kernels interpreted on CPU) and every operator traced as on CUDA (not its CPU
    reference: ``_triton.traced_as_operator``), a decode step of a compileable cache compiles with ``fullgraph=True``
    into exactly one graph that calls ``torch.ops.pikv.paged_decode`` (no tuple argument, nothing keyed by a stream)
    and the planning operators, and the compiled steps equal eager ones."""
    monkeypatch.setattr(_triton, "traced_as_operator", lambda t: True)
    model = tiny_model("llama", seed=0)
    cache = PiKVCache(model, router="key_cluster", max_cache_len=48, attention_backend="triton", **COMPILED_READS[read])
    graphs = []

    def count_graphs(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    with torch.no_grad():
        if read == "4bit":  # older tokens in a 4-bit tier: the quantised pages go through the same operator
            with QuantPress(bits=4, group_size=8, window=4)(model):
                model(prompt(20), past_key_values=cache)
            assert isinstance(cache.layers[0].tiers["compressed"].codec, QuantCodec)
        else:
            model(prompt(20), past_key_values=cache)
        reference = cache.fork()
        torch._dynamo.reset()
        step = torch.compile(
            lambda t, pos: model(t, past_key_values=cache, cache_position=pos).logits, backend=count_graphs,
            fullgraph=True,
        )  # fmt: skip
        token, pos = torch.tensor([[7]]), torch.tensor([20])
        got = step(token, pos)
        want = model(token, past_key_values=reference, cache_position=pos).logits
        assert (got - want).abs().max() < 1e-5
    calls = [n for n in graphs[0].graph.nodes if n.target is torch.ops.pikv.paged_decode.default]
    assert len(graphs) == 1 and len(calls) == len(cache.layers) * (2 if read == "4bit" else 1)  # 4-bit: + hot store
    targets = {n.target for n in graphs[0].graph.nodes}
    planned = {"routed": torch.ops.pikv.route_select.default, "quest": torch.ops.pikv.quest_scores.default}
    assert read not in planned or planned[read] in targets
    assert cache.get_seq_length() == reference.get_seq_length() == 21
