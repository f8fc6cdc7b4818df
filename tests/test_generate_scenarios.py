"""Batching, sampling, beam search, chunked prefill, multi-turn and direct forward loops against DynamicCache."""

import pytest
import torch
from helpers import SCENARIO_CASES, TOL, DynamicCache, generate, max_logit_diff, model_pair, pikv, prompt

from pikv_hf.routing import KeyClusterPlacement


@pytest.mark.parametrize(("arch", "router"), SCENARIO_CASES)
def test_left_padded_batch_rows_equal_prompts_alone(arch, router):
    ref, model = model_pair(arch)
    lengths = [12, 29, 20]
    width = max(lengths)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    rows = [prompt(n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = row
        mask[i, width - len(row) :] = 1
    batch = generate(model, ids, pikv(model, router), attention_mask=mask)
    for i, row in enumerate(rows):
        alone = generate(ref, row[None], DynamicCache())
        assert torch.equal(batch.sequences[i, width:], alone.sequences[0, len(row) :])
        diff = max(abs(b[i] - a[0]).max().item() for b, a in zip(batch.logits, alone.logits, strict=True))
        assert diff < TOL


@pytest.mark.parametrize(("arch", "router"), SCENARIO_CASES)
def test_sampling_with_fixed_seed(arch, router):
    ref, model = model_pair(arch)
    ids = prompt(21)
    torch.manual_seed(123)
    out_ref = generate(ref, ids, DynamicCache(), do_sample=True, top_k=0, temperature=1.5)
    torch.manual_seed(123)
    out = generate(model, ids, pikv(model, router), do_sample=True, top_k=0, temperature=1.5)
    assert torch.equal(out_ref.sequences, out.sequences)
    assert max_logit_diff(out_ref.logits, out.logits) < TOL


@pytest.mark.parametrize(("arch", "router"), SCENARIO_CASES)
def test_beam_search_three_beams(arch, router):
    ref, model = model_pair(arch)
    ids = prompt(19)
    kw = dict(num_beams=3, num_return_sequences=3, output_scores=True, max_new_tokens=6)
    out_ref = generate(ref, ids, DynamicCache(), **kw)
    out = generate(model, ids, pikv(model, router), **kw)
    assert torch.equal(out_ref.sequences, out.sequences)
    assert torch.allclose(out_ref.sequences_scores, out.sequences_scores, atol=TOL)


@pytest.mark.parametrize(("arch", "router"), SCENARIO_CASES)
def test_chunked_prefill_in_generate(arch, router):
    # transformers 5.2's chunked prefill moves the decode positions by one (REFERENCE.md section 1), for every
    # cache, so the reference is DynamicCache under the same chunking. For sliding-window layers (GPT-OSS) its
    # DynamicCache masks are off by that position too (decode logits drift by up to 0.75 from unchunked
    # generation), while PiKVCache masks by stored order; there only the prefill step is compared here and
    # test_chunked_prefill_equals_one_shot_prefill checks exactness.
    ref, model = model_pair(arch)
    ids = prompt(45)
    out_ref = generate(ref, ids, DynamicCache(), prefill_chunk_size=16)
    cache = pikv(model, router)
    chunks = []
    update = cache.update

    def recording_update(k, v, layer_idx, cache_kwargs=None):
        if layer_idx == 0:
            chunks.append(k.shape[2])
        return update(k, v, layer_idx, cache_kwargs)

    cache.update = recording_update
    out = generate(model, ids, cache, prefill_chunk_size=16)
    assert chunks[:3] == [16, 16, 13] and set(chunks[3:]) == {1}
    assert (out_ref.logits[0] - out.logits[0]).abs().max().item() < TOL
    if "sliding_attention" not in (getattr(model.config, "layer_types", None) or []):
        assert torch.equal(out_ref.sequences, out.sequences)
        assert max_logit_diff(out_ref.logits, out.logits) < TOL


@pytest.mark.parametrize(("arch", "router"), SCENARIO_CASES)
def test_chunked_prefill_equals_one_shot_prefill(arch, router):
    ref, model = model_pair(arch)
    ids = prompt(45)
    ref_cache, cache = DynamicCache(), pikv(model, router)
    with torch.no_grad():
        logits_ref = ref(ids, past_key_values=ref_cache).logits
        logits = torch.cat([model(c, past_key_values=cache).logits for c in ids.split(16, dim=1)], dim=1)
        assert (logits_ref - logits).abs().max().item() < TOL
        for _ in range(6):
            nxt = logits_ref[:, -1:].argmax(-1)
            logits_ref = ref(nxt, past_key_values=ref_cache).logits
            logits = model(nxt, past_key_values=cache).logits
            assert (logits_ref - logits).abs().max().item() < TOL


@pytest.mark.parametrize(("arch", "router"), SCENARIO_CASES)
def test_two_successive_generate_calls_on_one_cache(arch, router):
    ref, model = model_pair(arch)
    ids = prompt(17)
    ref_cache, cache = DynamicCache(), pikv(model, router)
    first_ref = generate(ref, ids, ref_cache, max_new_tokens=5)
    first = generate(model, ids, cache, max_new_tokens=5)
    assert torch.equal(first_ref.sequences, first.sequences)
    follow_up = torch.cat([first.sequences, prompt(9, seed=7)], dim=1)
    second_ref = generate(ref, follow_up, ref_cache, max_new_tokens=6)
    second = generate(model, follow_up, cache, max_new_tokens=6)
    assert torch.equal(second_ref.sequences, second.sequences)
    assert max_logit_diff(second_ref.logits, second.logits) < TOL
    # the reused cache answers what a fresh run over the whole conversation answers
    fresh = generate(ref, follow_up, DynamicCache(), max_new_tokens=6)
    assert torch.equal(fresh.sequences, second.sequences)


def test_a_second_turn_mask_hiding_held_tokens_is_refused_and_one_hiding_padding_is_not():
    """A left-padded batch's second turn on the same cache: its mask's zeros at the first turn's left padding (which
    the cache holds no token of) are read as before and the turn equals DynamicCache's; zeros at tokens the cache holds
    (rows' tokens after their end of sequence, masked by the caller) made the exact cache attend to them, 0.66 logits
    off DynamicCache, with no error; they are now refused before the forward changes the cache."""
    ref, model = model_pair("llama")
    lengths, width = [7, 15, 11], 15
    ids, mask = torch.zeros(3, width, dtype=torch.long), torch.zeros(3, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n :], mask[i, width - n :] = prompt(n, seed=10 + i)[0], 1
    kwargs = dict(pad_token_id=0, do_sample=False, return_dict_in_generate=True, output_logits=True)
    ref_cache, cache = DynamicCache(), pikv(model, "round_robin")
    first = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=4, **kwargs)
    ref.generate(ids, attention_mask=mask, past_key_values=ref_cache, max_new_tokens=4, **kwargs)
    ids2 = torch.cat([first.sequences, prompt(5, batch=3, seed=99)], 1)
    mask2 = torch.cat([mask, torch.ones(3, ids2.shape[1] - width, dtype=torch.long)], 1)
    hidden = mask2.clone()
    hidden[1, width + 1] = 0  # a generated token of row 1, held by the cache
    seen = cache.get_seq_length()
    with pytest.raises(ValueError, match=f"attention_mask is 0 at position {width + 1} of row 1, which this PiKVCache"):
        model.generate(ids2, attention_mask=hidden, past_key_values=cache, max_new_tokens=3, **kwargs)
    assert cache.get_seq_length() == seen
    second = model.generate(ids2, attention_mask=mask2, past_key_values=cache, max_new_tokens=3, **kwargs)
    second_ref = ref.generate(ids2, attention_mask=mask2, past_key_values=ref_cache, max_new_tokens=3, **kwargs)
    assert torch.equal(second.sequences, second_ref.sequences)
    assert max_logit_diff(second.logits, second_ref.logits) < TOL


@pytest.mark.parametrize(("arch", "router"), SCENARIO_CASES)
def test_direct_forward_loop(arch, router):
    ref, model = model_pair(arch)
    ids = prompt(23)
    ref_cache, cache = DynamicCache(), pikv(model, router)
    with torch.no_grad():
        logits_ref = ref(ids, past_key_values=ref_cache).logits[:, -1]
        logits = model(ids, past_key_values=cache).logits[:, -1]
        for _ in range(6):
            assert (logits_ref - logits).abs().max().item() < TOL
            nxt = logits_ref.argmax(-1, keepdim=True)
            logits_ref = ref(nxt, past_key_values=ref_cache).logits[:, -1]
            logits = model(nxt, past_key_values=cache).logits[:, -1]
    assert (logits_ref - logits).abs().max().item() < TOL
    assert cache.get_seq_length() == ref_cache.get_seq_length() == 29


def test_key_cluster_router_state_follows_beam_reordering():
    _, model = model_pair("mixtral")
    cache = pikv(model, "key_cluster")
    generate(model, prompt(19), cache, num_beams=3, max_new_tokens=4)
    placement = cache.layers[1].placement
    assert isinstance(placement, KeyClusterPlacement)
    assert placement.centroids.shape[0] == 3 and placement.counts.sum(-1).eq(22).all()


def test_left_padding_in_earlier_mask_columns_costs_no_scan_of_the_stores(monkeypatch):
    """Later chunks of a left-padded prefill carry the padding's zeros in their earlier mask columns: those hide
    nothing the cache holds, so the history check answers from each row's first real position (no store scan)."""
    from pikv_hf.layer import PiKVLayer

    ref, model = model_pair("llama")
    ids, mask = prompt(24, batch=2), torch.ones(2, 24, dtype=torch.long)
    mask[0, :9] = 0
    cache, ref_cache = pikv(model, "round_robin"), DynamicCache()
    with torch.no_grad():
        model(input_ids=ids[:, :12], attention_mask=mask[:, :12], past_key_values=cache)
        monkeypatch.setattr(PiKVLayer, "held_positions", lambda *a: pytest.fail("scanned the stores"))
        got = model(input_ids=ids[:, 12:], attention_mask=mask, past_key_values=cache).logits
        ref(input_ids=ids[:, :12], attention_mask=mask[:, :12], past_key_values=ref_cache)
        want = ref(input_ids=ids[:, 12:], attention_mask=mask, past_key_values=ref_cache).logits
    assert max_logit_diff(got[1:], want[1:]) < TOL  # the unpadded row (the padded one's positions are the caller's)
