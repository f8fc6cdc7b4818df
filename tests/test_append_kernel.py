"""The decode append operator (``pikv_hf.kernels.append``): its Triton kernel (interpreted on CPU) against its torch
reference, the store's one-token path against the general append (a stable sort per shard, an independent
computation), the operator's registration (``opcheck``: schema, mutations, fake implementation) and a compile of
the kernel for sm_90."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import KERNEL_DEVICE as DEVICE
from helpers import run_without_interpreter

from pikv_hf.kernels import _triton, append
from pikv_hf.kernels._triton import interpreted
from pikv_hf.kernels.append import append_one_kernel, append_one_op, append_one_reference
from pikv_hf.store import PagedStore
from pikv_hf.store.paged import SHARD_DTYPE

B, H, S, P, D, N = 2, 3, 4, 4, 8, 64


def _state(
    seed: int,
    dtype: torch.dtype = torch.float32,
    summary: str | None = "bounds",
    page_bounds: torch.dtype | None = None,
) -> dict:
    """Page-table state with some open pages partly filled, some full, some absent, and empty pools; shard key
    statistics: ``"bounds"`` sums, squares, min and max, ``"sums"`` sums and squares only, None none; Quest's page
    key bounds in ``page_bounds`` (None: none kept), some pages' already set; a ring of recent tokens (2 sinks and a
    window of 5, entries set)."""
    g = torch.Generator().manual_seed(seed)
    n_pages = torch.randint(1, 4, (B, H), generator=g)
    open_page = torch.randint(-1, 3, (B, H, S), generator=g)
    open_fill = torch.where(open_page < 0, P, torch.randint(1, P + 1, (B, H, S), generator=g))
    start = (torch.arange(B * H) * 8).view(B, H)
    stats = (
        (torch.randn(B, H, S, D, generator=g), torch.rand(B, H, S, D, generator=g),
         torch.randn(B, H, S, D, generator=g), torch.randn(B, H, S, D, generator=g))
        if summary else (None,) * 4
    )  # fmt: skip
    if summary == "sums":
        stats = (*stats[:2], None, None)
    low = high = None
    if page_bounds is not None:
        low = torch.full((N, D), float("inf")).masked_scatter_(torch.arange(N).unsqueeze(-1) % 3 == 0,
                                                                torch.randn(N, D, generator=g)).to(page_bounds)
        high = torch.full((N, D), float("-inf")).masked_scatter_(torch.arange(N).unsqueeze(-1) % 3 == 0,
                                                                  torch.randn(N, D, generator=g)).to(page_bounds)
    return dict(
        open_page=open_page, open_fill=open_fill, n_pages=n_pages, start=start,
        key_pool=torch.zeros(N, P, D, dtype=dtype), value_pool=torch.zeros(N, P, D + 2, dtype=dtype),
        pos_pool=torch.full((N, P), -1, dtype=torch.int32), valid_pool=torch.zeros(N, P, dtype=torch.bool),
        bias_pool=torch.full((N, P), float("-inf"), dtype=dtype), page_shard=torch.full((N,), -1, dtype=SHARD_DTYPE),
        count=torch.randint(0, 9, (B, H, S), generator=g), key_sum=stats[0], key_sq=stats[1], key_min=stats[2],
        key_max=stats[3], page_min=low, page_max=high, ring_slots=torch.randint(-1, N * P, (B, H, 7), generator=g),
        ring_pos=torch.randint(-1, 3, (B, H, 7), generator=g),
    )  # fmt: skip


def _call(fn, st: dict, shard, row_start, pos: int, cap, key, value, write_kv: bool, ring: bool = False):
    return fn(
        st["open_page"], st["open_fill"], st["n_pages"], st["start"], cap, shard, row_start,
        torch.tensor([pos], device=st["start"].device), key, value, st["key_pool"] if write_kv else None,
        st["value_pool"] if write_kv else None, st["pos_pool"], st["valid_pool"], st["bias_pool"], st["page_shard"],
        st["count"], st["key_sum"], st["key_sq"], st["key_min"], st["key_max"], st["page_min"], st["page_max"],
        *((st["ring_slots"], st["ring_pos"], 2, 5) if ring else ()),
    )  # fmt: skip


@pytest.mark.skipif(not (torch.cuda.is_available() or interpreted(append._append_one_kernel)), reason="no Triton")
@pytest.mark.parametrize(
    "placed, padded, saturate, write_kv, summary, dtype, page_bounds",
    [
        (True, False, False, True, "bounds", torch.float32, None),
        (False, False, False, True, None, torch.float32, torch.float32),
        (False, True, False, True, None, torch.bfloat16, torch.bfloat16),  # Quest's bounds in the keys' dtype
        (True, False, True, False, "bounds", torch.float32, torch.float32),
        (False, True, True, True, "bounds", torch.float16, None),
        (True, True, False, True, "sums", torch.bfloat16, torch.float32),  # float32 bounds of bfloat16 keys
    ],
)
def test_kernel_matches_reference(placed, padded, saturate, write_kv, summary, dtype, page_bounds):
    g = torch.Generator().manual_seed(1)
    shard = torch.randint(0, S, (B, H), generator=g) if placed else None
    row_start = torch.tensor([0, 5]) if padded else None
    cap = torch.full((B, H), 2) if saturate else None
    # keys as the model hands them: a transposed view ([B, q, H, D] storage)
    key = torch.randn(B, 1, H, D, generator=g).to(dtype).transpose(1, 2)[:, :, 0]
    value = torch.randn(B, H, D + 2, generator=g).to(dtype)
    ref = _state(2, dtype, summary, page_bounds)
    got = {name: None if t is None else t.to(DEVICE) for name, t in _state(2, dtype, summary, page_bounds).items()}

    def dev(t):
        return None if t is None else t.to(DEVICE)

    ring = page_bounds is not None  # the ring of recent tokens written too
    for step, pos in enumerate((3, 9, 10)):
        s = None if shard is None else (shard + step) % S
        want = _call(append_one_reference, ref, s, row_start, pos, cap, key, value, write_kv, ring)
        slot = _call(append_one_kernel, got, dev(s), dev(row_start), pos, dev(cap), dev(key), dev(value), write_kv,
                     ring)  # fmt: skip
        assert torch.equal(slot.cpu(), want)
        for name, t in ref.items():
            if t is not None:  # squares may be fused into an FMA on CUDA: one rounding apart
                tol = 1e-6 if name == "key_sq" else 0
                torch.testing.assert_close(got[name].cpu(), t, rtol=tol, atol=tol, msg=f"{name} after step {step}")
    assert bool(ref["valid_pool"].any()) and int(ref["valid_pool"].sum()) <= 3 * B * H
    before = _state(2, dtype, summary, page_bounds)
    if ring:  # entry 2 + pos % 5 of every (row, head): its slot at pos 10 (and 9, 3 before it); the others as before
        entries = {2 + 10 % 5: (slot, 10), 2 + 9 % 5: (None, 9), 2 + 3 % 5: (None, 3)}
        for e in range(7):
            if e in entries:
                assert bool((ref["ring_pos"][..., e] == entries[e][1]).all())
            else:
                assert torch.equal(ref["ring_pos"][..., e], before["ring_pos"][..., e])
        assert torch.equal(ref["ring_slots"][..., 2], slot.cpu())
    if page_bounds is not None:  # the bounds of every page written: those set before, widened by its new keys
        pages = ref["valid_pool"].any(-1)
        assert bool(pages.any()) and not torch.equal(ref["page_min"][pages], before["page_min"][pages])
        keys = ref["key_pool"] if write_kv else None
        if keys is not None:
            kb = keys.to(page_bounds).masked_fill(~ref["valid_pool"].unsqueeze(-1), float("inf"))
            assert torch.equal(ref["page_min"][pages], torch.minimum(before["page_min"], kb.amin(1))[pages])


@pytest.mark.skipif(not (torch.cuda.is_available() or interpreted(append._append_one_kernel)), reason="no Triton")
def test_kernel_reads_an_expanded_shard_view_as_its_values():
    """The expert placement hands ``[B, H]`` shards as a view of one expert per row (stride 0 over heads): the kernel
    read element ``b * H + h`` of the row buffer (another row's expert, or memory past it: out-of-bounds page
    writes on CUDA for every decode step of ``router="expert"``)."""
    shard = torch.tensor([1, 3]).view(B, 1).expand(B, H)
    row_start = torch.tensor([[0, 9], [5, 9]])[:, 0]  # a strided [B] view
    ref, got = _state(3), {k: None if t is None else t.to(DEVICE) for k, t in _state(3).items()}
    key, value = torch.randn(B, H, D), torch.randn(B, H, D + 2)
    want = _call(append_one_reference, ref, shard, row_start, 7, None, key, value, True)
    slot = _call(append_one_kernel, got, shard.to(DEVICE), row_start.to(DEVICE), 7, None, key.to(DEVICE),
                 value.to(DEVICE), True)  # fmt: skip
    assert torch.equal(slot.cpu(), want)
    for name in ("count", "open_page", "open_fill", "page_shard", "key_pool", "pos_pool", "valid_pool"):
        assert torch.equal(got[name].cpu(), ref[name]), name


def _stores(num_shards: int, page_size: int) -> tuple[PagedStore, PagedStore]:
    return tuple(
        PagedStore(B, H, D, D, num_shards, page_size, torch.float32, torch.device("cpu")) for _ in range(2)
    )  # fmt: skip


@pytest.mark.parametrize("window", [5, 0])
def test_late_sinks_enter_their_entries(window):
    """A row holding fewer than ``n_sink`` tokens gets its next ones as sinks: the ``t``-th real token of a row
    (positions from ``row_start``) goes to special entry ``t < n_sink``, with or without a ring of recent tokens,
    and nothing else changes there (the kernel, interpreted on CPU, equals the reference). Before, the store scanned
    its whole frame again at every step while a row was short, and a compiled step recompiled when the row filled."""
    n_sink, row_start = 3, torch.tensor([0, 5])
    ref = _state(2)
    width = n_sink + window
    ref["ring_slots"] = torch.full((B, H, width), -1, dtype=torch.int64)
    ref["ring_pos"] = torch.full((B, H, width), -(2**62), dtype=torch.int64)
    ref["ring_slots"][:, :, 0], ref["ring_pos"][:, :, 0] = 7, 0  # row 0 holds its first token already
    got = {name: None if t is None else t.clone().to(DEVICE) for name, t in ref.items()}
    kernel = torch.cuda.is_available() or interpreted(append._append_one_kernel)
    g = torch.Generator().manual_seed(3)
    sinks = {}  # (row, entry) -> (slot [H], pos) expected
    for pos in (1, 2, 5, 6, 9):
        key, value = torch.randn(B, H, D, generator=g), torch.randn(B, H, D + 2, generator=g)
        args = (None, row_start, pos, None, key, value, True)
        want = append_one_reference(*_args(ref, *args), ref["ring_slots"], ref["ring_pos"], n_sink, window)
        if kernel:
            dev_args = (None, row_start.to(DEVICE), pos, None, key.to(DEVICE), value.to(DEVICE), True)
            slot = append_one_kernel(*_args(got, *dev_args), got["ring_slots"], got["ring_pos"], n_sink, window)
            assert torch.equal(slot.cpu(), want)
        for b in range(B):
            t = pos - int(row_start[b])
            if 0 <= t < n_sink:
                sinks[b, t] = (want[b], pos)
    assert sorted(sinks) == [(0, 1), (0, 2), (1, 0), (1, 1)]  # rows' tokens at ordinals 1, 2 / 0, 1
    for b in range(B):
        for e in range(n_sink):
            slot, pos = sinks.get((b, e), (torch.full((H,), 7 if (b, e) == (0, 0) else -1), 0 if b == 0 else None))
            assert torch.equal(ref["ring_slots"][b, :, e], slot), (b, e)
            assert bool((ref["ring_pos"][b, :, e] == (-(2**62) if pos is None else pos)).all()), (b, e)
    if window:  # the ring: the newest token of each residue of the last positions
        assert torch.equal(ref["ring_pos"][0, 0, n_sink:], torch.tensor([5, 6, 2, -(2**62), 9]))
    if kernel:
        for name in ("ring_slots", "ring_pos", "pos_pool", "count"):
            assert torch.equal(got[name].cpu(), ref[name]), name


def _args(st: dict, shard, row_start, pos: int, cap, key, value, write_kv: bool) -> tuple:
    """The arguments of ``append_one_reference`` up to the page bounds (none kept)."""
    return (
        st["open_page"], st["open_fill"], st["n_pages"], st["start"], cap, shard, row_start,
        torch.tensor([pos], device=st["start"].device), key, value, st["key_pool"] if write_kv else None,
        st["value_pool"] if write_kv else None, st["pos_pool"], st["valid_pool"], st["bias_pool"], st["page_shard"],
        st["count"], st["key_sum"], st["key_sq"], st["key_min"], st["key_max"], None, None,
    )  # fmt: skip


@pytest.mark.parametrize(
    "num_shards, page_size, round_robin, bounds", [(4, 4, False, True), (8, 16, True, True), (16, 1, False, False)]
)
def test_store_append_one_equals_general_append(num_shards, page_size, round_robin, bounds):
    """Forty decode tokens after a 37-token prefill: ``append_one`` (the operator) leaves the pool, page table and
    shard statistics exactly as the general append (a stable sort per shard) of the same tokens, room checks and
    growth included; shard bounds are kept from a summary on (``bounds``), and otherwise never allocated."""
    g = torch.Generator().manual_seed(0)
    one, ref = _stores(num_shards, page_size)
    t0 = 37
    k = torch.randn(B, H, t0, D, generator=g)
    v = torch.randn(B, H, t0, D, generator=g)
    shard = torch.randint(0, num_shards, (B, H, t0), generator=g)
    pos = torch.arange(t0)
    for st in (one, ref):
        st.append(k, v, shard, pos)
        if bounds:
            st.summary(torch.zeros(B, H, num_shards))  # key statistics with bounds kept from here on
        else:
            st.keep_summaries()  # sums and squares only (what the top-k centroid selector reads)
    for t in range(t0, t0 + 40):
        k1, v1 = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
        if round_robin:
            sh = torch.full((B, H, 1), (t // page_size) % num_shards)
        else:
            sh = torch.randint(0, num_shards, (B, H, 1), generator=g)
        p = torch.tensor([t])
        got = one.append_one(k1, v1, None if round_robin else sh, p)
        want = ref.append(k1, v1, sh, p)
        # the same local slot of the same run (runs may have grown at different steps: starts differ)
        local = [slot - st.table.start.unsqueeze(-1) * page_size for slot, st in ((got, one), (want, ref))]
        assert torch.equal(*local)
    used = int(one.table.n_pages.max()) * page_size
    for name in ("keys", "values", "pos", "valid", "bias", "shard"):
        n = used // page_size if name == "shard" else used
        assert torch.equal(one.frame(name)[:, :, :n], ref.frame(name)[:, :, :n]), name
    for name in ("n_pages", "open_page", "open_fill"):
        assert torch.equal(getattr(one.table, name), getattr(ref.table, name)), name
    for name in ("count", "sum", "sq", *(("min", "max") if bounds else ())):
        torch.testing.assert_close(getattr(one.stats, name), getattr(ref.stats, name), rtol=1e-6, atol=1e-5)
    assert one.stats.bounds_kept == ref.stats.bounds_kept == bounds


@contextlib.contextmanager
def _host_reads():
    """Counts the tensor values read back as Python ints inside it (``[n]``)."""
    reads, real = [0], torch.Tensor.__int__

    def counting(t):
        reads[0] += 1
        return real(t)

    torch.Tensor.__int__ = counting
    try:
        yield reads
    finally:
        torch.Tensor.__int__ = real


def test_append_one_room_is_counted_on_the_host():
    """Decode appends read the room left back from the device only when the pages the tokens since the last count
    could have opened may exceed it: with the 1/64 headroom of 16k tokens in pages of 16 (16 pages), round robin
    counts at most once in 64 steps (counting one page down per step read every 16), and no run goes past its
    capacity."""
    st = _stores(8, 16)[0]
    t0 = 16384
    st.append(torch.randn(1, 1, t0, D).expand(B, H, -1, -1), torch.zeros(B, H, t0, D),
              torch.zeros(B, H, t0, dtype=torch.int64), torch.arange(t0))  # fmt: skip
    steps_that_read = 0
    for t in range(t0, t0 + 64):
        with _host_reads() as reads:
            st.append_one(torch.randn(B, H, 1, D), torch.randn(B, H, 1, D), None, torch.tensor([t]))
        steps_that_read += reads[0] > 0
        assert bool((st.table.n_pages <= st.table.cap).all())
    assert steps_that_read <= 1


def test_operator_registration():
    """Schema (mutated arguments), fake implementation and dispatch of ``torch.ops.pikv.append_one``."""
    st = _state(3, page_bounds=torch.float32)
    args = (
        st["open_page"], st["open_fill"], st["n_pages"], st["start"], None, torch.zeros(B, H, dtype=torch.int64),
        None, torch.tensor([7]), torch.randn(B, H, D), torch.randn(B, H, D + 2), st["key_pool"], st["value_pool"],
        st["pos_pool"], st["valid_pool"], st["bias_pool"], st["page_shard"], st["count"], st["key_sum"],
        st["key_sq"], st["key_min"], st["key_max"], st["page_min"], st["page_max"], None, None, 0, 0,
    )  # fmt: skip
    torch.library.opcheck(append_one_op, args, test_utils=("test_schema", "test_faketensor"))


def test_no_operator_gives_an_argument_it_mutates_a_default():
    """torch 2.11's boxed call drops trailing arguments equal to their defaults, and its in-place version bump then
    indexes the mutated ones past the end (an H200 run: every compiled step through ``pikv::append_one`` failed)."""
    import pikv_hf.store  # noqa: F401  (registers pikv::fold_page_bounds)

    ops = torch._C._dispatch_get_all_op_names()
    names = sorted(n.split("::")[1].split(".")[0] for n in ops if n.startswith("pikv::"))
    assert "append_one" in names and "fold_page_bounds" in names
    defaulted = {
        name: [a.name for a in getattr(torch.ops.pikv, name).default._schema.arguments
               if a.alias_info is not None and a.alias_info.is_write and a.has_default_value()]
        for name in names
    }  # fmt: skip
    assert {k: v for k, v in defaulted.items() if v} == {}


_COMPILE_SM90 = """
from sm90 import compile_sm90
from pikv_hf.kernels import append
for flags in ((True, False, False, True, True, True), (False, True, True, False, False, False),
              (True, True, False, True, True, False)):  # fmt: skip
    const = dict(zip(("HAS_SHARD", "HAS_ROW_START", "SATURATE", "WRITE_KV", "SUMMARY", "BOUNDS"), flags))
    const["PAGE_BOUNDS"] = const["RING"] = not flags[-1]
    const |= dict(BLOCK_DK=128, BLOCK_DV=128)
    compile_sm90(append._append_one_kernel, const, num_warps=1)
    print("ok")
"""


def test_kernel_compiles_for_sm90_without_a_gpu():
    """The CUDA front end (stricter than the interpreter) compiles the kernel's flag sets for sm_90 (sums with and
    without bounds)."""
    assert run_without_interpreter(_COMPILE_SM90).split() == ["ok", "ok", "ok"]


def test_round_robin_counts_once_per_page_with_one_page_of_room():
    """Under the round robin with the position known on the host, the tokens of one group of ``P`` ordinals open at
    most one page: a run kept one page ahead (a small store, as the hot store beside a 4-bit tier) is counted once
    per page, not every step, and never runs past its capacity."""
    st = _stores(8, 16)[0]
    st.append(torch.randn(B, H, 40, D), torch.randn(B, H, 40, D), torch.zeros(B, H, 40, dtype=torch.int64),
              torch.arange(40))  # fmt: skip
    steps_that_read = 0
    for t in range(40, 40 + 64):
        with _host_reads() as reads:
            st.append_one(torch.randn(B, H, 1, D), torch.randn(B, H, 1, D), None, torch.tensor([t]), position=t)
        steps_that_read += reads[0] > 0
        assert bool((st.table.n_pages <= st.table.cap).all())
        assert int(st.table.cap.max()) <= int(st.table.n_pages.max()) + 1  # one page ahead, no more
    assert 0 < steps_that_read <= 64 // 16 + 1


def test_eager_calls_skip_the_dispatcher_and_dispatch_modes_see_the_operator():
    """``eager_direct``: eager code runs the implementation for the tensors' device (found in a list argument too),
    dispatch modes (fake tensors, the operator count of ``benchmarks/count_ops.py``) the operator, and traced code
    the operator where ``traced_as_operator`` says so (CUDA), else the CPU implementation."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from pikv_hf.kernels._triton import eager_direct

    calls = []
    call = eager_direct(*(lambda *a, n=n: calls.append(n) for n in ("operator", "cuda", "cpu")))
    call(torch.ones(1), 3)
    call([torch.ones(1)], [2], 0.5)  # a Tensor[] argument first (Quest's group select)

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        call(torch.ones(1), 3)
    torch.compile(lambda t: call(t, 3) or t, backend="eager", fullgraph=True)(torch.ones(1))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_triton, "traced_as_operator", lambda t: True)  # as on CUDA
        torch.compile(lambda t: call(t, 4) or t, backend="eager", fullgraph=True)(torch.ones(1))
    assert calls == ["cpu", "cpu", "operator", "cpu", "operator"]
