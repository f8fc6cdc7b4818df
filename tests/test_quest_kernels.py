"""Quest's selection operators (``pikv_hf.kernels.quest``): the Triton kernels, run interpreted on the CPU
(``conftest.py`` sets ``TRITON_INTERPRET=1`` without a GPU), against the torch references the operators run on the
CPU, which are checked here against dense float math (every key's dot product, an explicit page loop)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import on_kernel_device

from pikv_hf.kernels import quest
from pikv_hf.kernels._triton import interpreted
from pikv_hf.store.special import EMPTY

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreted(quest._scores_kernel)),
    reason="needs a GPU or TRITON_INTERPRET=1",
)


def _inputs(b=2, h=3, g=4, d=32, w=70, p=4, seed=0):
    """A store's frame: random keys, some pages empty or partly filled, sinks and recent entries (some out of the
    window, some absent), runs starting at different pool pages."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, h, w, p, d, generator=gen)
    valid = torch.rand(b, h, w, p, generator=gen) < 0.7
    valid[:, :, -3:] = False  # empty pages at the end of every run
    valid[0, -1, 5] = False  # and one inside
    kmin = keys.masked_fill(~valid.unsqueeze(-1), math.inf).amin(3)
    kmax = keys.masked_fill(~valid.unsqueeze(-1), -math.inf).amax(3)
    start = torch.arange(b * h).view(b, h) * w  # runs back to back in the pool
    n_sink, window = 2, 6
    local = torch.cat(
        [torch.arange(n_sink).expand(b, h, -1), torch.randint(0, w - 3, (b, h, window), generator=gen)], -1
    )
    slots = (start.unsqueeze(-1) + local) * p + torch.randint(0, p, local.shape, generator=gen)
    qpos = torch.tensor([100])
    spos = torch.cat(
        [torch.zeros(b, h, n_sink, dtype=torch.int64), torch.randint(90, 101, (b, h, window), generator=gen)], -1
    )
    slots[-1, -1, 0], spos[-1, -1, 0] = -1, EMPTY  # no sink here
    reach = torch.tensor([2**61] * n_sink + [window] * window)
    qg = torch.randn(b, h, g, d, generator=gen)
    return (qg, kmin, kmax, valid.reshape(b, h, w * p), slots, spos, reach, qpos, start, p), keys, valid


def test_scores_reference_is_the_quest_bound_with_special_and_empty_pages():
    args, keys, valid = _inputs()
    qg, _, _, _, slots, spos, reach, qpos, start, p = args
    score = quest._scores_reference(*args)
    b, h, w = score.shape
    dots = torch.einsum("bhgd,bhwpd->bhgwp", qg, keys)
    for bi in range(b):
        for hi in range(h):
            read = {int(s) // p - int(start[bi, hi]) for s, x, r in zip(slots[bi, hi], spos[bi, hi], reach, strict=True)
                    if s >= 0 and x > qpos - r}  # fmt: skip
            for wi in range(w):
                got = float(score[bi, hi, wi])
                if wi in read:
                    assert got == math.inf
                elif not valid[bi, hi, wi].any():
                    assert got == -math.inf
                else:  # an upper bound of every key's dot product, reached per dimension by the box's corner
                    assert got >= float(dots[bi, hi, :, wi][:, valid[bi, hi, wi]].max()) - 1e-4
    assert (score == math.inf).sum() > 0 and (score == -math.inf).sum() > 0


@pytest.mark.parametrize("bounds", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [dict(), dict(g=1, d=64, w=9, p=1), dict(b=1, h=1, g=3, d=24, w=130, p=16)])
def test_scores_kernel_equals_reference(shape, bounds):
    """Bounds in float32 (over a lossy codec's decoded keys) or in the keys' bfloat16 (a lossless store's), read as
    they are stored."""
    args, _, _ = _inputs(**shape)
    args = (args[0], args[1].to(bounds), args[2].to(bounds), *args[3:])
    ref = quest._scores_reference(*args)
    got = quest._scores_launch(*on_kernel_device(args)).cpu()  # the kernel: on the GPU, or interpreted
    assert got.shape == ref.shape and got.dtype == torch.float32
    inf = torch.isinf(ref)
    assert torch.equal(got[inf], ref[inf])
    torch.testing.assert_close(got[~inf], ref[~inf], rtol=1e-5, atol=1e-5)


def _select_inputs(b=2, h=3, w=37, seed=0):
    gen = torch.Generator().manual_seed(seed)
    score = torch.randint(-3, 4, (b, h, w), generator=gen).float()  # many ties
    score[score == 3] = math.inf
    score[score == -3] = -math.inf
    score[0, 0, :4] = torch.tensor([0.0, -0.0, 0.0, -0.0])[:w]  # signed zeros tie
    score[1, 2] = -math.inf  # an empty run
    n_pages = torch.randint(0, w + 1, (b, h), generator=gen)
    return score, n_pages


@pytest.mark.parametrize("w, fraction, width", [(37, 0.125, 5), (37, 0.5, 19), (1, 1.0, 1), (300, 0.25, 75)])
def test_select_kernel_equals_reference_and_a_stable_sort(w, fraction, width):
    score, n_pages = _select_inputs(w=w)
    ref, lengths = quest._select_reference(score, n_pages, fraction, width)
    got = quest._select_launch(*on_kernel_device((score, n_pages)), fraction, width)
    assert torch.equal(got[0].cpu(), ref) and torch.equal(got[1].cpu(), lengths)
    for bi, hi in [(0, 0), (0, 1), (1, 2)]:  # the reference: pages by descending score, ties to the earlier page
        ranked = sorted(range(w), key=lambda i: (-float(score[bi, hi, i]), i))
        budget = math.ceil(fraction * int(n_pages[bi, hi]))
        # sink / window pages (+inf) always, even past the budget (they hold the query's own token)
        value = [float(score[bi, hi, i]) for i in ranked]
        keep = [(k < budget or x == math.inf) and x > -math.inf for k, x in enumerate(value)]
        want = [i if kept else -1 for i, kept in zip(ranked[:width], keep, strict=False)]
        assert ref[bi, hi].tolist() == want
        assert int(lengths[bi, hi]) == sum(i >= 0 for i in want)  # the kept pages, which lead the row


def test_operators_dispatch_once_and_trace_with_their_fake():
    args, _, _ = _inputs()
    score = torch.ops.pikv.quest_scores(*args)
    assert torch.equal(score, quest._scores_reference(*args))  # the CPU implementation is the reference
    n_pages = torch.full(score.shape[:2], score.shape[-1])
    pages, lengths = torch.ops.pikv.quest_select(score, n_pages, 0.125, 9)
    want = quest._select_reference(score, n_pages, 0.125, 9)
    assert torch.equal(pages, want[0]) and torch.equal(lengths, want[1])
    torch.library.opcheck(torch.ops.pikv.quest_scores.default, args)
    torch.library.opcheck(torch.ops.pikv.quest_select.default, (score, n_pages, 0.125, 9))

    def plan(*a):
        return torch.ops.pikv.quest_select(torch.ops.pikv.quest_scores(*a), n_pages, 0.125, 9)

    compiled = torch.compile(plan, fullgraph=True, backend="aot_eager")
    assert all(torch.equal(g, w) for g, w in zip(compiled(*args), want, strict=True))


def _group_inputs(b=2, h=3, widths=(3, 40), sizes=(1, 16), seed=0):
    """Scores of several stores (ties within and across stores, sink / window pages, empty pages) and their pages in
    use."""
    gen = torch.Generator().manual_seed(seed)
    scores, n_pages = [], []
    for w in widths:
        score, n = _select_inputs(b, h, w, seed=int(torch.randint(0, 1000, (1,), generator=gen)))
        scores.append(score)
        n_pages.append(n)
    return scores, n_pages, list(sizes)


def _group_by_hand(scores, n_pages, sizes, fraction, bi, hi):
    """Store ``s``'s plan of row ``(bi, hi)`` from an explicit walk over all pages by descending score."""
    pages = [(float(x[bi, hi, i]), s, i) for s, x in enumerate(scores) for i in range(x.shape[-1])]
    pages.sort(key=lambda e: -e[0])  # stable: ties keep store, then page order
    budget = fraction * sum(int(n[bi, hi]) * p for n, p in zip(n_pages, sizes, strict=True))
    taken, before = [[] for _ in scores], 0
    for score, s, i in pages:
        if score > -math.inf and (before < budget or score == math.inf):
            taken[s].append(i)
        before += sizes[s]
    return [t + [-1] * (x.shape[-1] - len(t)) for t, x in zip(taken, scores, strict=True)]


@pytest.mark.parametrize(
    "widths, sizes, fraction",
    [((3, 40), (1, 16), 0.125), ((5, 9, 30), (4, 1, 8), 0.3), ((1, 1), (2, 64), 1.0), ((2, 300), (1, 64), 0.125)],
)
def test_group_select_kernel_equals_reference_and_one_budget_by_hand(widths, sizes, fraction):
    scores, n_pages, sizes = _group_inputs(widths=widths, sizes=sizes)
    ref, lengths = quest._group_reference(scores, n_pages, sizes, fraction)
    got = quest._group_launch(*on_kernel_device((scores, n_pages)), sizes, fraction)
    assert torch.equal(got[0].cpu(), ref) and torch.equal(got[1].cpu(), lengths)
    b, h = scores[0].shape[:2]
    plans = ref.split([b * h * w for w in widths])
    for bi in range(b):
        for hi in range(h):
            want = _group_by_hand(scores, n_pages, sizes, fraction, bi, hi)
            assert [p.view(b, h, -1)[bi, hi].tolist() for p in plans] == want
            assert lengths[:, bi, hi].tolist() == [sum(i >= 0 for i in w) for w in want]  # taken, leading each


def test_group_operator_dispatches_once_and_traces_with_its_fake():
    scores, n_pages, sizes = _group_inputs()
    got = torch.ops.pikv.quest_group_select(scores, n_pages, sizes, 0.125)
    want = quest._group_reference(scores, n_pages, sizes, 0.125)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    torch.library.opcheck(torch.ops.pikv.quest_group_select.default, (scores, n_pages, sizes, 0.125))
    compiled = torch.compile(
        lambda s, n: torch.ops.pikv.quest_group_select(s, n, sizes, 0.125), fullgraph=True, backend="aot_eager"
    )  # fmt: skip
    assert all(torch.equal(g, w) for g, w in zip(compiled(scores, n_pages), got, strict=True))
