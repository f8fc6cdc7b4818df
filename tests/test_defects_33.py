"""Defects of issue 33 (items 1, 7 and 9), each against an independent reference: dense float attention, a
DynamicCache, bytes measured on the tensors held."""

import math

import pytest
import torch
from kvpress import ComposedPress
from transformers import DynamicCache

from pikv_hf import PiKVCache
from pikv_hf.presses import FlexGenPress, H2OPress, QuantPress
from pikv_hf.tiny import tiny_config, tiny_model

B, H, G, D = 2, 2, 3, 16


def _quest_reference(query, keys, values, pages, f, n_sink, window):
    """Dense float Quest read of the token at the last position of ``keys`` / ``values`` (``[B, H, T, D]``, position
    order) over ``pages`` (``(start, stop, slots)`` position ranges and allocated slots, in any order): the pages
    holding a sink or a recent-window token, then the pages with the largest upper bound of ``q . k`` while the slots
    of the pages taken before stay under ``f`` of all slots."""
    t = keys.shape[2]
    qg = query.view(B, H, G, D).double()
    out = torch.empty(B, H, G, D, dtype=torch.float64)
    total = sum(s for _, _, s in pages)
    for b in range(B):
        for h in range(H):
            scored = []
            for start, stop, slots in pages:
                k = keys[b, h, start:stop].double()
                bound = (qg[b, h].clamp(min=0) @ k.amax(0) + qg[b, h].clamp(max=0) @ k.amin(0)).max()
                special = start < n_sink or stop > t - window
                scored.append((math.inf if special else float(bound), slots, start, stop))
            read, before = [], 0
            for score, slots, start, stop in sorted(scored, key=lambda x: -x[0]):
                if score == math.inf or before < f * total:
                    read += list(range(start, stop))
                before += slots
            idx = torch.tensor(sorted(read))
            logits = qg[b, h] @ keys[b, h, idx].double().T * D**-0.5
            out[b, h] = logits.softmax(-1) @ values[b, h, idx].double()
    return out.view(B, H * G, D)


@pytest.mark.parametrize("f", [0.25, 0.5])
def test_1_quest_over_a_4bit_tier_reads_its_budget_over_both_stores(f):
    """Quest with a QuantPress tier (pages of 16 there, of 4 in the hot store): the read is the dense Quest read of
    the decoded keys over both stores' pages, the query's own token included (a budget per store read one page of
    the hot store's four and lost it)."""
    gen = torch.Generator().manual_seed(0)
    cfg = tiny_config("llama", num_attention_heads=H * G, num_key_value_heads=H, head_dim=D)
    cache = PiKVCache(cfg, num_shards=1, page_size=4, attention="quest", read_fraction=f, n_sink=2, window=4,
                      sparse_from=0)  # fmt: skip
    keys, values = torch.randn(B, H, 61, D, generator=gen), torch.randn(B, H, 61, D, generator=gen)
    cache.update(keys[:, :, :60], values[:, :, :60], 0)
    layer = cache.layers[0]
    QuantPress(bits=4, group_size=16, window=12).compress_layer(layer, prefilling=True)  # positions < 48 -> tier
    assert int(layer.tiers["compressed"].tokens_per_shard().sum()) == B * H * 48
    cache.update(keys[:, :, 60:], values[:, :, 60:], 0)
    query = torch.randn(B, H * G, 1, D, generator=gen)
    got = layer.attend(query, D**-0.5, None, None)[:, 0]
    view = layer.view()  # decoded keys and values of both stores, in position order
    assert torch.equal(view.pos, torch.arange(61).expand(B, H, -1))
    pages = [(s, s + 16, 16) for s in range(0, 48, 16)] + [(s, min(s + 4, 61), 4) for s in range(48, 61, 4)]
    want = _quest_reference(query, view.keys, view.values, pages, f, n_sink=2, window=4)
    assert (got.double() - want).abs().max() < 1e-5


def _kv_of_view(cache: PiKVCache) -> DynamicCache:
    """A DynamicCache holding every layer's decoded keys and values (all stores, position order)."""
    dyn = DynamicCache()
    for i, layer in enumerate(cache.layers):
        view = layer.view()
        assert bool(view.valid.all())
        dyn.update(view.keys.clone(), view.values.clone(), i)
    return dyn


@pytest.mark.parametrize("first", ["h2o_offload", "flexgen"])
def test_9_compressing_after_an_offloading_press_keeps_the_offload_tier_exact(first):
    """Evict-then-compress with an offload tier: the prefill runs (the codec is built from the hot store's tokens,
    not from a view that includes the tier), the offloaded tokens stay exact in CPU memory, the kept ones older than
    the window are quantised, and the next step's logits are those of a DynamicCache holding the same tokens."""
    model = tiny_model("llama", seed=0)
    ids = torch.randint(3, 256, (1, 60), generator=torch.Generator().manual_seed(3))
    make = {"h2o_offload": lambda: H2OPress(0.5, offload="cpu"), "flexgen": lambda: FlexGenPress(0.5)}[first]
    quant = QuantPress(bits=4, group_size=16, window=8)
    alone, both, dense = PiKVCache(model, page_size=4), PiKVCache(model, page_size=4), DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=dense)
        with make()(model):
            model(ids, past_key_values=alone)
        with ComposedPress([make(), quant])(model):
            model(ids, past_key_values=both)
        for layer, ref in zip(both.layers, dense.layers, strict=True):
            off = layer.tiers["offload"]
            per_head = {name: s.tokens_per_shard().sum(-1).tolist() for name, s in layer.stores.named()}
            assert per_head == {"hot": [[8, 8]], "offload": [[30, 30]], "compressed": [[22, 22]]}
            view = layer.view()
            assert torch.equal(view.pos[0, 0], torch.arange(60))  # nothing lost
            in_off = torch.isin(view.pos, off.frame("pos").to(torch.int64))
            assert torch.equal(view.keys[in_off], ref.keys[in_off])  # offloaded tokens stay exact
            assert torch.equal(view.keys[:, :, -8:], ref.keys[:, :, -8:])  # the window stays exact
            err = (view.keys - ref.keys).norm() / ref.keys.norm()
            assert 0 < err < 0.1  # the other old tokens are held in 4 bits
        assert both.offloaded_nbytes() == alone.offloaded_nbytes() > 0
        assert both.kv_nbytes() < alone.kv_nbytes()
        reference = _kv_of_view(both)
        nxt = torch.tensor([[7]])
        got = model(nxt, past_key_values=both).logits
        want = model(nxt, past_key_values=reference).logits
    assert (got - want).abs().max() < 1e-4


def _nbytes(cache) -> int:
    """Key / value bytes a DynamicCache holds, from its tensors."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


@pytest.mark.parametrize("router", ["round_robin", "key_cluster"])
@pytest.mark.parametrize("shards", [1, 8, 16])
@pytest.mark.parametrize("page", [4, 16, 64])
def test_7_an_eviction_ratio_is_honoured_in_bytes_across_shards_and_pages(page, shards, router):
    """H2OPress(0.5) frees half the bytes whatever the shards and pages: a PiKVCache holds what a DynamicCache under
    the same press holds (its tensors' bytes) plus at most one partly filled page per layer, row and KV head (the
    shards' partly filled pages are pooled; before, tokens kept in every shard kept a page in each); the gap left is
    what ``empty_nbytes`` reports."""
    model = tiny_model("llama", seed=0)
    ids = torch.randint(3, 256, (1, 300), generator=torch.Generator().manual_seed(3))
    dense, cache = DynamicCache(), PiKVCache(model, page_size=page, num_shards=shards, router=router)
    with torch.no_grad(), H2OPress(0.5)(model):
        model(ids, past_key_values=dense)
        model(ids, past_key_values=cache)
    want = _nbytes(dense)
    page_bytes = [layer.store.kv_nbytes() // layer.store.pool.num_pages for layer in cache.layers]
    slack = sum(b * layer.store.batch * layer.store.heads for b, layer in zip(page_bytes, cache.layers, strict=True))
    assert want <= cache.kv_nbytes() <= want + slack
    for layer, ref in zip(cache.layers, dense.layers, strict=True):  # the same tokens (kvpress keeps them in score
        view = layer.view()  # order, the view in position order: compared channel by channel, sorted)
        assert layer.empty_nbytes() == layer.kv_nbytes() - (ref.keys.nbytes + ref.values.nbytes)  # the gap, reported
        for mine, theirs in ((view.keys, ref.keys), (view.values, ref.values)):
            assert torch.equal(mine.sort(dim=2).values, theirs.sort(dim=2).values)
