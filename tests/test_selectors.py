"""Selection routers: contract matrix, constructed cases per selector, learning, bad input.

Summaries are built from real synthetic keys (centroid / min / max / counts computed from the keys of each shard),
and recall is the attention mass a dense softmax over those keys puts on the selected shards.
"""

from __future__ import annotations

import math

import pytest
import torch

from pikv_hf.routing.adaptive import AdaptiveSelector
from pikv_hf.routing.base import ShardSummary
from pikv_hf.routing.eplb import EPLBSelector
from pikv_hf.routing.hierarchical import HierarchicalSelector, cluster_shards
from pikv_hf.routing.scores import bound_scores, centroid_scores, estimated_mass, masked_topk
from pikv_hf.routing.selectors import SELECTORS, make_selector
from pikv_hf.routing.topk import TopKSelector

NAMES = sorted(SELECTORS)


def summarize(keys: torch.Tensor, shard: torch.Tensor, num_shards: int) -> ShardSummary:
    """ShardSummary of ``keys`` ``[B, H, N, D]`` placed in ``shard`` ``[B, H, N]`` (independent computation)."""
    member = torch.nn.functional.one_hot(shard, num_shards).transpose(-1, -2).bool()  # [B, H, S, N]
    counts = member.sum(-1)
    centroids = (member.float() @ keys) / counts.clamp(min=1).unsqueeze(-1)
    spread = keys.unsqueeze(2).expand(-1, -1, num_shards, -1, -1)
    key_min = spread.masked_fill(~member.unsqueeze(-1), math.inf).amin(-2)
    key_max = spread.masked_fill(~member.unsqueeze(-1), -math.inf).amax(-2)
    return ShardSummary(
        centroids=centroids,
        counts=counts,
        key_min=key_min,
        key_max=key_max,
        resident=torch.ones_like(counts, dtype=torch.bool),
        misses=torch.zeros_like(counts),
    )


def clustered_case(
    seed: int, b: int = 2, h: int = 3, s: int = 8, g: int = 4, d: int = 16, n: int = 256, empty: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ShardSummary]:
    """Keys drawn around one random centre per shard (none in ``empty`` shards) and random queries."""
    gen = torch.Generator().manual_seed(seed)
    centres = 2.0 * torch.randn(b, h, s, d, generator=gen)
    allowed = torch.tensor([e for e in range(s) if e not in empty])
    shard = allowed[torch.randint(len(allowed), (b, h, n), generator=gen)]
    keys = centres.gather(2, shard.unsqueeze(-1).expand(b, h, n, d)) + torch.randn(b, h, n, d, generator=gen)
    query = torch.randn(b, h, g, d, generator=gen)
    return query, keys, shard, summarize(keys, shard, s)


def recall(query: torch.Tensor, keys: torch.Tensor, shard: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """``[B, H]`` attention mass (dense softmax, mean over query rows) on tokens of the ``selected`` shards."""
    attn = torch.softmax(query @ keys.transpose(-1, -2) / math.sqrt(query.shape[-1]), dim=-1)  # [B, H, G, N]
    in_selected = (shard.unsqueeze(-1) == selected.unsqueeze(-2)).any(-1)  # [B, H, N]
    return (attn * in_selected.unsqueeze(-2)).sum(-1).mean(-1)


def line_case(counts: list[int], levels: list[float], spreads: list[float] | None = None, seed: int = 0):
    """One batch row / head; shard ``s`` holds ``counts[s]`` keys at ``levels[s] * e0`` (+ noise)."""
    gen = torch.Generator().manual_seed(seed)
    d = 4
    spreads = spreads or [0.01] * len(counts)
    blocks, ids = [], []
    for s, (c, level, spread) in enumerate(zip(counts, levels, spreads, strict=True)):
        centre = torch.zeros(d)
        centre[0] = level
        blocks.append(centre + spread * torch.randn(c, d, generator=gen))
        ids.append(torch.full((c,), s))
    keys = torch.cat(blocks).view(1, 1, -1, d)
    shard = torch.cat(ids).view(1, 1, -1)
    query = torch.zeros(1, 1, 1, d)
    query[..., 0] = 1.0
    return query, keys, shard, summarize(keys, shard, len(counts))


# ----------------------------------------------------------------------------------------------- shared scoring


def test_scores_match_independent_computation() -> None:
    query, keys, shard, summary = clustered_case(0, empty=(3,))
    scores = centroid_scores(query, summary)
    naive = torch.einsum("bhgd,bhsd->bhgs", query, summary.centroids).amax(2)
    assert torch.isinf(scores[..., 3]).all() and (scores[..., 3] < 0).all()
    torch.testing.assert_close(scores[..., [0, 1, 2, 4, 5, 6, 7]], naive[..., [0, 1, 2, 4, 5, 6, 7]])
    bound = bound_scores(query, summary)
    # An upper bound of q . k over every key of the shard, tight enough to be below the sum of |q| |k|_inf.
    dots = query @ keys.transpose(-1, -2)  # [B, H, G, N]
    member = shard.unsqueeze(-2) == torch.arange(8).view(1, 1, 8, 1)  # [B, H, S, N]
    best = dots.unsqueeze(3).masked_fill(~member.unsqueeze(2), -math.inf).amax(-1).amax(2)  # [B, H, S]
    assert (bound[..., [0, 1, 2, 4, 5, 6, 7]] >= best[..., [0, 1, 2, 4, 5, 6, 7]] - 1e-4).all()
    assert torch.isinf(bound[..., 3]).all()


def test_estimated_mass_is_the_exact_share_when_shards_hold_copies_of_one_key() -> None:
    # zero variance inside every shard: n * exp(s q.mu) is exactly the shard's unnormalised softmax mass
    g = torch.Generator().manual_seed(5)
    b, h, gq, s, d, scale = 2, 2, 3, 5, 8, 0.35
    distinct = torch.randn(b, h, s, d, generator=g)
    shard = torch.randint(0, s - 1, (b, h, 40), generator=g)  # shard s-1 stays empty
    keys = distinct.gather(2, shard[..., None].expand(-1, -1, -1, d))
    query = torch.randn(b, h, gq, d, generator=g)
    summary = summarize(keys, shard, s)
    summary.key_var = torch.zeros_like(summary.centroids)
    probs = torch.softmax(scale * query @ keys.transpose(-1, -2), dim=-1)  # [B, H, G, N]
    exact = (probs @ torch.nn.functional.one_hot(shard, s).float()).mean(2)  # [B, H, S]
    share = estimated_mass(query, summary, scale)
    assert torch.allclose(share, exact, atol=1e-5) and torch.all(share[..., -1] == 0)


def test_estimated_mass_variance_term_matches_a_gaussian_shard() -> None:
    # many keys drawn from N(mu, diag(var)): the Gaussian moment generating function gives each shard's mass
    g = torch.Generator().manual_seed(6)
    d, n, scale = 4, 20000, 0.5
    mu = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, -0.5, 0.0, 0.5]])
    std = torch.tensor([[1.5, 1.0, 0.5, 1.0], [0.2, 0.2, 0.2, 0.2]])
    keys = (mu[:, None] + std[:, None] * torch.randn(2, n, d, generator=g)).reshape(1, 1, 2 * n, d)
    shard = torch.arange(2).repeat_interleave(n).view(1, 1, -1)
    query = torch.tensor([[[[1.0, -1.0, 0.5, 1.0]]]])
    summary = summarize(keys, shard, 2)
    member = torch.nn.functional.one_hot(shard, 2).transpose(-1, -2).float()
    summary.key_var = (member @ keys.square()) / n - summary.centroids.square()
    probs = torch.softmax(scale * query @ keys.transpose(-1, -2), dim=-1)
    exact = (probs @ member.transpose(-1, -2)).mean(2)
    assert (estimated_mass(query, summary, scale) - exact).abs().max() < 0.02
    summary.key_var = torch.zeros_like(summary.centroids)  # without the variance term the estimate is far off
    assert (estimated_mass(query, summary, scale) - exact).abs().max() > 0.1


def test_masked_topk_prefers_priority_then_score_then_low_id() -> None:
    scores = torch.tensor([[0.5, 2.0, float("nan"), 2.0, -1.0]])
    priority = torch.tensor([[True, False, True, True, True]])
    assert masked_topk(scores, 5, priority).tolist() == [[3, 0, 4, 2, 1]]


# ------------------------------------------------------------------------------------------- contract matrix


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("k", [1, 3, 8])
def test_contract(name: str, k: int) -> None:
    query, _, _, summary = clustered_case(1)
    selected = make_selector(name).select(query, summary, k)
    assert selected.dtype == torch.int64 and selected.shape == (2, 3, k)
    assert ((selected >= 0) & (selected < 8)).all()
    assert (selected.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct ids per (b, h)
    if k == 8:
        assert (selected.sort(-1).values == torch.arange(8)).all()


@pytest.mark.parametrize("name", NAMES)
def test_empty_shards_only_when_needed(name: str) -> None:
    query, _, _, summary = clustered_case(2, empty=(1, 4, 6))
    filled = torch.tensor([0, 2, 3, 5, 7])
    few = make_selector(name).select(query, summary, 4)
    assert torch.isin(few, filled).all()
    many = make_selector(name).select(query, summary, 7)
    assert torch.isin(filled, many[0, 0]).all() and torch.isin(filled, many[1, 2]).all()


@pytest.mark.parametrize("name", NAMES)
def test_scale_invariant(name: str) -> None:
    query, _, _, summary = clustered_case(3)
    ref = make_selector(name).select(query, summary, 3)
    for scale in (0.01, 13.7):
        assert torch.equal(make_selector(name).select(query * scale, summary, 3), ref)


@pytest.mark.parametrize("name", NAMES)
def test_bad_input(name: str) -> None:
    query, _, _, summary = clustered_case(4)
    selector = make_selector(name)
    with pytest.raises(ValueError, match="k"):
        selector.select(query, summary, 9)
    with pytest.raises(ValueError, match="k"):
        selector.select(query, summary, 0)
    with pytest.raises(ValueError, match="query"):
        selector.select(query[0], summary, 2)
    with pytest.raises(ValueError, match="centroids"):
        selector.select(query[..., :8], summary, 2)
    empty = ShardSummary(
        centroids=torch.zeros_like(summary.centroids),
        counts=torch.zeros_like(summary.counts),
        key_min=torch.full_like(summary.key_min, math.inf),
        key_max=torch.full_like(summary.key_max, -math.inf),
        resident=summary.resident,
        misses=summary.misses,
    )
    # checks read shapes only (selection runs inside decode steps, without host reads): with every shard empty a
    # selector still returns k distinct shard ids
    picked = selector.select(query, empty, 2)
    assert picked.shape[-1] == 2 and bool((picked[..., 0] != picked[..., 1]).all())


def test_registry() -> None:
    assert set(NAMES) == {"adaptive", "cache_aware", "eplb", "hierarchical", "topk", "topk_balanced"}
    with pytest.raises(ValueError, match="selector must be one of") as err:
        make_selector("nope")
    assert all(name in str(err.value) for name in NAMES)
    assert make_selector("topk_balanced", strength=2.0).strength == 2.0
    for name, kwargs, param in [
        ("topk", {"score": "dot"}, "score"),
        ("topk_balanced", {"strength": -1.0}, "strength"),
        ("cache_aware", {"miss_weight": math.nan}, "miss_weight"),
        ("eplb", {"decay": 1.5}, "decay"),
        ("adaptive", {"explore": 0.0}, "explore"),
        ("hierarchical", {"num_groups": 0}, "num_groups"),
        ("hierarchical", {"grouping": "random"}, "grouping"),
        # truncated or coerced by int() before
        ("hierarchical", {"num_groups": 2.5}, "num_groups must be an integer >= 1, got 2.5"),
        ("hierarchical", {"top_groups": 1.5}, "top_groups must be an integer >= 1, got 1.5"),
        ("hierarchical", {"kmeans_iters": "3"}, "kmeans_iters must be an integer >= 0, got '3'"),
        ("adaptive", {"seed": 1.5}, "seed must be an integer"),
    ]:
        with pytest.raises(ValueError, match=param):
            make_selector(name, **kwargs)


# --------------------------------------------------------------------------------------- constructed cases


def test_topk_picks_the_obvious_shard() -> None:
    query, keys, shard, summary = clustered_case(5, b=1, h=1, g=1)
    target = 5
    query = summary.centroids[:, :, target : target + 1] * 3.0  # aligned with shard 5's centre only
    scores = centroid_scores(query, summary)[0, 0]
    assert int(scores.argmax()) == target
    for score in ("centroid", "bound"):
        assert int(TopKSelector(score=score).select(query, summary, 1)) == target


def test_balanced_penalty_flips_only_with_strength() -> None:
    # Shard 0 scores best but holds 100 tokens; shard 1 scores a bit less with 2 tokens.
    query, _, _, summary = line_case([100, 2, 10, 10], [1.0, 0.9, -1.0, -1.0])
    assert int(make_selector("topk_balanced", strength=0.0).select(query, summary, 1)) == 0
    assert int(make_selector("topk").select(query, summary, 1)) == 0
    assert int(make_selector("topk_balanced", strength=0.5).select(query, summary, 1)) == 1


def test_eplb_spreads_repeated_choices() -> None:
    query, _, _, summary = line_case([10, 10, 10, 10], [1.0, 0.9, -1.0, -1.0])
    plain = EPLBSelector(strength=0.0)
    assert [int(plain.select(query, summary, 1)) for _ in range(6)] == [0] * 6
    balanced = EPLBSelector(strength=0.5)
    picks = [int(balanced.select(query, summary, 1)) for _ in range(6)]
    assert picks[0] == 0 and 1 in picks  # no history: topk's choice; then the unused runner-up gains
    assert balanced.counts is not None and balanced.counts.sum() == 6
    balanced.reset()
    assert balanced.counts is None and int(balanced.select(query, summary, 1)) == 0


def test_cache_aware_reacts_to_counted_misses() -> None:
    query, _, _, summary = line_case([10, 10, 10, 10], [1.0, 0.9, -1.0, -1.0])
    selector = make_selector("cache_aware")
    assert int(selector.select(query, summary, 1)) == 0
    summary.misses[..., 0] = 3
    assert int(selector.select(query, summary, 1)) == 1
    assert int(make_selector("cache_aware", miss_weight=0.0).select(query, summary, 1)) == 0
    summary.misses.zero_()
    summary.resident[..., 0] = False
    assert int(selector.select(query, summary, 1)) == 1
    assert int(make_selector("cache_aware", offload_penalty=0.0).select(query, summary, 1)) == 0


@pytest.mark.parametrize("grouping", ["kmeans", "contiguous"])
@pytest.mark.parametrize("score", ["centroid", "bound"])
def test_hierarchical_with_one_group_per_shard_is_topk(score: str, grouping: str) -> None:
    for seed in range(3):
        query, _, _, summary = clustered_case(10 + seed, empty=(2,))
        for k in (1, 3, 6):
            for top_groups in (None, 1, 8):
                hier = HierarchicalSelector(num_groups=8, top_groups=top_groups, grouping=grouping, score=score)
                assert torch.equal(hier.select(query, summary, k), TopKSelector(score).select(query, summary, k))


def test_hierarchical_stays_inside_kept_groups() -> None:
    query, _, _, summary = clustered_case(20)
    hier = HierarchicalSelector(num_groups=4, top_groups=1, grouping="contiguous")  # groups of 2 adjacent shards
    selected = hier.select(query, summary, 2)
    assert (selected.sort(-1).values[..., 0] % 2 == 0).all()
    assert (selected.max(-1).values - selected.min(-1).values == 1).all()


def test_hierarchical_kmeans_groups_similar_shards() -> None:
    # 4 well-separated directions, 2 shards around each, at scrambled ids; the query points at direction 2
    # (shards 2 and 7), which no contiguous group of 2 shards holds.
    gen = torch.Generator().manual_seed(0)
    d, per_shard = 8, 20
    direction_of = torch.tensor([3, 0, 2, 1, 0, 3, 1, 2])  # shard -> direction
    shard = torch.arange(8).repeat_interleave(per_shard).view(1, 1, -1)
    keys = 4.0 * torch.eye(d)[direction_of[shard]] + 0.3 * torch.randn(1, 1, 8 * per_shard, d, generator=gen)
    summary = summarize(keys, shard, 8)
    query = torch.eye(d)[2].view(1, 1, 1, d)
    selected = HierarchicalSelector(num_groups=4, top_groups=1).select(query, summary, 2)
    assert sorted(selected.flatten().tolist()) == [2, 7]
    assert sorted(TopKSelector().select(query, summary, 2).flatten().tolist()) == [2, 7]
    group = cluster_shards(summary, 4, iters=4).flatten()
    assert all(int(group[a]) == int(group[b]) for a, b in [(0, 5), (1, 4), (2, 7), (3, 6)])
    assert len(set(group.tolist())) == 4
    contiguous = HierarchicalSelector(num_groups=4, top_groups=1, grouping="contiguous").select(query, summary, 2)
    assert sorted(contiguous.flatten().tolist()) != [2, 7]


# ------------------------------------------------------------------------------------------------ adaptive


def size_task(seed: int):
    """Diffuse attention over shards of very different sizes: recall is won by the largest shards.

    Small shards get wide key spreads, so the Quest bound favours them (a bad choice); centroids are random.
    """
    gen = torch.Generator().manual_seed(seed)
    b, h, s, g, d = 8, 2, 8, 2, 8
    sizes = torch.tensor([400, 160, 80, 40, 20, 10, 6, 4])
    spread = 0.3 * (400 / sizes.float()).sqrt()
    shard = torch.repeat_interleave(torch.arange(s), sizes).expand(b, h, -1)
    keys = 0.3 * torch.randn(b, h, s, d, generator=gen).gather(2, shard.unsqueeze(-1).expand(-1, -1, -1, d))
    keys = keys + spread[shard].unsqueeze(-1) * torch.randn(keys.shape, generator=gen)
    query = 0.5 * torch.randn(b, h, g, d, generator=gen)
    return query, keys, shard, summarize(keys, shard, s)


def test_adaptive_is_deterministic_under_a_seed() -> None:
    query, keys, shard, summary = size_task(0)
    runs = []
    for seed in (7, 7, 8):
        selector = AdaptiveSelector(seed=seed)
        picks = []
        for _ in range(3):
            selected = selector.select(query, summary, 2)
            selector.update(query, summary, selected, recall(query, keys, shard, selected))
            picks.append(selected)
        runs.append((torch.stack(picks), selector.weights))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert not torch.equal(runs[0][0], runs[2][0])


def test_adaptive_learns_the_rewarded_feature() -> None:
    selector = AdaptiveSelector(lr=0.05, seed=0)
    tasks = [size_task(seed) for seed in range(40)]

    def mean_recall() -> float:
        state = (selector.generator.get_state(), selector.last_policy)
        total = sum(float(recall(q, keys, shard, selector.select(q, summ, 2)).mean()) for q, keys, shard, summ in tasks)
        selector.generator.set_state(state[0])
        selector.last_policy = state[1]
        return total / len(tasks)

    before = mean_recall()
    for q, keys, shard, summ in tasks * 3:
        selected = selector.select(q, summ, 2)
        selector.update(q, summ, selected, recall(q, keys, shard, selected))
    weights = selector.weights
    assert weights is not None and (weights.argmax(-1) == AdaptiveSelector.ARMS.index("size")).all()
    assert (weights[:, 2] > 0.8).all()
    after = mean_recall()
    oracle = sum(float(recall(q, k_, s_, torch.tensor([0, 1]).expand(8, 2, 2)).mean()) for q, k_, s_, _ in tasks)
    assert after > before + 0.05, (before, after)
    assert after > 0.9 * oracle / len(tasks)


def test_adaptive_update_bad_input() -> None:
    query, _, _, summary = size_task(0)
    selector = AdaptiveSelector()
    selected = selector.select(query, summary, 2)
    with pytest.raises(ValueError, match="selected"):
        selector.update(query, summary, selected[0], 1.0)
    with pytest.raises(ValueError, match="selected"):
        selector.update(query, summary, selected[:1], 1.0)
    with pytest.raises(ValueError, match="reward"):
        selector.update(query, summary, selected, torch.ones(3))
    before = selector.log_weights.clone()
    for reward in (float("nan"), 7.0, -0.5):  # a NaN made every log-weight NaN and the next select() crash
        with pytest.raises(ValueError, match="reward must be in \\[0, 1\\]"):
            selector.update(query, summary, selected, reward)
    assert torch.equal(selector.log_weights, before)
