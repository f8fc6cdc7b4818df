"""``torch.ops.pikv.record_read`` (``pikv_hf.kernels.read_stats``): its Triton kernel, run interpreted on the CPU
(``conftest.py`` sets ``TRITON_INTERPRET=1`` without a GPU), and its torch reference (the CPU implementation) against
counts made by hand in Python."""

from __future__ import annotations

import pytest
import torch
from helpers import KERNEL_DEVICE, on_kernel_device

from pikv_hf.kernels import read_stats
from pikv_hf.kernels._triton import interpreted
from pikv_hf.read.stats import FIELDS, ReadStats


def _inputs(b=2, h=3, n=40, s=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    attended = torch.randint(0, 100, (b, h), generator=gen)
    pages = torch.randint(-1, 9, (b, h, n), generator=gen)  # -1: padding
    n_pages = torch.randint(0, 50, (b, h), generator=gen)
    count = torch.randint(0, 30, (b, h, s), generator=gen)
    return attended, pages, n_pages, count


def _by_hand(attended, pages, n_pages, count, page_size, page_bytes, step):
    read = [
        int(n_pages[i, j]) if pages is None else sum(int(x) >= 0 for x in pages[i, j].tolist())
        for i in range(n_pages.shape[0])
        for j in range(n_pages.shape[1])
    ]
    return dict(
        zip(FIELDS, [*step, int(attended.sum()), sum(read), int(n_pages.sum()), int(count.sum()),
                     sum(read) * page_size, sum(read) * page_bytes, int(n_pages.sum()) * page_size, 0], strict=True)
    )  # fmt: skip


@pytest.mark.parametrize("exact", [False, True])
def test_reference_adds_a_stores_read_to_the_counters(exact):
    attended, pages, n_pages, count = _inputs()
    pages = None if exact else pages
    stats = ReadStats()
    stats.add_read(torch.device("cpu"), attended, pages, n_pages, count, 16, 1000, (1, 1, 6))
    assert stats.counts() == _by_hand(attended, pages, n_pages, count, 16, 1000, (1, 1, 6))
    stats.add_read(torch.device("cpu"), attended, pages, n_pages, count, 16, 1000)  # a second store of the step
    want = _by_hand(attended, pages, n_pages, count, 16, 1000, (1, 1, 6))
    assert stats.counts() == {k: v if k in ("steps", "sparse_steps", "heads") else 2 * v for k, v in want.items()}


@pytest.mark.skipif(not (torch.cuda.is_available() or interpreted(read_stats._record_kernel)), reason="no Triton")
@pytest.mark.parametrize("shape, exact", [(dict(), False), (dict(n=1500, s=1), False), (dict(b=1, h=1), True)])
def test_kernel_equals_reference(shape, exact):
    attended, pages, n_pages, count = _inputs(**shape)
    pages = None if exact else pages
    got, ref = torch.arange(11, device=KERNEL_DEVICE) * 7, torch.arange(11) * 7
    read_stats._record_launch(got, *on_kernel_device((attended, pages, n_pages, count)), 4, 96, 1, 0, 3)
    read_stats._record_reference(ref, attended, pages, n_pages, count, 4, 96, 1, 0, 3)
    assert torch.equal(got.cpu(), ref)
    torch.library.opcheck(
        torch.ops.pikv.record_read.default, (torch.zeros(11, dtype=torch.int64), attended, pages, n_pages, count,
                                             4, 96, 1, 0, 3)
    )  # fmt: skip
