"""The CPU torch path reads a routed plan built no wider than it is used (eager) or trims a wide one to the longest
row its operator counted (``ReadPlan.lengths``: one operator and one value read back), and reads the same as the
untrimmed plan; a Quest plan of one store, as wide as its budget, is read as planned; Quest's plans over a store group
(a 4-bit tier beside the hot store), as wide as each frame, carry their counts and are trimmed."""

from __future__ import annotations

import dataclasses
import inspect
import sys
from pathlib import Path

import pytest
import torch

from pikv_hf import PiKVCache
from pikv_hf.attention.backend import TorchBackend, trimmed
from pikv_hf.kernels.decode_quant import QUANT_FIELDS
from pikv_hf.tiny import tiny_config

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))
import count_ops  # noqa: E402

B, H, G, T, D = 2, 2, 3, 90, 16


def _attends(monkeypatch, run) -> list[tuple]:
    """The (backend, query, store, plan, args, kwargs) of every ``TorchBackend.attend`` call ``run()`` makes."""
    seen = []
    real = TorchBackend.attend

    def spy(self, query, store, plan, *args, **kw):
        seen.append((self, query, store, plan, args, kw))
        return real(self, query, store, plan, *args, **kw)

    monkeypatch.setattr(TorchBackend, "attend", spy)
    run()
    monkeypatch.setattr(TorchBackend, "attend", real)
    return seen


def _decode_plan(monkeypatch, **kwargs):
    """One decode step of a layer-0 cache of ``T`` random tokens: the (backend, arguments) of its sparse attend."""
    gen = torch.Generator().manual_seed(0)
    cache = PiKVCache(tiny_config("llama", num_attention_heads=H * G, num_key_value_heads=H, head_dim=D), **kwargs)
    keys, values = torch.randn(B, H, T + 1, D, generator=gen), torch.randn(B, H, T + 1, D, generator=gen)
    cache.update(keys[:, :, :T], values[:, :, :T], 0)
    cache.update(keys[:, :, T:], values[:, :, T:], 0)
    query = torch.randn(B, H * G, 1, D, generator=gen)
    return _attends(monkeypatch, lambda: cache.layers[0].attend(query, D**-0.5, None, None))[-1]


@pytest.mark.parametrize("page_size", [1, 4])
def test_routed_plan_is_built_trimmed_and_reads_as_the_wide_plan(monkeypatch, page_size):
    """Eager on the CPU, a routed plan is built no wider than its longest row (``routed_plan_trimmed``); the same plan
    as wide as the frame (the operator's shape) with its count reads the same through ``trimmed``."""
    backend, query, store, plan, args, kw = _decode_plan(
        monkeypatch, router="key_cluster", num_shards=8, attention="routed", top_k_shards=2, n_sink=2, window=4,
        page_size=page_size,
    )  # fmt: skip
    used, width = plan.pages.shape[-1], store.table.width()
    assert plan.lengths is None and 0 < used < width // 2
    assert int((plan.pages >= 0).sum(-1).max()) == used  # no column of padding only
    pad = (0, width - used)
    wide = dataclasses.replace(
        plan,
        pages=torch.nn.functional.pad(plan.pages, pad, value=-1),
        page_full=None if plan.page_full is None else torch.nn.functional.pad(plan.page_full, pad, value=False),
        lengths=(plan.pages >= 0).sum(-1, dtype=torch.int32),
    )
    with count_ops.OpCounter() as counter:
        cut = trimmed(wide)
    assert sum(counter.counts.values()) == 1 and counter.host_reads == 1
    assert torch.equal(cut.pages, plan.pages)
    if page_size > 1:
        assert torch.equal(cut.page_full, plan.page_full)
    short = TorchBackend.attend(backend, query, store, plan, *args, **kw)
    whole = TorchBackend.attend(backend, query, store, dataclasses.replace(wide, lengths=None), *args, **kw)
    assert (short.o - whole.o).abs().max() < 1e-6 and (short.lse - whole.lse).abs().max() < 1e-6
    assert short.attended is None or torch.equal(short.attended, whole.attended)


def test_quest_plan_is_read_as_planned(monkeypatch):
    """A Quest plan of one store is as wide as its budget: its rows' counts are the pages each keeps, and the longest
    row fills it, so the CPU path reads it as planned."""
    *_, plan, _, _ = _decode_plan(monkeypatch, attention="quest", read_fraction=0.25, page_size=4, n_sink=1, window=2)
    assert torch.equal(plan.lengths, (plan.pages >= 0).sum(-1, dtype=torch.int32))
    assert int(plan.lengths.max()) == plan.pages.shape[-1]
    assert trimmed(plan) is plan


def test_quest_group_plans_over_a_4bit_tier_are_trimmed_and_read_the_same(monkeypatch):
    """Quest over a hot store and a 4-bit tier selects from one budget over both (``group_plans``): each store's plan
    is as wide as its frame, its pages first; on the CPU it carries the count in use, so the 4-bit tier's read is
    trimmed to the pages Quest took (not the whole tier, all but a fraction masked), with the same result."""
    from pikv_hf.presses import QuantPress
    from pikv_hf.tiny import tiny_model

    model = tiny_model("llama", seed=0)
    ids = torch.randint(0, model.config.vocab_size, (1, 400), generator=torch.Generator().manual_seed(2))
    cache = PiKVCache(model, attention="quest", read_fraction=0.125, page_size=16, sparse_from=0)
    with torch.no_grad(), QuantPress(bits=4, group_size=16, window=8)(model):
        model(ids, past_key_values=cache)
    with torch.no_grad():
        seen = _attends(monkeypatch, lambda: model(torch.tensor([[5]]), past_key_values=cache))
    tier = [s for s in seen if s[2].codec.code_bits == 4 and s[3].pages is not None]
    assert len(tier) == model.config.num_hidden_layers
    for backend, query, store, plan, args, kw in tier:
        assert torch.equal(plan.lengths, (plan.pages >= 0).sum(-1, dtype=torch.int32))  # each row's pages first
        used = int(plan.lengths.max())
        assert 0 < used < plan.pages.shape[-1] // 2 and bool((plan.pages[..., used:] == -1).all())
        short = TorchBackend.attend(backend, query, store, plan, *args, **kw)
        whole = TorchBackend.attend(backend, query, store, dataclasses.replace(plan, lengths=None), *args, **kw)
        assert (short.o - whole.o).abs().max() < 1e-5 and (short.lse - whole.lse).abs().max() < 1e-5
        # what a compiled CPU step calls on the wide plan: the same read as one operator
        call = inspect.signature(TorchBackend.attend).bind(backend, query, store, plan, *args, **kw).arguments
        counted = TorchBackend.attend(**{**call, "count": True})
        fields = (store.pool[name] for name in (*QUANT_FIELDS, "bias"))
        op_args = (query, *fields, store.table.start, plan.pages, plan.lengths, call["scale"], 4)
        o, lse, attended = torch.ops.pikv.quant_read(*op_args)
        assert torch.equal(o, counted.o) and torch.equal(lse, counted.lse) and torch.equal(attended, counted.attended)
    torch.library.opcheck(torch.ops.pikv.quant_read.default, op_args, test_utils=("test_schema", "test_faketensor"))
    none = (*op_args[:-3], torch.zeros_like(plan.lengths), *op_args[-2:])  # no row took a page of the tier
    o, lse, attended = torch.ops.pikv.quant_read(*none)
    assert (o == 0).all() and torch.isneginf(lse).all() and (attended == 0).all() and o.shape == counted.o.shape


def test_quest_plan_of_a_reserved_cpu_store_is_sized_by_the_pages_in_use():
    """A ``max_cache_len`` store's frame is as wide as its reservation; on the CPU (eager) a Quest plan is as wide as
    the budget of the pages in use, not of the reservation, and reads what the unreserved cache reads."""
    from pikv_hf.tiny import tiny_model

    model = tiny_model("llama", seed=0)
    ids = torch.randint(0, model.config.vocab_size, (1, 100), generator=torch.Generator().manual_seed(1))
    plans, logits = [], []
    for reserve in ({}, {"max_cache_len": 2048}):
        cache = PiKVCache(model, attention="quest", read_fraction=0.25, page_size=4, sparse_from=0, **reserve)
        layer = cache.layers[0]
        with torch.no_grad():
            model(ids, past_key_values=cache)
            real = type(layer.step.policy).plan
            seen = []
            layer.step.policy.plan = lambda *a, real=real, seen=seen, policy=layer.step.policy: seen.append(
                real(policy, *a)) or seen[-1]  # fmt: skip
            logits.append(model(torch.tensor([[5]]), past_key_values=cache).logits)
        plans.append(seen[0].pages)
    used, width = int(layer.store.table.n_pages.max()), layer.store.table.width()
    # the budget of the pages in use, or the sink / window pages when they are more (read always), not of 512
    assert plans[1].shape[-1] <= -(-used // 4) + 4 + 64 and width >= 2048 // 4
    assert torch.equal(plans[0], plans[1])
    assert (logits[0] - logits[1]).abs().max() < 1e-6


def test_packed_read_of_one_token_pages_equals_float64_attention(monkeypatch):
    """A routed read of one-token pages on the CPU gathers only each (row, head)'s own pages and attends them one
    (row, head) at a time (``TorchBackend._attend_packed``): the same as float64 attention over exactly those
    tokens, for rows whose plans differ in length (the padding a wide plan would carry is never read)."""
    backend, query, store, plan, args, kw = _decode_plan(
        monkeypatch, router="key_cluster", num_shards=8, attention="routed", top_k_shards=2, n_sink=2, window=4,
        page_size=1,
    )  # fmt: skip
    lengths = (plan.pages >= 0).sum(-1)
    assert int(lengths.min()) < int(lengths.max())  # rows of different lengths: a wide plan pads some
    call = inspect.signature(TorchBackend.attend).bind(backend, query, store, plan, *args, **kw).arguments
    part = TorchBackend.attend(**{**call, "count": True})
    scale = call["scale"]
    for row in range(B):
        for head in range(H):
            pages = plan.pages[row, head][plan.pages[row, head] >= 0] + store.table.start[row, head]
            k = store.pool["keys"][pages, 0].double()
            v = store.pool["values"][pages, 0].double()
            q = query[row, head * G : (head + 1) * G, 0].double()
            logits = q @ k.T * scale
            want = torch.softmax(logits, -1) @ v
            got = part.o[row, head * G : (head + 1) * G, 0].double()
            assert (got - want).abs().max() < 1e-5
            assert (part.lse[row, head * G : (head + 1) * G, 0].double() - logits.logsumexp(-1)).abs().max() < 1e-5
    assert torch.equal(part.attended, lengths)
    # a (row, head) with nothing planned reads nothing: o = 0, lse = -inf; the others read as before
    pages = plan.pages.clone()
    pages[1, 0] = -1
    empty = dataclasses.replace(plan, pages=pages, lengths=(pages >= 0).sum(-1))
    part_empty = TorchBackend.attend(**{**call, "plan": empty, "count": True})
    rows = slice(0, G)
    assert (part_empty.o[1, rows] == 0).all() and torch.isneginf(part_empty.lse[1, rows]).all()
    assert int(part_empty.attended[1, 0]) == 0
    assert torch.equal(part_empty.o[0], part.o[0]) and torch.equal(part_empty.lse[0], part.lse[0])
    assert torch.equal(part_empty.o[1, G:], part.o[1, G:]) and torch.equal(part_empty.lse[1, G:], part.lse[1, G:])


def test_packed_read_operator_reads_a_frame_wide_plan_as_the_eager_path(monkeypatch):
    """``torch.ops.pikv.packed_read`` (what a compiled CPU step calls on a plan that keeps the frame's width) reads
    the same as the eager packed path, its padding never read; schema and fake implementation pass ``opcheck``."""
    backend, query, store, plan, args, kw = _decode_plan(
        monkeypatch, router="key_cluster", num_shards=8, attention="routed", top_k_shards=2, n_sink=2, window=4,
        page_size=1,
    )  # fmt: skip
    call = inspect.signature(TorchBackend.attend).bind(backend, query, store, plan, *args, **kw).arguments
    want = TorchBackend.attend(**{**call, "count": True})
    wide = torch.nn.functional.pad(plan.pages, (0, store.table.width() - plan.pages.shape[-1]), value=-1)
    op_args = (query, store.pool["keys"], store.pool["values"], store.table.start, wide, call["scale"])
    o, lse, lengths = torch.ops.pikv.packed_read(*op_args)
    assert torch.equal(o, want.o) and torch.equal(lse, want.lse) and torch.equal(lengths, want.attended)
    torch.library.opcheck(torch.ops.pikv.packed_read.default, op_args, test_utils=("test_schema", "test_faketensor"))
