"""The routed step's kernels (``pikv_hf.kernels.route_select``, ``routed_plan``, ``place_key``) against their torch
references, and the references against loops over the definitions (float64 masses, Python sorts). Without a GPU the
kernels run interpreted on CPU (``conftest.py`` sets ``TRITON_INTERPRET=1``); the operators' CPU implementations are
the references, so these tests call the kernels' launchers directly."""

from __future__ import annotations

import pytest
import torch
from helpers import KERNEL_DEVICE as DEVICE
from helpers import run_without_interpreter

from pikv_hf.kernels import place_key as place_mod
from pikv_hf.kernels import route_select as select_mod
from pikv_hf.kernels import routed_plan as plan_mod
from pikv_hf.kernels._triton import interpreted
from pikv_hf.store.paged import SHARD_DTYPE
from pikv_hf.store.special import EMPTY
from pikv_hf.store.summary import ShardStats


def _runs(kernel) -> bool:
    return DEVICE.type == "cuda" or interpreted(kernel)


def _summary(b, h, g, s, d, seed, empty=0.2):
    """Query rows and shard statistics as ``ShardStats`` keeps them (key sums, sums of squares, counts)."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(b, h, g, d, generator=gen)
    centroids = torch.randn(b, h, s, d, generator=gen)
    counts = torch.randint(1, 40, (b, h, s), generator=gen)
    counts[torch.rand(b, h, s, generator=gen) < empty] = 0
    centroids[0, 0, 2] = centroids[0, 0, 5]  # a tie: the lower id ranks first
    counts[0, 0, 2] = counts[0, 0, 5] = 5
    n = counts.unsqueeze(-1).float()
    sums = centroids * n
    squares = (torch.rand(b, h, s, d, generator=gen) + centroids.square()) * n
    return [t.to(DEVICE) for t in (query, sums, squares, counts)]


def _loop_select(query, sums, squares, counts, scale, k, target):
    """The selection from its definition: rows ranked by max_g q.c (stable, empty shards last by id) over the
    shards' summary (``ShardStats.summary``: mean key, per-dimension variance), the shortest prefix of the k best whose
    float64 Gaussian mass estimate reaches ``target``."""
    summary = ShardStats(*counts.shape, sums.shape[-1], sums.device)
    summary.count, summary.sum, summary.sq, summary.min, summary.max = counts, sums, squares, sums, sums
    centroids, key_var = summary.summary(torch.zeros_like(counts)).centroids, summary.summary(counts).key_var
    b, h, _, _ = query.shape
    s = counts.shape[-1]
    out = torch.zeros(b, h, s, dtype=torch.bool)
    q, c, var, n = (t.double().cpu() for t in (query, centroids, key_var, counts))
    for bi in range(b):
        for hi in range(h):
            dots = q[bi, hi] @ c[bi, hi].T  # [G, S]
            score = [float("-inf") if n[bi, hi, j] == 0 else float(dots[:, j].max()) for j in range(s)]
            order = sorted(range(s), key=lambda j: (-score[j], j))[:k]
            logit = dots * scale + 0.5 * scale**2 * (q[bi, hi] ** 2 @ var[bi, hi].T) + n[bi, hi].log()
            mass = logit.softmax(-1).mean(0)
            covered = 0.0
            for j in order:
                out[bi, hi, j] = True
                covered += float(mass[j])
                if target is not None and covered >= target:
                    break
    return out


@pytest.mark.parametrize("k, target", [(64, 0.9), (5, None), (100, 0.5), (1, 0.99)])
def test_route_select_reference_follows_the_definition(k, target):
    query, sums, squares, counts = _summary(2, 2, 3, 100, 24, seed=k)
    got = select_mod.route_select_reference(query, sums, squares, counts, 0.3, k, -1 if target is None else target)
    assert torch.equal(got.cpu(), _loop_select(query, sums, squares, counts, 0.3, k, target))
    assert int(got.sum()) >= 2 * 2  # at least one shard per (row, head)


@pytest.mark.skipif(not _runs(select_mod._route_select_kernel), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize(
    "b, h, g, s, d, k, target",
    [(2, 2, 3, 100, 24, 64, 0.97), (1, 3, 4, 256, 64, 64, 0.9), (2, 1, 1, 7, 16, 3, None), (1, 2, 2, 130, 8, 130, 0.5)],
)
def test_route_select_kernel_equals_reference(b, h, g, s, d, k, target):
    query, sums, squares, counts = _summary(b, h, g, s, d, seed=s + k)
    t = -1.0 if target is None else target
    want = select_mod.route_select_reference(query, sums, squares, counts, d**-0.5, k, t)
    got = select_mod._launch(query, sums, squares if target is not None else None, counts, d**-0.5, k, t)
    assert torch.equal(got, want)
    assert bool((got.sum(-1) <= k).all()) and bool((got.sum(-1) >= 1).all())


def _plan_case(b, h, s, w, seed, page_size=1, entries=8):
    """Chosen shards, the frame's page shards, and special entries (``SpecialSlots``: 2 sinks, then a window of 6)
    of runs of ``w`` pages starting at random pool pages; the query at position 100 reads the recent entries at
    positions 95 and later. ``entries > 8`` appends more window entries (positions 96 to 100, each read), every second
    on the page of the one before it (entries matched in several chunks, pages held by several entries)."""
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.rand(b, h, s, generator=gen) < 0.3
    shard = torch.randint(-1, s, (b, h, w), generator=gen, dtype=SHARD_DTYPE)
    start = torch.randint(0, 50, (b, h), generator=gen) + torch.arange(b * h).view(b, h) * (w + 50)
    local = torch.randint(0, max(w, 1), (b, h, entries), generator=gen)
    local[..., 9::2] = local[..., 8:-1:2]
    slots = (start.unsqueeze(-1) + local) * page_size + torch.randint(0, page_size, (b, h, entries), generator=gen)
    more = torch.arange(entries - 8) % 5 + 96
    spos = torch.cat([torch.tensor([0, 1, 93, 94, 95, 97, 98, 100]), more]).expand(b, h, entries).clone()
    slots[..., 1], spos[..., 1] = -1, EMPTY  # a sink not held
    reach = torch.tensor([2**61] * 2 + [6] * (entries - 2))
    if w == 0:
        slots.fill_(-1), spos.fill_(EMPTY)
    qpos = torch.tensor([100])
    return [t.to(DEVICE) for t in (chosen, shard, slots, spos, reach, qpos, start)] + [page_size]


def test_routed_plan_reference_follows_the_definition():
    case = _plan_case(2, 3, 9, 50, seed=1, page_size=4)
    chosen, shard, slots, spos, _, _, start, _ = case
    pages, full, lengths = plan_mod.routed_plan_reference(*case)
    for bi in range(2):
        for hi in range(3):
            sel = [bool(chosen[bi, hi, j]) if j >= 0 else False for j in shard[bi, hi].tolist()]
            read = [e for e in range(8) if e == 0 or (e >= 2 and int(spos[bi, hi, e]) > 100 - 6)]
            special = {int(slots[bi, hi, e]) // 4 - int(start[bi, hi]) for e in read}
            need = [i for i in range(50) if sel[i] or i in special]
            assert pages[bi, hi].tolist() == need + [-1] * (50 - len(need))
            assert full[bi, hi].tolist() == [sel[i] for i in need] + [False] * (50 - len(need))
            assert int(lengths[bi, hi]) == len(need)


@pytest.mark.skipif(not _runs(plan_mod._routed_plan_kernel), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize(
    "b, h, s, w, p, entries",
    [(2, 3, 9, 50, 1, 8), (1, 2, 256, 600, 1, 8), (1, 1, 4, 256, 16, 8), (2, 1, 3, 0, 1, 8),
     (1, 2, 64, 4500, 1, 8), (2, 1, 5, 2048, 4, 8),  # frames planned by several programs (_BLOCK pages each)
     (1, 2, 64, 4500, 1, 40), (2, 1, 5, 2048, 4, 68)],  # special entries in several chunks, pages held by two
)  # fmt: skip
def test_routed_plan_kernel_equals_reference(b, h, s, w, p, entries):
    case = _plan_case(b, h, s, w, seed=w, page_size=p, entries=entries)
    want = plan_mod.routed_plan_reference(*case)
    got = plan_mod._launch(*case)
    assert all(torch.equal(g, t) for g, t in zip(got, want, strict=True))


@pytest.mark.parametrize("b, h, s, w, p", [(2, 3, 9, 50, 1), (2, 3, 9, 50, 4), (1, 2, 256, 600, 1), (2, 1, 3, 0, 1)])
def test_routed_plan_trimmed_is_the_reference_without_padding(b, h, s, w, p):
    """The CPU's eager plan: the reference's pages and page_full cut at its longest row."""
    case = _plan_case(b, h, s, w, seed=w + p, page_size=p)
    pages, full, lengths = plan_mod.routed_plan_reference(*[t.cpu() if torch.is_tensor(t) else t for t in case])
    n = int(lengths.max()) if lengths.numel() else 0
    got_pages, got_full = plan_mod.routed_plan_trimmed(*[t.cpu() if torch.is_tensor(t) else t for t in case])
    assert torch.equal(got_pages, pages[..., :n])
    assert got_full is None if p == 1 else torch.equal(got_full, full[..., :n])
    if w:
        assert 0 < n < w and bool((pages[..., n:] == -1).all())  # the case trims something


def test_routed_operators_pass_opcheck():
    torch.library.opcheck(torch.ops.pikv.routed_plan.default, tuple(_plan_case(2, 3, 9, 50, seed=1, page_size=4)))
    query, sums, squares, counts = _summary(2, 2, 3, 100, 24, seed=0)
    torch.library.opcheck(torch.ops.pikv.route_select.default, (query, sums, squares, counts, 0.3, 8, 0.9))
    torch.library.opcheck(torch.ops.pikv.route_select.default, (query, sums, None, counts, 0.3, 8, -1.0))


def _place_case(b, h, s, d, seed):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, h, 1, d, generator=gen)
    centroids = torch.randn(b, h, s, d, generator=gen)
    counts = torch.randint(1, 20, (b, h, s), generator=gen)
    norms = centroids.square().sum(-1) / 2
    norms[0, 0, 1] = float("inf")  # a centroid not seeded is never the nearest
    return [t.to(DEVICE) for t in (keys, centroids, counts, norms)]


def test_place_key_reference_follows_the_definition():
    keys, centroids, counts, norms = _place_case(2, 2, 10, 8, seed=0)
    before_c, before_n = centroids.clone(), counts.clone()
    shard = place_mod.place_key_reference(keys, centroids, counts, norms)
    dist = (keys - before_c).square().sum(-1).masked_fill(torch.isinf(norms.new_zeros(norms.shape)), 0)
    dist[0, 0, 1] = float("inf")
    assert torch.equal(shard.squeeze(-1), dist.argmin(-1))
    for bi in range(2):
        for hi in range(2):
            j = int(shard[bi, hi, 0])
            n = int(before_n[bi, hi, j]) + 1
            expect = before_c[bi, hi, j] + (keys[bi, hi, 0] - before_c[bi, hi, j]) / n
            assert torch.allclose(centroids[bi, hi, j], expect, atol=1e-6) and int(counts[bi, hi, j]) == n
            assert torch.isclose(norms[bi, hi, j], expect.square().sum() / 2, atol=1e-5)


@pytest.mark.skipif(not _runs(place_mod._place_key_kernel), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("b, h, s, d", [(2, 2, 10, 8), (1, 3, 256, 64), (1, 1, 70, 24)])
def test_place_key_kernel_equals_reference(b, h, s, d):
    keys, centroids, counts, norms = _place_case(b, h, s, d, seed=s)
    ref = [t.clone() for t in (centroids, counts, norms)]
    want = place_mod.place_key_reference(keys, *ref)
    got = place_mod._launch(keys, centroids, counts, norms)
    assert torch.equal(got, want)
    assert torch.equal(counts, ref[1])
    assert torch.allclose(centroids, ref[0], atol=1e-6) and torch.allclose(norms, ref[2], atol=1e-5)


def test_operators_check_their_arguments():
    query, sums, squares, counts = _summary(1, 1, 2, 8, 4, seed=0)
    with pytest.raises(ValueError, match="top_k_shards"):
        select_mod.route_select(query, sums, squares, counts, 0.5, 9, None)
    with pytest.raises(ValueError, match="squares"):
        select_mod.route_select(query, sums, None, counts, 0.5, 2, 0.9)
    with pytest.raises(ValueError, match="sums must be float32"):
        select_mod.route_select(query, sums.double(), squares, counts, 0.5, 2, 0.9)
    keys, c, n, norms = _place_case(1, 1, 4, 4, seed=0)
    with pytest.raises(ValueError, match="counts"):
        place_mod.place_key(keys, c, n.int(), norms)
    chosen, shard, slots, spos, reach, qpos, start, p = _plan_case(1, 1, 3, 5, seed=0)
    with pytest.raises(ValueError, match="chosen"):
        plan_mod.routed_plan(chosen.int(), shard, slots, spos, reach, qpos, start, p)
    with pytest.raises(ValueError, match="spos"):
        plan_mod.routed_plan(chosen, shard, slots, spos[..., :3], reach, qpos, start, p)
    with pytest.raises(ValueError, match="reach"):
        plan_mod.routed_plan(chosen, shard, slots, spos, reach.int(), qpos, start, p)
    with pytest.raises(ValueError, match="spos"):
        plan_mod.routed_plan_trimmed(chosen, shard, slots, spos[..., :3], reach, qpos, start, p)


_COMPILE_SM90 = """
from sm90 import compile_sm90, registers
from pikv_hf.kernels import place_key, route_select, routed_plan

cases = [(route_select._route_select_kernel, dict(G=4, D=128, BLOCK_G=4, BLOCK_S=64, BLOCK_D=32, HAS_MASS=mass))
         for mass in (True, False)]
cases.append((routed_plan._routed_plan_kernel, dict(BLOCK=2048, TILE=128, BLOCK_NS=128, ENTRIES=16)))
cases.append((place_key._place_key_kernel, dict(D=128, BLOCK_S=64, BLOCK_D=128)))
for kernel, const in cases:
    compiled = compile_sm90(kernel, const, num_warps=4, num_stages=2)
    print(compiled.name, *registers(compiled))
"""


def test_kernels_compile_for_sm90_without_a_gpu():
    """The CUDA front end types loop-carried scalars and branches the interpreter never checks: each kernel compiles
    for sm_90 (the shapes of an 8B model: 4 query rows per KV head, head dim 128) in a subprocess without
    ``TRITON_INTERPRET`` (the interpreter's kernels cannot be compiled). The plan kernel holds at most 64 registers a
    thread and spills none (8 programs per SM): matching a tile's 128 pages against all 128 special entries at once
    held 254 (2 programs per SM; 0.26-0.33 ms per layer on an H100 at 32k x batch 8)."""
    built = [line.split() for line in run_without_interpreter(_COMPILE_SM90).splitlines()]
    assert [name for name, _, _ in built] == ["_route_select_kernel"] * 2 + ["_routed_plan_kernel", "_place_key_kernel"]
    _, regs, stack = built[2]
    assert int(regs) <= 64 and int(stack) == 0, f"routed plan: {regs} registers, {stack} bytes of stack a thread"
