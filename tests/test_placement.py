"""Placement routers: valid shard ids, and each router's own definition checked independently."""

import pytest
import torch
from helpers import model_pair, pikv, prompt

from pikv_hf.routing import KeyClusterPlacement, PlacementContext, RoundRobinPlacement, make_placement


def _ctx(keys, start=0, page_size=4, shards=5):
    q = keys.shape[2]
    return PlacementContext(0, keys, torch.arange(start, start + q), page_size, shards)


def test_round_robin_gives_whole_pages_to_shards_in_turn():
    keys = torch.randn(2, 3, 30, 8)
    shard = RoundRobinPlacement(5).place(_ctx(keys, start=7))
    expected = (torch.arange(7, 37) // 4) % 5
    assert torch.equal(shard, expected.expand(2, 3, 30))


def test_key_cluster_is_online_kmeans():
    gen = torch.Generator().manual_seed(0)
    router = KeyClusterPlacement(4)
    chunks = [torch.randn(2, 2, n, 6, generator=gen) for n in (9, 1, 5, 1)]
    assigned, start = [], 0
    for keys in chunks:
        before = None if router.centroids is None else router.centroids.clone()
        shard = router.place(_ctx(keys, start, shards=4))
        assert shard.shape == keys.shape[:3] and shard.min() >= 0 and shard.max() < 4
        if before is not None:  # assignment = nearest centroid at call time (squared L2)
            d = ((keys[:, :, :, None] - before[:, :, None]) ** 2).sum(-1)
            assert torch.equal(shard, d.argmin(-1))
        assigned.append(shard)
        start += keys.shape[2]
    keys, shard = torch.cat(chunks, 2), torch.cat(assigned, 2)
    onehot = torch.nn.functional.one_hot(shard, 4).float()
    counts = onehot.sum(2)
    means = (onehot.transpose(2, 3) @ keys) / counts.clamp(min=1)[..., None]
    assert torch.equal(router.counts, counts.long())
    assert (router.centroids - means).abs().max() < 1e-5  # exact running means of assigned keys


def test_expert_placement_follows_the_previous_layers_router():
    _, model = model_pair("mixtral")
    captured = {}
    gate = model.model.layers[0].mlp.gate

    def keep_logits(module, args, out):
        captured["logits"] = out[0]

    handle = gate.register_forward_hook(keep_logits)
    try:
        cache = pikv(model, "expert", num_shards=4)
        with torch.no_grad():
            model(prompt(29), past_key_values=cache)
    finally:
        handle.remove()
    top1 = captured["logits"].argmax(-1)  # [T] top expert at layer 0, computed from the gate's own output
    store = cache.layers[1].store
    valid = store.valid[0, 0]
    token_shard = torch.empty(29, dtype=torch.long)
    token_shard[store.pos[0, 0][valid].long()] = store.slot_shard()[0, 0][valid]
    assert torch.equal(token_shard, top1)
    assert cache.layers[0].placement.source is None  # layer 0: round-robin fallback
    assert cache.layers[0].placement.fallback_tokens == 29


def test_expert_placement_maps_experts_onto_fewer_shards():
    _, model = model_pair("mixtral")
    cache = pikv(model, "expert", num_shards=3)
    with torch.no_grad():
        model(prompt(40), past_key_values=cache)
    assert cache.tokens_per_shard().shape == (3, 3) and int(cache.tokens_per_shard()[1].sum()) == 40 * 2


def test_make_placement_rejects_unknown_names():
    with pytest.raises(ValueError, match="router must be one of"):
        make_placement("nearest", 4, 0)
    with pytest.raises(ValueError, match="router='expert' needs the model"):
        make_placement("expert", 4, 0)
