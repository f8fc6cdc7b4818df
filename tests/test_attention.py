"""The pikv attention core against torch SDPA and dense float computations."""

import pytest
import torch
import torch.nn.functional as F

from pikv_hf.attention import merge_partials, partial_attention, reference


def masked_attention(*args, **kwargs):
    """The reference's output as the model sees it: ``[B, q, Hq, Dv]``."""
    return reference.masked_attention(*args, **kwargs)[0].transpose(1, 2)


def _sdpa_reference(query, keys, values, mask):
    """SDPA over contiguous keys with a boolean [B, 1|H, q, T] mask, GQA by repeating KV heads."""
    g = query.shape[1] // keys.shape[1]
    return F.scaled_dot_product_attention(
        query, keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1), attn_mask=mask
    ).transpose(1, 2)


def _shuffled_slots(keys, values, n_slots, gen):
    """Scatter contiguous tokens into a larger slot array in a random order, with empty slots left invalid."""
    b, h, t, _ = keys.shape
    perm = torch.stack([torch.randperm(n_slots, generator=gen)[:t] for _ in range(b * h)]).view(b, h, t)
    k = torch.randn(b, h, n_slots, keys.shape[-1], generator=gen)  # garbage in empty slots
    v = torch.randn(b, h, n_slots, values.shape[-1], generator=gen)
    k.scatter_(2, perm[..., None].expand_as(keys), keys)
    v.scatter_(2, perm[..., None].expand_as(values), values)
    pos = torch.zeros(b, h, n_slots, dtype=torch.int32).scatter_(
        2, perm, torch.arange(t, dtype=torch.int32).expand(b, h, t).contiguous()
    )
    valid = torch.zeros(b, h, n_slots, dtype=torch.bool).scatter_(2, perm, True)
    return k, v, pos, valid


@pytest.mark.parametrize("group_size", [1, 4, 8])
@pytest.mark.parametrize(("dk", "dv"), [(16, 16), (24, 16)])
def test_shuffled_slots_equal_sdpa_causal(group_size, dk, dv):
    gen = torch.Generator().manual_seed(0)
    b, h, t, q = 2, 2, 37, 5
    query = torch.randn(b, h * group_size, q, dk, generator=gen)
    keys, values = torch.randn(b, h, t, dk, generator=gen), torch.randn(b, h, t, dv, generator=gen)
    k, v, pos, valid = _shuffled_slots(keys, values, 64, gen)
    qpos = torch.arange(t - q, t)
    out = masked_attention(query, k, v, valid, pos, qpos, dk**-0.5)
    causal = torch.arange(t)[None, :] <= qpos[:, None]
    assert (out - _sdpa_reference(query, keys, values, causal[None, None])).abs().max() < 1e-5


def test_sliding_window_and_padding_equal_sdpa():
    gen = torch.Generator().manual_seed(1)
    b, h, t, q, d, w = 2, 2, 30, 4, 16, 7
    query = torch.randn(b, 2 * h, q, d, generator=gen)
    keys, values = torch.randn(b, h, t, d, generator=gen), torch.randn(b, h, t, d, generator=gen)
    k, v, pos, valid = _shuffled_slots(keys, values, 40, gen)
    pad = torch.ones(b, t, dtype=torch.bool)
    pad[1, :9] = False  # row 1 is left-padded
    valid &= pad.gather(1, pos.long().flatten(1)).view_as(valid)
    qpos = torch.arange(t - q, t)
    out = masked_attention(query, k, v, valid, pos, qpos, d**-0.5, sliding_window=w)
    rel = qpos[:, None] - torch.arange(t)[None, :]
    mask = ((rel >= 0) & (rel < w))[None, None] & pad[:, None, None, :]
    assert (out - _sdpa_reference(query, keys, values, mask)).abs().max() < 1e-5


def test_sinks_match_the_eager_softmax_with_a_sink_column():
    gen = torch.Generator().manual_seed(2)
    b, h, g, t, d = 1, 2, 2, 12, 8
    query = torch.randn(b, h * g, 1, d, generator=gen)
    keys, values = torch.randn(b, h, t, d, generator=gen), torch.randn(b, h, t, d, generator=gen)
    sinks = torch.randn(h * g, generator=gen)
    pos = torch.arange(t, dtype=torch.int32).expand(b, h, t)
    out = masked_attention(
        query, keys, values, torch.ones(b, h, t, dtype=torch.bool), pos, torch.tensor([t - 1]), d**-0.5, sinks=sinks
    )
    logits = query @ keys.repeat_interleave(g, 1).transpose(-1, -2) * d**-0.5  # [B, Hq, 1, T]
    full = torch.cat([logits, sinks.view(1, -1, 1, 1)], dim=-1).softmax(-1)[..., :-1]
    expected = (full @ values.repeat_interleave(g, 1)).transpose(1, 2)
    assert (out - expected).abs().max() < 1e-6


def test_per_shard_groups_merge_exactly_and_mass_is_the_softmax():
    gen = torch.Generator().manual_seed(3)
    b, h, g, c, d = 2, 2, 4, 50, 16
    query = torch.randn(b, h * g, 3, d, generator=gen)
    keys, values = torch.randn(b, h, c, d, generator=gen), torch.randn(b, h, c, d, generator=gen)
    pos = torch.randperm(c, generator=gen).to(torch.int32).expand(b, h, c)
    valid = torch.rand(b, h, c, generator=gen) < 0.8
    shard = torch.randint(0, 5, (b, h, c), generator=gen)
    qpos = torch.tensor([c - 3, c - 2, c - 1])
    whole, whole_lse, whole_mass = reference.masked_attention(
        query, keys, values, valid, pos, qpos, 0.3, want_mass=True
    )
    split, split_lse, _ = reference.masked_attention(
        query, keys, values, valid, pos, qpos, 0.3, group_of_slot=shard, groups=5
    )
    assert (whole - split).abs().max() < 1e-6 and (whole_lse - split_lse).abs().max() < 1e-5
    # independent dense softmax: attention probabilities summed over each KV head's query rows
    allowed = valid[:, :, None, :] & (pos[:, :, None, :] <= qpos.view(1, 1, -1, 1))
    logits = (query.view(b, h, g, 3, d) @ keys[:, :, None].transpose(-1, -2)) * 0.3
    masked = logits.masked_fill(~allowed[:, :, None], float("-inf"))
    assert (whole_mass - masked.softmax(-1).sum(dim=(2, 3))).abs().max() < 1e-5
    assert (whole_lse - masked.logsumexp(-1).view(b, h * g, 3)).abs().max() < 1e-5


def test_merge_of_split_key_sets_is_the_full_softmax():
    gen = torch.Generator().manual_seed(4)
    logits, values = torch.randn(1, 2, 3, 20, generator=gen), torch.randn(1, 2, 20, 8, generator=gen)
    cut = torch.zeros(20, dtype=torch.bool)
    cut[[1, 5, 6, 11, 19]] = True
    part_a = partial_attention(logits.masked_fill(cut, float("-inf")), values)
    part_b = partial_attention(logits.masked_fill(~cut, float("-inf")), values)
    empty = partial_attention(torch.full_like(logits, float("-inf")), values)
    o, lse = merge_partials([part_a, empty, part_b])
    assert (o - logits.softmax(-1) @ values).abs().max() < 1e-6
    assert (lse - logits.logsumexp(-1)).abs().max() < 1e-6
    assert torch.equal(empty[0], torch.zeros_like(empty[0])) and torch.isinf(empty[1]).all()


def test_a_store_with_no_selected_slot_is_an_empty_partial():
    # a routed read that chooses no page of one tier gives that tier zero slots: it adds nothing to the merge
    gen = torch.Generator().manual_seed(6)
    query = torch.randn(2, 4, 1, 8, generator=gen)
    keys, values = torch.randn(2, 2, 9, 8, generator=gen), torch.randn(2, 2, 9, 8, generator=gen)
    pos = torch.arange(9).expand(2, 2, 9)
    ok = torch.ones(2, 2, 9, dtype=torch.bool)
    qpos = torch.tensor([9])
    none = reference.masked_attention(query, keys[:, :, :0], values[:, :, :0], ok[..., :0], pos[..., :0], qpos, 0.3)
    assert torch.equal(none[0], torch.zeros(2, 4, 1, 8)) and torch.isinf(none[1]).all() and (none[1] < 0).all()
    whole = reference.masked_attention(query, keys, values, ok, pos, qpos, 0.3)
    o, lse = merge_partials([whole[:2], none[:2]])
    logits = (query.view(2, 2, 2, 8) @ keys.transpose(-1, -2)) * 0.3
    assert (o.view(2, 2, 2, 8) - logits.softmax(-1) @ values).abs().max() < 1e-6
    assert (lse.view(2, 2, 2) - logits.logsumexp(-1)).abs().max() < 1e-6


def test_query_chunking_does_not_change_results(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(1, 4, 33, 8, generator=gen)
    keys, values = torch.randn(1, 2, 40, 8, generator=gen), torch.randn(1, 2, 40, 8, generator=gen)
    pos = torch.arange(40, dtype=torch.int32).expand(1, 2, 40)
    valid = torch.ones(1, 2, 40, dtype=torch.bool)
    qpos = torch.arange(7, 40)
    one = masked_attention(query, keys, values, valid, pos, qpos, 0.35)
    monkeypatch.setattr(reference, "_SCORE_BUDGET_BYTES", 4 * 40 * 4 * 5)  # 5 query rows per chunk
    assert (one - masked_attention(query, keys, values, valid, pos, qpos, 0.35)).abs().max() < 1e-6


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_fused_prefill_equals_masked_attention(sliding_window, monkeypatch):
    """A prefill chunk into a store that holds tokens goes through the CPU flash kernel: the same output and
    log-sum-exp as the masked reference, row chunks included (a small score budget), a query row with no readable slot
    (left padding) has ``lse = -inf``."""
    from pikv_hf.attention import backend

    monkeypatch.setattr(backend, "_SCORE_BUDGET_BYTES", 2 * 6 * 40 * 4)  # two query rows per chunk
    g = torch.Generator().manual_seed(0)
    b, h, hq, q, c, d = 2, 2, 6, 7, 40, 8
    query, keys, values = (torch.randn(*s, generator=g) for s in ((b, hq, q, d), (b, h, c, d), (b, h, c, d)))
    pos = torch.randperm(c, generator=g).expand(b, h, c).clone()  # slots in any order, as pages hold them
    ok = torch.rand(b, h, c, generator=g) > 0.2
    ok[1, 0] = pos[1, 0] >= 38  # row 1, KV head 0: the first query rows see no slot
    qpos = torch.arange(33, 33 + q)
    o, lse = backend.fused_prefill(query, keys, values, ok, pos, qpos, sliding_window, 0.3)
    o_ref, lse_ref, _ = reference.masked_attention(query, keys, values, ok, pos, qpos, 0.3, sliding_window)
    assert torch.isneginf(lse_ref[1, :3, 0]).all() and torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    finite = ~torch.isneginf(lse_ref)
    assert (lse[finite] - lse_ref[finite]).abs().max() < 1e-5 and (o - o_ref).abs().max() < 1e-5
