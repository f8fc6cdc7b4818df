"""Placement routers: valid shard ids, and each router's own definition checked independently."""

import pytest
import torch
from helpers import model_pair, pikv, prompt, shard_of_positions

from pikv_hf import PiKVCache
from pikv_hf.routing import KeyClusterPlacement, PlacementContext, RoundRobinPlacement, make_placement


def _ctx(keys, start=0, page_size=4, shards=5):
    q = keys.shape[2]
    return PlacementContext(0, keys, torch.arange(start, start + q), page_size, shards)


def test_round_robin_gives_whole_pages_to_shards_in_turn():
    keys = torch.randn(2, 3, 30, 8)
    shard = RoundRobinPlacement(5).place(_ctx(keys, start=7))
    expected = (torch.arange(7, 37) // 4) % 5
    assert torch.equal(shard, expected.expand(2, 3, 30))


def test_key_cluster_with_one_step_is_online_kmeans():
    gen = torch.Generator().manual_seed(0)
    router = KeyClusterPlacement(4, iters=1)
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


def _lloyd_reference(chunks, s, iters):
    """Per (row, head) Python loops: seed, then Lloyd steps over each chunk with earlier tokens' shards fixed."""
    b, h = chunks[0].shape[:2]
    out = torch.empty(b, h, sum(c.shape[2] for c in chunks), dtype=torch.long)
    for bi in range(b):
        for hi in range(h):
            members: list[list[torch.Tensor]] = [[] for _ in range(s)]
            cents: list[torch.Tensor] = []
            start = 0
            for chunk in chunks:
                x = chunk[bi, hi]
                if len(cents) < s:
                    m = min(s - len(cents), len(x))
                    cents += [x[int(round(i))].clone() for i in torch.linspace(0, len(x) - 1, m).tolist()]
                assign = None
                for _ in range(iters if len(x) > 1 else 1):
                    new = [min(range(len(cents)), key=lambda j: float(((v - cents[j]) ** 2).sum())) for v in x]
                    if new == assign:
                        break
                    assign = new
                    for j in range(len(cents)):
                        pts = members[j] + [v for v, a in zip(x, assign, strict=True) if a == j]
                        if pts:
                            cents[j] = torch.stack(pts).mean(0)
                for v, a in zip(x, assign, strict=True):
                    members[a].append(v)
                out[bi, hi, start : start + len(x)] = torch.tensor(assign)
                start += len(x)
    return out


def test_key_cluster_runs_lloyd_steps_within_a_chunk():
    gen = torch.Generator().manual_seed(1)
    chunks = [torch.randn(2, 2, n, 5, generator=gen) for n in (23, 1, 11, 1)]
    chunks[0][:, :, 12:] += 3.0  # two blobs in the first chunk
    router = KeyClusterPlacement(4, iters=8)
    shards, start = [], 0
    for keys in chunks:
        shards.append(router.place(_ctx(keys, start, shards=4)))
        start += keys.shape[2]
    shard, keys = torch.cat(shards, 2), torch.cat(chunks, 2)
    assert torch.equal(shard, _lloyd_reference(chunks, 4, 8))
    onehot = torch.nn.functional.one_hot(shard, 4).float()
    means = (onehot.transpose(2, 3) @ keys) / onehot.sum(2).clamp(min=1)[..., None]
    assert (router.centroids - means).abs().max() < 1e-5


def test_key_cluster_lloyd_steps_lower_the_kmeans_objective():
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(2, 2, 40, 5, generator=gen)
    keys[:, :, ::3] += 4.0

    def objective(iters):
        router = KeyClusterPlacement(4, iters=iters)
        shard = router.place(_ctx(keys, 0, shards=4))
        cent = router.centroids.gather(2, shard[..., None].expand(-1, -1, -1, 5))
        return float(((keys - cent) ** 2).sum())

    assert objective(8) < objective(1)


def test_key_cluster_rejects_bad_iters():
    with pytest.raises(ValueError, match="iters must be an integer >= 1, got 0"):
        KeyClusterPlacement(4, iters=0)


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
    token_shard = shard_of_positions(cache.layers[1].store, 29)[0, 0]
    assert torch.equal(token_shard, top1)
    assert cache.layers[0].placement.source is None  # layer 0: round-robin fallback
    assert cache.layers[0].placement.fallback_tokens == 29


@pytest.mark.parametrize("arch", ["phimoe", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"])
@pytest.mark.parametrize("seed", [1, 5])
def test_expert_placement_is_the_routers_first_choice(arch, seed):
    """A token's shard is the expert with the largest router logit at the layer before (the router's first choice).
    PhiMoE's sparsemixer can weigh its second choice 1.0 and its first 0.5: the largest weight placed 4 of 30 tokens
    on the second choice's shard."""
    from pikv_hf.tiny import tiny_model

    model = tiny_model(arch, seed=seed)
    mlp = model.model.layers[0].mlp
    router = getattr(mlp, "router", None) or mlp.gate
    captured = {}
    handle = router.register_forward_hook(lambda m, a, out: captured.update(logits=out[0]))
    experts = mlp.experts.num_experts if hasattr(mlp.experts, "num_experts") else model.config.num_local_experts
    ids = torch.randint(3, 200, (1, 30), generator=torch.Generator().manual_seed(seed))
    try:
        cache = PiKVCache(model, router="expert", num_shards=experts, page_size=1)
        with torch.no_grad():
            model(ids, past_key_values=cache)
    finally:
        handle.remove()
    first_choice = captured["logits"].reshape(30, -1).argmax(-1)  # the gate's own output, layer 0
    assert torch.equal(shard_of_positions(cache.layers[1].store, 30)[0, 0], first_choice)


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
