"""Decode-step defects of issue 33: ``sparse_from`` per row (not counting left padding), a failed forward leaves the
cache in step, compiled steps past ``max_cache_len`` corrupt no other row, compiled sparse steps never recompile."""

import gc
import logging
import weakref

import pytest
import torch
import torch._dynamo as dynamo
from helpers import DynamicCache, prompt

from pikv_hf import PiKVCache
from pikv_hf.tiny import tiny_model

logging.getLogger("torch._dynamo").setLevel(logging.ERROR)

ROW_LENGTHS = (30, 22, 15)
DECODE_TOKENS = (7, 19, 33, 41, 58, 77)


def _left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, longest - len(r) :], mask[i, longest - len(r) :] = r, 1
    return ids, mask


def _decode(model, cache, rows: list[torch.Tensor]) -> torch.Tensor:
    """``[steps, B, V]`` logits of the fixed decode tokens after a left-padded prefill of ``rows``."""
    ids, mask = _left_padded(rows)
    pos, out = (mask.cumsum(-1) - 1).clamp(min=0), []
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
        for t in DECODE_TOKENS:
            mask, pos = torch.cat([mask, torch.ones_like(mask[:, :1])], -1), pos[:, -1:] + 1
            step = torch.full((len(rows), 1), t)
            out.append(model(step, attention_mask=mask, position_ids=pos, past_key_values=cache).logits[:, -1])
    return torch.stack(out)


SPARSE_FROM_READS = {
    "routed": dict(attention="routed", top_k_shards=2, n_sink=2, window=4),
    "quest": dict(attention="quest", read_fraction=0.25, n_sink=2, window=4),
}


@pytest.mark.parametrize("mode, page_size", [(m, p) for m in sorted(SPARSE_FROM_READS) for p in (4, 1)])
def test_sparse_from_counts_each_rows_real_tokens(mode, page_size):
    # rows of 30, 22 and 15 real tokens, left-padded into one batch, sparse_from=25: each row reads as it does alone.
    # Pages of one token: a row below the threshold reads its whole frame while the others read sparsely, and such a
    # read takes every planned page as one token (it read the run's reserved, unused pages as tokens too)
    threshold = 25
    model, ref = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, 256, (n,), generator=g) for n in ROW_LENGTHS]
    read = dict(router="round_robin", page_size=page_size, sparse_from=threshold, **SPARSE_FROM_READS[mode])
    batch = PiKVCache(model, **read)
    in_batch = _decode(model, batch, rows)
    for i, row in enumerate(rows):
        alone = _decode(model, PiKVCache(model, **read), [row])[:, 0]
        assert (in_batch[:, i] - alone).abs().max() < 1e-5, f"row {i}"
        dense = _decode(ref, DynamicCache(), [row])[:, 0]
        # a row reads densely (equal to DynamicCache) until it has seen `threshold` positions of its own
        below = [s for s in range(len(DECODE_TOKENS)) if len(row) + s + 1 < threshold]
        if below:
            assert (in_batch[below, i] - dense[below]).abs().max() < 1e-4, f"row {i}"
        if len(below) < len(DECODE_TOKENS):  # the sparse read is a real approximation here, not the dense one
            assert (in_batch[len(below) :, i] - dense[len(below) :]).abs().max() > 1e-3, f"row {i}"
    assert len(below) == len(DECODE_TOKENS)  # the shortest row never reached the threshold
    stats = batch.routing_stats()["overall"]
    assert stats["sparse_layer_steps"] == len(DECODE_TOKENS) * len(batch.layers)  # row 0 reads sparsely at every step


def _fail_at_layer(model, index: int):
    def boom(*_):
        raise RuntimeError("simulated failure in a decoder layer")

    return model.model.layers[index].register_forward_pre_hook(boom)


@pytest.mark.parametrize("failing", ["prefill", "decode"])
def test_failed_forward_leaves_the_cache_as_before(failing):
    # layer 2 of 3 raises after layers 0-1 stored the forward's tokens: they are dropped again, nothing the failed
    # forward made stays referenced, and the next forwards equal DynamicCache's run without the failure
    model, ref = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
    ids, cache, dyn = prompt(30), PiKVCache(model, page_size=4), DynamicCache()
    stored = []  # weak references to the key / value states of the failed forward
    update = cache.update

    def watch(k, v, layer_idx, cache_kwargs=None):
        stored.extend([weakref.ref(k), weakref.ref(v)])
        return update(k, v, layer_idx, cache_kwargs)

    with torch.no_grad():
        if failing == "decode":
            model(ids, past_key_values=cache)
        failed = ids if failing == "prefill" else torch.tensor([[5]])
        hook, cache.update = _fail_at_layer(model, 2), watch
        with pytest.raises(RuntimeError, match="simulated failure"):
            model(failed, past_key_values=cache)
        hook.remove()
        del cache.update
        assert len(stored) == 4  # layers 0 and 1 stored
        gc.collect()
        assert all(r() is None for r in stored)
        assert [layer.get_seq_length() for layer in cache.layers] == [0 if failing == "prefill" else 30] * 3
        if failing == "prefill":
            model(ids, past_key_values=cache)
        ref(ids, past_key_values=dyn)
        for i in range(4):
            token, pos = torch.tensor([[40 + i]]), torch.tensor([30 + i])
            got = model(token, past_key_values=cache, cache_position=pos).logits
            want = ref(token, past_key_values=dyn, cache_position=pos).logits
            assert (got - want).abs().max() < 1e-4


def test_compiled_steps_past_max_cache_len_corrupt_no_other_row():
    # runs reserve ceil(8 / 4) + 2 shards = 4 pages (16 slots) per (row, KV head); row 1 has 6 pads, so its runs fill
    # 6 positions later than row 0's. Past max_cache_len the compiled steps go on: row 0's runs spill at position 16
    # into their own last page (its logits turn NaN), row 1 stays equal to DynamicCache's until its own runs are full
    model, ref = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
    ids = prompt(8, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :6], ids[1, :6] = 0, 0
    cache = PiKVCache(model, page_size=4, num_shards=2, max_cache_len=8)
    dyn = DynamicCache()
    nan_from = None
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
        ref(ids, attention_mask=mask, past_key_values=dyn)
        dynamo.reset()
        step = torch.compile(
            lambda t, p: model(t, past_key_values=cache, cache_position=p).logits, backend="aot_eager", fullgraph=True
        )
        for pos in range(8, 22):  # row 1's runs hold 16 of its 2 + 14 real tokens
            token = torch.tensor([[7 + pos], [30 + pos]])
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            got = step(token, torch.tensor([pos]))[:, -1]
            want = ref(token, past_key_values=dyn, cache_position=torch.tensor([pos]), attention_mask=mask).logits
            assert (got[1] - want[1, -1]).abs().max() < 1e-4, pos
            if nan_from is None and bool(got[0].isnan().all()):
                nan_from = pos
            if nan_from is None:
                assert (got[0] - want[0, -1]).abs().max() < 1e-4, pos
            else:
                assert bool(got[0].isnan().all()), pos
        assert nan_from == 16
        with pytest.raises(ValueError, match="max_cache_len=8"):
            model(torch.tensor([[5], [6]]), past_key_values=cache, cache_position=torch.tensor([22]))
        with pytest.raises(ValueError, match="reset"):
            cache.crop(8)
        cache.reset()  # usable again
        model(ids, attention_mask=mask[:, :8], past_key_values=cache)
        assert cache.get_seq_length() == 8


def test_reserved_layer_reads_an_offloaded_tier_sparsely(shipped_sparse_from):
    """A ``max_cache_len`` cache holding tokens in the offload tier reads them as an eager cache does: sparsely from
    the first decode step (a dense read would fetch the whole tier every step; the compiled H2O + offload + routed
    step of bench_e2e read 1.000 of the tokens against eager's 0.70), with the same logits."""
    from pikv_hf.presses import H2OPress

    model = tiny_model("llama", seed=0)
    routed = dict(attention="routed", top_k_shards=2, num_shards=4, n_sink=2, window=4)
    caches = [PiKVCache(model, **routed), PiKVCache(model, max_cache_len=64, **routed)]
    logits = []
    with torch.no_grad():
        for cache in caches:
            with H2OPress(0.5, offload="cpu")(model):
                model(prompt(40), past_key_values=cache)
            logits.append(model(torch.tensor([[7]]), past_key_values=cache).logits)
    eager, reserved = (c.routing_stats()["overall"]["kv_read_vs_dense"] for c in caches)
    assert all(layer._sparse_rows() is True for c in caches for layer in c.layers)
    assert eager == reserved < 0.9
    assert (logits[0] - logits[1]).abs().max() < 1e-5


def test_reserved_hot_store_shrinks_to_what_is_left_after_a_press_moves_tokens():
    """After a 4-bit press moves the prefill's older tokens to its tier, a ``max_cache_len`` layer's hot store keeps
    room for the tokens it holds and the positions still to come, not a full-precision reservation of the whole
    length beside the tier (bench_e2e: a compiled 4-bit cache held 127 MiB against 20 MiB eager); decoding up to
    ``max_cache_len`` still fits and reads as an eager cache does."""
    from pikv_hf.presses import QuantPress

    model = tiny_model("llama", seed=0)
    eager, reserved = PiKVCache(model, page_size=16), PiKVCache(model, page_size=16, max_cache_len=400)
    logits = []
    with torch.no_grad():
        for cache in (eager, reserved):
            with QuantPress(bits=4, group_size=8)(model):
                model(prompt(300), past_key_values=cache)
            steps = [model(torch.tensor([[t]]), past_key_values=cache).logits for t in range(100)]
            logits.append(torch.cat(steps, 1))
    assert (logits[0] - logits[1]).abs().max() < 1e-5
    layer = reserved.layers[0]
    held = int(layer.store.stats.count.sum(-1).max())
    whole = layer._pages_for(400)
    assert int(layer.store.table.cap.max()) <= layer._pages_for(held) < whole  # 100 more tokens fitted
    assert reserved.get_seq_length() == 400


@pytest.mark.parametrize("reserved, chunk", [(r, c) for r in (False, True) for c in (1, 3, 7, None)])
def test_left_padded_chunked_prefill_equals_dynamic_cache(reserved, chunk):
    """``generate(prefill_chunk_size=...)`` over left-padded rows of 7, 4 and 2 real tokens gives DynamicCache's logits
    and tokens. Chunks of one token bring a row's padding in one-token forwards: it takes no slot (it was stored as a
    real token). Decode steps read no mask once every row has had a real token (``rows_started``); a reserved cache
    would otherwise read the padding off generate's prepared mask at the step's ``cache_position``, which after a
    chunked prefill is one past the token's position (transformers 5.2), and drop the decode token as padding."""
    model, ref = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
    ids = torch.randint(3, 256, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :5] = 0
    kw = dict(attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0,
              output_logits=True, return_dict_in_generate=True, disable_compile=True)  # fmt: skip
    if chunk is not None:
        kw["prefill_chunk_size"] = chunk
    cache = PiKVCache(model, max_cache_len=16) if reserved else PiKVCache(model)
    want = ref.generate(ids, past_key_values=DynamicCache(), **kw)
    got = model.generate(ids, past_key_values=cache, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(got.logits, want.logits, strict=True)) < 1e-5
    assert cache.rows_started


def _interrupt(*_):
    raise KeyboardInterrupt  # Ctrl-C while layer 1's MLP runs


def test_a_forward_interrupted_by_a_base_exception_is_undone_at_the_next_forward():
    """torch runs ``always_call`` forward hooks on an ``Exception`` only: a KeyboardInterrupt (Ctrl-C in a notebook)
    in layer 1 left layers 0-1 holding its tokens, the forward marked running, and a stale "pikv" entry that made
    masks built outside a forward come out None; the next forward was 0.13 off DynamicCache, silently."""
    from pikv_hf import hf as pikv_hf_glue

    ref, model = tiny_model("llama"), tiny_model("llama")
    cache, dyn = PiKVCache(model, page_size=4), DynamicCache()
    ids = torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref(ids, past_key_values=dyn)
        model(ids, past_key_values=cache)
        handle = model.model.layers[1].mlp.register_forward_pre_hook(_interrupt)
        try:
            model(torch.tensor([[5, 6, 7]]), past_key_values=cache)
        except KeyboardInterrupt:
            pass
        finally:
            handle.remove()
        nxt = torch.tensor([[9, 10]])
        want, got = ref(nxt, past_key_values=dyn).logits, model(nxt, past_key_values=cache).logits
    assert (want - got).abs().max() < 1e-5 and cache.get_seq_length() == 8
    assert not cache.forward_running() and pikv_hf_glue._PIKV_FORWARDS == []


def test_a_forward_that_fails_before_storing_leaves_the_padding_check_on():
    """A forward failing before any layer stored (here PiKVCache's own refusal of a wrong batch) set rows_started:
    later one-token steps of a left-padded batch were not read for padding and stored the pads as tokens."""
    ref, model = tiny_model("llama"), tiny_model("llama")
    full = torch.tensor([[0, 0, 0, 1, 1], [1, 1, 1, 1, 1]])  # row 0: three pads, one token at a time
    ids = torch.randint(3, 200, (2, 5), generator=torch.Generator().manual_seed(1))
    cache, dyn = PiKVCache(model, page_size=4), DynamicCache()
    worst = 0.0
    with torch.no_grad():
        for t in range(5):
            mask = full[:, : t + 1]
            pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -1:]
            if t == 1:
                with pytest.raises(ValueError, match="batch size of key/value_states is 1, cache holds 2"):
                    model(input_ids=ids[:1, 1:2], attention_mask=mask[:1].new_ones(1, 2), past_key_values=cache)
                assert not cache.rows_started
            step = dict(input_ids=ids[:, t : t + 1], attention_mask=mask, position_ids=pos)
            a, b = ref(**step, past_key_values=dyn).logits, model(**step, past_key_values=cache).logits
            real = mask[:, -1].bool()
            worst = max(worst, (a[real] - b[real]).abs().max().item())
    assert worst < 1e-5


def test_crop_after_a_press_lets_a_reserved_cache_take_max_cache_len_again():
    """A press that re-packs a reserved layer leaves room for its tokens plus the positions still to come; crop frees
    positions, which come again. The reservation stayed shrunk: a 40-token prefill into max_cache_len=40 after
    H2O and crop(0) overflowed the runs (an IndexError that left the cache unusable; left-padded, wrong logits)."""
    from pikv_hf.presses import H2OPress

    model, ref = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
    cache = PiKVCache(model, page_size=4, num_shards=2, max_cache_len=40)
    with torch.no_grad():
        with H2OPress(0.5)(model):
            model(prompt(30), past_key_values=cache)
        cache.crop(0)
        ids = prompt(40, seed=2)
        got = model(ids, past_key_values=cache).logits
        want = ref(ids, past_key_values=DynamicCache()).logits
        assert (got - want).abs().max() < 1e-4
        assert cache.get_max_cache_shape() == 40  # as StaticCache reports it (it said -1, "no maximum")


@pytest.mark.parametrize("arch, reserved", [("gpt_oss", False), ("gpt_oss", True), ("llama", True)])
def test_attention_weights_cover_every_position_after_a_press(arch, reserved):
    """Attention weights are laid out one column per position: after an eviction (growing) or a press that moved
    tokens to a tier (reserved: a narrower frame) they were scattered into kv_length() columns, fewer than the
    positions seen: every forward computing them failed (each GPT-OSS prefill chunk, eager attention; any forward
    with output_attentions). Each query's weights sum to 1 over the positions its layer holds (GPT-OSS: less, its
    sinks take the rest)."""
    from pikv_hf.presses import QuantPress, StreamingLLMPress

    model = tiny_model(arch, seed=0)
    options = dict(max_cache_len=48) if reserved else {}
    cache = PiKVCache(model, page_size=4, num_shards=2, **options)
    press = QuantPress(bits=4, group_size=8, window=4) if reserved else StreamingLLMPress(0.5, n_sink=2)
    with torch.no_grad():
        with press(model):
            model(prompt(30), past_key_values=cache)
        out = model(prompt(8, seed=3), past_key_values=cache, output_attentions=True)
    weights = out.attentions[0]
    assert weights.shape[-1] >= 38
    total = weights.float().sum(-1)
    if arch == "gpt_oss":
        assert bool(((total > 0) & (total <= 1 + 1e-3)).all())
    else:
        torch.testing.assert_close(total, torch.ones(weights.shape[:-1]), atol=1e-3, rtol=0)
    if not reserved:  # evicted positions get no weight
        held = cache.layers[0].held_positions(38)[0]
        assert float(weights[0, :, :, :38][..., ~held].abs().max()) == 0.0


def test_chunked_generate_under_a_press_on_a_reserved_cache_equals_a_growing_one():
    """generate(prefill_chunk_size=3) with QuantPress: after a chunk's press the reserved frame was narrower than the
    next chunk's positions, and generate's 4-D mask (as wide as get_mask_sizes said) was indexed past its end."""
    from pikv_hf.presses import QuantPress

    model = tiny_model("llama", seed=0)
    ids = prompt(24)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=7, min_new_tokens=7, do_sample=False,
              pad_token_id=0, prefill_chunk_size=3, disable_compile=True)  # fmt: skip
    out = []
    for options in ({}, {"max_cache_len": 36}):
        cache = PiKVCache(model, page_size=1, num_shards=4, **options)
        with torch.no_grad(), QuantPress(bits=4, group_size=8, window=4)(model):
            out.append(model.generate(ids, past_key_values=cache, **kw))
    assert torch.equal(*out)
