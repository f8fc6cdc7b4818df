"""Sparse upcycling of a tiny random Llama: same logits, k-means routers, meaningful expert choice, bad input."""

from __future__ import annotations

import pytest
import torch
from fixtures.tiny_assets import tiny_llama

from pikv_hf.models import collect_mlp_inputs, spherical_kmeans, upcycle_to_moe

NUM_EXPERTS, TOP_K = 4, 2


@pytest.fixture(scope="module")
def pair():
    dense = tiny_llama(vocab_size=300, seed=1)
    gen = torch.Generator().manual_seed(0)
    calibration = torch.randint(0, 300, (2, 48), generator=gen)
    moe = upcycle_to_moe(dense, NUM_EXPERTS, TOP_K, calibration, seed=0)
    return dense, moe, calibration


def test_upcycled_logits_equal_dense(pair):
    dense, moe, _ = pair
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        diff = (dense(ids).logits - moe(ids).logits).abs().max().item()
    assert type(moe).__name__ == "MixtralForCausalLM"
    assert moe.config.num_local_experts == NUM_EXPERTS and moe.config.num_experts_per_tok == TOP_K
    assert diff < 1e-4


def test_upcycled_greedy_generation_equals_dense(pair):
    dense, moe, _ = pair
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(9))
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 2}
    assert torch.equal(dense.generate(ids, **kwargs), moe.generate(ids, **kwargs))


def test_router_rows_are_the_kmeans_centroids_of_mlp_inputs(pair):
    dense, moe, calibration = pair
    hidden = collect_mlp_inputs(dense, calibration)
    for i, layer in enumerate(moe.model.layers):
        rows = layer.mlp.gate.weight.detach().double()
        x = torch.nn.functional.normalize(hidden[i].double(), dim=-1)
        assign = (x @ rows.T).argmax(-1)
        # Lloyd fixed point: every row is the normalised mean of the points nearest to it (cosine)
        for e in range(NUM_EXPERTS):
            members = x[assign == e]
            assert len(members) > 0
            centroid = torch.nn.functional.normalize(members.sum(0), dim=0)
            assert torch.allclose(rows[e], centroid, atol=1e-5)
        assert torch.allclose(rows.norm(dim=-1), torch.ones(NUM_EXPERTS, dtype=torch.float64), atol=1e-5)


def test_experts_chosen_differ_across_tokens(pair):
    _, moe, calibration = pair
    chosen = []
    hook = moe.model.layers[0].mlp.experts.register_forward_pre_hook(lambda m, args: chosen.append(args[1].clone()))
    try:
        with torch.no_grad():
            moe(calibration)
    finally:
        hook.remove()
    top1 = chosen[0][:, 0]
    assert len(torch.unique(top1)) == NUM_EXPERTS  # every expert is somebody's first choice


def test_spherical_kmeans_on_separated_clusters():
    centres = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([c + 0.05 * torch.randn(30, 3, generator=gen) for c in centres])
    cent, assign = spherical_kmeans(x, 3, seed=0)
    # each true cluster maps to one centroid, close to its direction
    for k in range(3):
        labels = assign[30 * k : 30 * (k + 1)]
        assert torch.all(labels == labels[0])
        assert torch.dot(cent[labels[0]], centres[k]) > 0.99


def test_bad_input_is_rejected_before_any_work():
    dense = tiny_llama(vocab_size=300, seed=1)
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="num_experts must be >= 2"):
        upcycle_to_moe(dense, 1, 1, ids)
    with pytest.raises(ValueError, match="top_k must be in"):
        upcycle_to_moe(dense, 4, 5, ids)
    with pytest.raises(ValueError, match="calibration_ids must be"):
        upcycle_to_moe(dense, 4, 2, torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="k must be in"):
        spherical_kmeans(torch.randn(3, 4), 5)
