"""Memory a PiKVCache holds: nothing a forward allocated outlives the cache (or a failed forward's temporaries), and
the tensors a cache references beyond its K/V stay within 5% of the fp16 KV.

References here are counted, not guessed: every tensor an operator returns during a forward is weakly referenced
(a ``TorchDispatchMode``), and Python's cycle collector is off while a test checks what is still alive, so a
reference cycle counts as a leak (GPU memory does not trigger the collector; a cycle keeps a deleted cache's KV).
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
from helpers import prompt
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import DynamicCache

from pikv_hf import PiKVCache
from pikv_hf.memory import reachable_tensors
from pikv_hf.presses import ChannelPrunePress, FastVCropPress, H2OPress, QuantPress
from pikv_hf.read.plan import _arange
from pikv_hf.tiny import tiny_model

ROUTED = dict(router="key_cluster", num_shards=8, page_size=1, attention="routed", top_k_shards=2, sparse_from=0)
# the ways of bench_e2e.MODES at the tiny model's scale (head_dim 16: 4-bit groups of 16)
WAYS = {
    "exact": ({}, []),
    "routed": (ROUTED, []),
    "quest_1_8": (dict(attention="quest", read_fraction=0.125, page_size=4, sparse_from=0), []),
    "quant4": (dict(page_size=16), [lambda: QuantPress(bits=4, group_size=16, window=8)]),
    "quest_quant4": (
        dict(page_size=16, attention="quest", read_fraction=0.125, sparse_from=0),
        [lambda: QuantPress(bits=4, group_size=16, window=8)],
    ),
    "h2o_offload_routed": (ROUTED, [lambda: H2OPress(0.5, offload="cpu")]),
}
# what a layer keeps between forwards (its stores, routing and read state): anything else a forward made must go
PERSISTENT = {"store", "stores", "placement", "policy", "step", "evicted", "row_start", "_row_open", "_index_pos"}


class Created(TorchDispatchMode):
    """Weak references to every tensor an operator returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs.extend(weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out

    def alive(self) -> list[torch.Tensor]:
        return [t for t in (r() for r in self.refs) if t is not None]


class PeakLive(TorchDispatchMode):
    """The most bytes of CPU tensor storage alive at once among the storages operators return while active (each
    storage counted from the first tensor returned on it until the last such tensor is gone): a forward's peak
    temporaries plus what it stores, without the model's weights."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, tensors returned on it still alive]
        self.now = self.peak = 0

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.untyped_storage().data_ptr() == 0:
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self.live:
                self.live[ptr] = [storage.nbytes(), 0]
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
            self.live[ptr][1] += 1
            weakref.finalize(t, self._release, ptr)
        return out


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=0)


@contextlib.contextmanager
def no_cycle_collection():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def run(model, cache, ids, presses, steps: int = 2) -> None:
    with torch.no_grad(), contextlib.ExitStack() as stack:
        for press in presses:
            stack.enter_context(press()(model))
        out = model(ids, past_key_values=cache, logits_to_keep=1)
        for _ in range(steps):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, logits_to_keep=1)


@pytest.mark.parametrize("way", list(WAYS))
def test_deleting_the_cache_frees_everything_its_forwards_made(model, way):
    kwargs, presses = WAYS[way]
    ids = prompt(96, batch=2, seed=3)
    with no_cycle_collection():
        cache = PiKVCache(model, **kwargs)
        created = Created()
        with created:
            run(model, cache, ids, presses)
        held = [weakref.ref(t) for _, t in reachable_tensors(cache).values()]
        assert len(held) > 10 and len(created.refs) > 100
        layers = [weakref.ref(layer) for layer in cache.layers]
        del cache
        _arange.cache_clear()  # read.plan's process-wide index constants (16 at most), shared by every cache
        alive = created.alive()
        assert not alive, f"{len(alive)} tensors a forward made outlive the cache: {[tuple(t.shape) for t in alive]}"
        assert all(r() is None for r in held + layers)


@pytest.mark.parametrize("way", ["exact", "routed", "quant4", "h2o_offload_routed"])
def test_a_failed_forward_leaves_no_temporaries(model, way):
    kwargs, presses = WAYS[way]
    cache = PiKVCache(model, **kwargs)
    run(model, cache, prompt(64, batch=2, seed=4), presses, steps=0)

    def fail(module, args, output):
        raise RuntimeError("boom in layer 2")

    hook = model.model.layers[2].register_forward_hook(fail)
    created = Created()
    with no_cycle_collection():
        try:
            with created, pytest.raises(RuntimeError, match="boom in layer 2"):
                run(model, cache, prompt(24, batch=2, seed=5), presses, steps=0)
        finally:
            hook.remove()
        alive = {id(t) for t in created.alive()}
        assert alive, "the failed forward made no tensor the cache kept: the check below would be empty"
        kept = {i: path for i, (path, _) in reachable_tensors(cache).items() if i in alive}
        stray = [p for p in kept.values() if p.split(".")[2].split("[")[0] not in PERSISTENT]
        assert not stray, f"a failed forward's temporaries are still referenced by the cache: {stray}"
        del kept
        cache_ref = weakref.ref(cache)
        del cache
        assert cache_ref() is None
        leaked = created.alive()
        assert not leaked, f"{len(leaked)} tensors of the failed forward are referenced outside the cache"


def _fp16_kv(cfg, batch: int, tokens: int) -> int:
    return 2 * 2 * batch * tokens * cfg.num_key_value_heads * cfg.head_dim * cfg.num_hidden_layers


@pytest.mark.parametrize(
    "way",
    [
        ("exact", {}, [], 1),
        ("routed", dict(router="key_cluster", num_shards=32, page_size=16, attention="routed", top_k_shards=8), [], 0),
        ("quant4", dict(page_size=64), [lambda: QuantPress(bits=4)], 1),
    ],
    ids=lambda w: w[0],
)
def test_bytes_held_beyond_kv_are_within_5_percent_of_fp16_kv(way):
    """SmolLM2's attention shape (3 KV heads of 64, bf16), 4k tokens: every tensor the cache references, each
    storage once, against ``kv_nbytes()``; the difference (positions, masks, shard ids, summaries, centroids, anything
    left from the forward) must stay within 5% of the fp16 KV. 4-bit held 0.467x fp16 against its own 0.317x
    (int64 view indices and positions kept after the forward). The routed cache is checked after its prefill: a
    sparse decode step adds its gather workspace and the selector's copy of the shard summaries (decode-time state,
    not yet within this budget). The torch backend's CPU workspace (one set of buffers every layer shares, so 1/2 of
    this 2-layer model's KV but 1/30 of SmolLM2's: ``benchmarks/held_bytes.py`` counts it at 30 layers) is bounded
    apart: at most one layer's fp16 KV."""
    name, kwargs, presses, steps = way
    model = tiny_model(
        "llama", seed=0, dtype=torch.bfloat16, hidden_size=192, num_attention_heads=3, num_key_value_heads=3,
        intermediate_size=64, num_hidden_layers=2, max_position_embeddings=8192,
    )  # fmt: skip
    tokens = 4096
    cache = PiKVCache(model, **kwargs)
    run(model, cache, prompt(tokens, seed=6), presses, steps=steps)
    fp16 = _fp16_kv(model.config, 1, tokens + steps)
    workspace = cache.workspace_nbytes()
    assert workspace <= fp16 / model.config.num_hidden_layers
    extra = cache.held_nbytes() - cache.kv_nbytes() - workspace
    assert 0 <= extra <= 0.05 * fp16, f"{name}: {extra / fp16:.4f}x the fp16 KV held beyond K/V"
    if name == "quant4":
        assert cache.kv_nbytes() < 0.4 * fp16  # the 4-bit cache is what it says


def test_routed_readme_setting_after_sparse_steps_keeps_no_shard_bounds():
    """The README's routed cache (256 key-cluster shards, pages of 1, top-p 0.97, first layer dense), SmolLM2's
    attention shape at 4k tokens, after two sparse decode steps: the top-k centroid selector reads the shards' key sums
    and squares, so no store keeps shard min / max (they were a quarter of the fp16 KV with the sums; 0.376x beyond
    K/V before). What is held beyond K/V: the placement's centroids and the sums / squares (each a sixteenth of the
    fp16 KV at 16 tokens per shard; a thirty-second at 32k), per-token position / shard / mask fields (0.044x) and the
    CPU gather workspace; 0.280x measured, held here at <= 0.29x (the 5% budget is not met at this shard count)."""
    model = tiny_model(
        "llama", seed=0, dtype=torch.bfloat16, hidden_size=192, num_attention_heads=3, num_key_value_heads=3,
        intermediate_size=64, num_hidden_layers=4, max_position_embeddings=8192,
    )  # fmt: skip
    tokens, steps = 4096, 2
    cache = PiKVCache(
        model, router="key_cluster", num_shards=256, page_size=1, attention="routed", top_k_shards=64,
        mass_target=0.97, dense_layers=1, sparse_from=0,
    )  # fmt: skip
    run(model, cache, prompt(tokens, seed=6), [], steps=steps)
    stats = [layer.stores.hot.stats for layer in cache.layers]
    assert all(st.sum is not None for st in stats[1:]) and not any(st.bounds_kept for st in stats)
    assert cache.routing_stats()["overall"]["fraction_tokens_attended"] < 0.5  # the steps read sparsely
    fp16 = _fp16_kv(model.config, 1, tokens + steps)
    extra = cache.held_nbytes() - cache.kv_nbytes()
    assert 0.15 * fp16 <= extra <= 0.29 * fp16, f"{extra / fp16:.4f}x the fp16 KV held beyond K/V"


def test_h2o_offload_routed_prefill_peak_is_within_10_percent_of_dynamic_cache():
    """SmolLM2's attention and MLP shapes (9 query / 3 KV heads of 64, MLP 1536, fp32), 2 layers, 2k tokens: the peak
    of the tensors a prefill makes under H2O (half offloaded to CPU memory, routed reads) against DynamicCache's.
    H2O's attention statistics keep one score-sized tensor per query chunk (scores, mask and softmax in place; the
    previous chunk's freed first); with the scores, their softmax copy, the previous chunk's and an int64 distance
    tensor alive at once this prefill peaked at 1.25x DynamicCache's."""
    model = tiny_model(
        "llama", seed=0, hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
        num_hidden_layers=2, max_position_embeddings=4096,
    )  # fmt: skip
    ids = prompt(2048, seed=1)
    kwargs, presses = WAYS["h2o_offload_routed"]
    peaks = {}
    for name, cache, enter in [("dynamic", DynamicCache(), []), ("h2o", PiKVCache(model, **kwargs), presses)]:
        with torch.no_grad(), contextlib.ExitStack() as stack:
            for press in enter:
                stack.enter_context(press()(model))
            peak = stack.enter_context(PeakLive())
            model(ids, past_key_values=cache, logits_to_keep=1)
        peaks[name] = peak.peak
    assert (cache.layers[1].resident_tokens() == 1024).all()  # the press kept half resident, offloaded the rest
    assert peaks["dynamic"] > 40 * 2**20  # the MLP's [2048, 1536] activations and the KV: the check below has weight
    assert peaks["h2o"] <= 1.10 * peaks["dynamic"], f"{peaks['h2o'] / peaks['dynamic']:.3f}x DynamicCache's peak"


def test_routed_reads_over_an_offload_tier_keep_no_shard_bounds_and_select_as_the_combined_summary(model):
    """H2O with its evicted half offloaded and read back by routed selection (top-k centroids): the selection is one
    operator over the key sums and squares summed over the hot store and the offload tier, so neither keeps shard
    key min / max (4 float32 vectors per shard and tier: 0.25x the fp16 KV at SmolLM2's shape and 16 tokens per
    shard), and it picks the shards the selector picks from the tiers' combined summary."""
    kwargs, presses = WAYS["h2o_offload_routed"]
    cache = PiKVCache(model, **kwargs)
    run(model, cache, prompt(96, batch=2, seed=3), presses, steps=2)
    sparse = [layer for layer in cache.layers if "offload" in layer.stores.tiers]
    assert sparse and cache.routing_stats()["overall"]["fraction_tokens_attended"] < 0.9
    gen = torch.Generator().manual_seed(0)
    for layer in sparse:
        group = layer.stores.group()
        assert len(group.stores) == 2 and not any(s.stats.bounds_kept for s in group.stores)
        policy = layer.step.policy
        qg = torch.randn(group.batch, group.heads, 2, model.config.head_dim, generator=gen)
        chosen = policy.chosen(group, qg, 0.25)
        selected, keep = policy.choose(group, qg, 0.25)  # the selector over StoreGroup.summary (keeps bounds)
        want = torch.zeros_like(chosen).scatter_(2, selected, keep)
        assert chosen.sum() > 0 and torch.equal(chosen, want)


PROJECTED = {  # compressed tiers whose codec holds per-head maps
    "fastv_crop": (dict(page_size=4), [lambda: FastVCropPress(channels=8, window=2)]),
    "channel_prune": (dict(page_size=4), [lambda: ChannelPrunePress(channel_ratio=0.5, window=2)]),
}


@pytest.mark.parametrize(
    "way", ["exact", "routed", "quest_1_8", "quest_quant4", "h2o_offload_routed", "fastv_crop", "channel_prune"]
)
def test_each_stores_meta_nbytes_is_every_non_kv_tensor_it_references(model, way):
    """A store's ``meta_nbytes`` against the storages its attributes reference, less its K/V fields and the stores
    its key sums cover (``summed_with``: counted as themselves), each storage once: the sink / recent-window slots of
    a sparse read and a projection codec's maps were left out (each more than everything counted, at a short
    context)."""
    kwargs, presses = {**WAYS, **PROJECTED}[way]
    cache = PiKVCache(model, **kwargs)
    run(model, cache, prompt(40, batch=2, seed=4), presses)
    stores = [store for layer in cache.layers for store in layer.stores.all()]
    assert any(store._marks is not None for store in stores) == (way in WAYS and way != "exact")
    assert any(store.codec.tensors() for store in stores) == (way in PROJECTED)
    for store in stores:
        kv = {store.pool[name].untyped_storage().data_ptr() for name in store.kv_fields}
        held = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for path, t in reachable_tensors(store).values()
            if t.untyped_storage().data_ptr() not in kv and not path.startswith(".summed_with")
        }
        assert store.meta_nbytes() == sum(held.values())


def _refused_forward_then_delete() -> dict[str, weakref.ref]:
    """A prefilled cache, then a forward refused with a message naming the press; the caller deletes both caches
    while its frame lives on (the test function's frame here)."""
    model = tiny_model("llama", seed=0)
    held = PiKVCache(model, page_size=4)
    with torch.no_grad():
        model(prompt(40), past_key_values=held)
    cache = PiKVCache(model, page_size=4, attention="quest", read_fraction=0.5, sparse_from=0, measure_recall=True)
    from pikv_hf.presses import FlexGenPress

    with pytest.raises(ValueError, match="FlexGenPress: layer 0 reads with measure_recall=True"):
        with torch.no_grad(), FlexGenPress(0.5, offload="cpu")(model):
            model(prompt(40), past_key_values=cache)
    refs = {"held": weakref.ref(held), "refused": weakref.ref(cache)}
    del held, cache
    gc.collect()
    return {name: r for name, r in refs.items() if r() is not None}


def test_an_error_naming_the_press_keeps_no_object_of_the_caller_alive():
    """The message's press name came from reading every frame's f_locals up the stack, which on Python 3.11 leaves
    a snapshot of the caller's locals on its frame: both deleted caches stayed alive while the caller ran."""
    assert not _refused_forward_then_delete()


def test_a_fork_keeps_a_disk_offload_tier_in_mapped_files():
    """fork() / deepcopy cloned a disk tier's memory-mapped fields into ordinary memory while the fork still reported
    storage 'disk' (24,576 bytes in RAM instead of files); the fork's tier is mapped files and reads as the original."""
    model = tiny_model("llama", seed=0)
    cache = PiKVCache(model, page_size=4)
    with torch.no_grad(), H2OPress(0.5, offload="disk")(model):
        model(prompt(40), past_key_values=cache)
    fork = cache.fork()
    for original, copied in zip(cache.layers, fork.layers, strict=True):
        a, b = original.stores.tiers["offload"].pool, copied.stores.tiers["offload"].pool
        assert b.storage == "disk" and b.fields.keys() == a.fields.keys()
        for name, t in b.fields.items():
            assert torch.equal(t, a.fields[name]) and t.data_ptr() != a[name].data_ptr()
            assert not t.numel() or _mapped(t), name
    with torch.no_grad():
        step = torch.tensor([[5]])
        torch.testing.assert_close(model(step, past_key_values=fork).logits, model(step, past_key_values=cache).logits)


def _mapped(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory lies in a file mapping of this process (``/proc/self/maps``: a deleted temp file)."""
    start = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= start < hi:
                return "pikv-" in line
    return False


def test_reset_starts_the_read_statistics_over():
    """routing_stats() after reset() mixed the previous context's reads in (7 decode steps and 17,554 bytes fetched
    per step where the new context made 2 steps and fetched nothing), beside byte counts that were already 0."""
    model = tiny_model("llama", seed=0)
    cache = PiKVCache(model, page_size=4, attention="quest", read_fraction=1.0, sparse_from=0)
    with torch.no_grad():
        with H2OPress(0.5, offload="cpu")(model):
            model(prompt(40), past_key_values=cache)
        for t in range(5):
            model(torch.tensor([[5 + t]]), past_key_values=cache)
        assert cache.routing_stats()["overall"]["bytes_fetched_per_decode_step"] > 0
        cache.reset()
        fresh = PiKVCache(model, page_size=4, attention="quest", read_fraction=1.0, sparse_from=0)
        for c in (cache, fresh):
            model(prompt(24, seed=2), past_key_values=c)
            for t in range(2):
                model(torch.tensor([[7 + t]]), past_key_values=c)
    assert repr(cache.routing_stats()) == repr(fresh.routing_stats())  # recall is nan in both (not measured)
    assert cache.routing_stats()["overall"]["decode_steps"] == 2
