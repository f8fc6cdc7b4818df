"""What one store's read added to a layer's ``ReadStats`` counters, as one operator: ``torch.ops.pikv.record_read``.

Program ``b * H + h`` counts its (row, KV head)'s slots attended, pages read (entries of the plan that are not
``-1``; every stored page for an exact read), pages stored, tokens stored (summed over shards), slots read
(pages x page size) and bytes fetched (pages x bytes per page, 0 for a store that is not offloaded), and adds them to
the counters with integer atomics (exact, so the order does not matter); program 0 also adds the step's own counts
(``steps``, ``sparse_steps``, ``heads``). The CPU runs the torch reference ``_record_reference``; the counters are
``pikv_hf.read.stats.FIELDS`` in order, the store's figures from ``tokens_attended`` (index 3) on.
"""

from __future__ import annotations

import torch

from pikv_hf.kernels._host import next_power_of_2
from pikv_hf.kernels._triton import check_launchable, eager_direct, jit, tl

_FIRST = 3  # index of tokens_attended in ReadStats' FIELDS


@jit
def _record_kernel(
    total_ptr, attended_ptr, pages_ptr, n_pages_ptr, count_ptr, N, S, page_size, page_bytes, steps, sparse_steps,
    heads, FIRST: tl.constexpr, HAS_PAGES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    stored = tl.load(n_pages_ptr + bh).to(tl.int64)
    read = stored
    if HAS_PAGES:
        read = stored * 0
        for start in range(0, N, BLOCK_N):
            i = start + tl.arange(0, BLOCK_N)
            page = tl.load(pages_ptr + bh * N + i, mask=i < N, other=-1)
            read += tl.sum((page >= 0).to(tl.int64), axis=0)
    s = tl.arange(0, BLOCK_S)
    tokens = tl.sum(tl.load(count_ptr + bh * S + s, mask=s < S, other=0).to(tl.int64), axis=0)
    tl.atomic_add(total_ptr + FIRST, tl.load(attended_ptr + bh).to(tl.int64))
    tl.atomic_add(total_ptr + FIRST + 1, read)
    tl.atomic_add(total_ptr + FIRST + 2, stored)
    tl.atomic_add(total_ptr + FIRST + 3, tokens)
    tl.atomic_add(total_ptr + FIRST + 4, read * page_size)
    tl.atomic_add(total_ptr + FIRST + 5, read * page_bytes)
    tl.atomic_add(total_ptr + FIRST + 6, stored * page_size)
    if bh == 0:
        tl.atomic_add(total_ptr, steps)
        tl.atomic_add(total_ptr + 1, sparse_steps)
        tl.atomic_add(total_ptr + 2, heads)


def _record_reference(total, attended, pages, n_pages, count, page_size, page_bytes, steps, sparse_steps, heads):
    read = n_pages if pages is None else (pages >= 0).sum(-1)
    rows = [attended, read, n_pages, count.sum(-1), read * page_size, read * page_bytes, n_pages * page_size]
    total[_FIRST : _FIRST + len(rows)].add_(torch.stack(rows).sum((1, 2)))  # in place through the view
    for i, n in enumerate((steps, sparse_steps, heads)):  # scalars, no host tensor (a CUDA graph may capture this)
        if n:
            total[i].add_(n)


def _record_launch(total, attended, pages, n_pages, count, page_size, page_bytes, steps, sparse_steps, heads):
    b, h = n_pages.shape
    if b * h == 0:
        return _record_reference(total, attended, pages, n_pages, count, page_size, page_bytes, steps, sparse_steps, 0)
    check_launchable(_record_kernel, total.device)
    n, s = (0 if pages is None else pages.shape[-1]), count.shape[-1]
    _record_kernel[(b * h,)](
        total, attended.contiguous(), n_pages if pages is None else pages.contiguous(), n_pages.contiguous(),
        count.contiguous(), n, s, page_size, page_bytes, steps, sparse_steps, heads, FIRST=_FIRST,
        HAS_PAGES=pages is not None, BLOCK_N=min(1024, max(16, next_power_of_2(n))),
        BLOCK_S=max(16, next_power_of_2(s)),
    )  # fmt: skip


record_read = torch.library.custom_op(
    "pikv::record_read", _record_launch, mutates_args=("total",), device_types="cuda",
    schema="(Tensor(a!) total, Tensor attended, Tensor? pages, Tensor n_pages, Tensor count, int page_size, "
    "int page_bytes, int steps, int sparse_steps, int heads) -> ()",
)  # fmt: skip
record_read.__doc__ = """``torch.ops.pikv.record_read(total [11] int64, attended [B, H], pages [B, H, n] or None,
n_pages [B, H], count [B, H, S], page_size, page_bytes, steps, sparse_steps, heads)``: adds one store's read to the
counters ``total`` in place (module docstring)."""


@record_read.register_kernel("cpu")
def _record_read_cpu(*args):
    _record_reference(*args)


record = eager_direct(record_read, _record_launch, _record_read_cpu)  # what library code calls


@record_read.register_fake
def _record_read_fake(*args):
    return None
