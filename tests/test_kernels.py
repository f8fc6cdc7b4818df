"""Triton kernels (``pikv_hf.kernels``) against their torch references and against torch SDPA over the same tokens
laid out densely. Without a GPU they run interpreted on CPU (``conftest.py`` sets ``TRITON_INTERPRET=1``), so the
shapes are small: ~200 positions, batch 3, two KV heads.

Inputs are built from a dense token list (``Case``): each (row, KV head) stores its row's real tokens in shards of
pages (ragged last pages, some shards empty, a few evicted slots), the pages scattered over a pool that also holds
garbage pages. The dense side knows every token's position, shard and validity, so its masks are computed without
the kernels' or the backend's code. The dense references run in float32 on the stored (possibly 16-bit) values.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from helpers import KERNEL_DEVICE as DEVICE
from helpers import run_without_interpreter

from pikv_hf.kernels import (
    decode_attention,
    decode_attention_quant,
    decode_attention_reference,
    dequantize_pages,
    gather_pages,
    gather_pages_reference,
    quantize_pages,
)
from pikv_hf.kernels._triton import check_launchable

# bfloat16 on CUDA: the probabilities are rounded to bfloat16 (8 mantissa bits) before the tensor-core p @ v dot, an
# error of up to ~2**-9 relative per term, which measured 1.1e-3..1.4e-3 on an H200 (float32 accumulation after it)
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-3}
T, PADS, H, SHARDS, N_SINK, WINDOW = 200, (0, 37, 81), 2, 8, 4, 9  # positions, left padding of the 3 rows


@dataclass
class Case:
    """Pool tensors and page tables of one decode read, with the same tokens densely ``[B, H, T, ...]``."""

    query: torch.Tensor  # [B, Hq, q, Dk]
    keys: torch.Tensor  # [N, P, Dk] pool
    values: torch.Tensor  # [N, P, Dv]
    pos: torch.Tensor  # [N, P] int32
    valid: torch.Tensor  # [N, P] bool
    table: torch.Tensor  # [B, H, n] every page of each run, -1 padded (ragged rows)
    sparse: torch.Tensor  # [B, H, m] pages of the selected shards and the sink / recent pages, -1 padded
    sparse_full: torch.Tensor  # [B, H, m] True for the selected shards' pages
    qpos: torch.Tensor  # [q]
    row_start: torch.Tensor  # [B]
    dense_k: torch.Tensor  # [B, H, T, Dk] float32, position = index
    dense_v: torch.Tensor  # [B, H, T, Dv]
    stored: torch.Tensor  # [B, H, T] stored and valid
    selected: torch.Tensor  # [B, H, T] in a selected shard, a sink or the recent window


def _case(gqa: int, dk: int, dv: int, page: int, dtype: torch.dtype, q: int = 1, seed: int = 0) -> Case:
    gen = torch.Generator().manual_seed(seed)
    b = len(PADS)
    dense_k = torch.randn(b, H, T, dk, generator=gen).to(dtype)
    dense_v = torch.randn(b, H, T, dv, generator=gen).to(dtype)
    shard = torch.randint(0, SHARDS, (b, H, T), generator=gen)
    shard[1, 0] %= SHARDS // 2  # row 1, head 0: half of the shards hold nothing
    real = (torch.arange(T) >= torch.tensor(PADS).view(b, 1, 1)).expand(b, H, T)  # padding is not stored
    stored = real & (torch.rand(b, H, T, generator=gen) > 0.05)  # a few slots evicted (invalid)
    qpos = torch.arange(T - q, T)
    rel = torch.arange(T) - torch.tensor(PADS).view(b, 1, 1)
    special = (((rel >= 0) & (rel < N_SINK)) | (torch.arange(T) > qpos[-1] - WINDOW)).expand(b, H, T)
    chosen = torch.stack([torch.randperm(SHARDS, generator=gen)[: SHARDS // 4] for _ in range(b * H)]).view(b, H, -1)
    in_chosen = (shard.unsqueeze(-1) == chosen.unsqueeze(2)).any(-1)
    pages = []  # (b, h, token positions, chosen shard?)
    for bi, hi, si in itertools.product(range(b), range(H), range(SHARDS)):
        toks = torch.nonzero(real[bi, hi] & (shard[bi, hi] == si)).flatten()
        pages += [(bi, hi, toks[i : i + page], bool((chosen[bi, hi] == si).any())) for i in range(0, len(toks), page)]
    n_pool = len(pages) + 5  # garbage pages nobody owns
    gid = torch.randperm(n_pool, generator=gen)[: len(pages)]
    keys = torch.randn(n_pool, page, dk, generator=gen).to(dtype)  # garbage in empty slots and unowned pages
    values = torch.randn(n_pool, page, dv, generator=gen).to(dtype)
    pos = torch.randint(0, T, (n_pool, page), generator=gen, dtype=torch.int32)
    valid = torch.zeros(n_pool, page, dtype=torch.bool)
    runs = {key: [] for key in itertools.product(range(b), range(H))}
    for g_id, (bi, hi, toks, full) in zip(gid.tolist(), pages, strict=True):
        n = len(toks)
        keys[g_id, :n], values[g_id, :n] = dense_k[bi, hi, toks], dense_v[bi, hi, toks]
        pos[g_id, :n], valid[g_id, :n] = toks.to(torch.int32), stored[bi, hi, toks]
        runs[bi, hi].append((g_id, full, bool(special[bi, hi, toks].any())))
    table, sparse, full = [], [], []
    for key in runs:
        order = torch.randperm(len(runs[key]), generator=gen).tolist()  # shards interleaved in the run
        run = [runs[key][i] for i in order]
        table.append([g for g, _, _ in run])
        read = [(g, f) for g, f, s in run if f or s]
        sparse.append([g for g, _ in read])
        full.append([f for _, f in read])
    selected = stored & (in_chosen | special)
    query = torch.randn(b, H * gqa, q, dk, generator=gen).to(dtype)
    return Case(
        query.to(DEVICE), keys.to(DEVICE), values.to(DEVICE), pos.to(DEVICE), valid.to(DEVICE),
        _padded(table, b, -1).to(DEVICE), _padded(sparse, b, -1).to(DEVICE), _padded(full, b, False).to(DEVICE),
        qpos.to(DEVICE), torch.tensor(PADS).to(DEVICE), dense_k.float(), dense_v.float(), stored, selected,
    )  # fmt: skip


def _padded(rows: list[list], b: int, fill) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [fill] * (width - len(r)) for r in rows]).view(b, H, width)


def _dense(case: Case, allowed: torch.Tensor, scale: float, sliding_window: int | None = None):
    """SDPA over the dense tokens that ``allowed`` (``[B, H, T]``) lets each query attend, and the log-sum-exp
    of those logits: ``(o [B, Hq, q, Dv], lse [B, Hq, q])``."""
    qpos = case.qpos.cpu()
    query = case.query.float().cpu()
    g = query.shape[1] // H
    rel = qpos.view(-1, 1) - torch.arange(T)  # [q, T]
    causal = (rel >= 0) & (rel < (sliding_window or T + 1))
    mask = (allowed.unsqueeze(2) & causal).repeat_interleave(g, 1)  # [B, Hq, q, T]
    k, v = case.dense_k.repeat_interleave(g, 1), case.dense_v.repeat_interleave(g, 1)
    o = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale)
    lse = (query @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf")).logsumexp(-1)
    return o, lse


def _assert_close(got: tuple, want: tuple, tol: float) -> None:
    for a, b in zip(got, want, strict=True):
        assert (a.cpu() - b.cpu()).abs().max().item() < tol


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DIMS = ((64, 64), (128, 128), (128, 64))  # (Dk, Dv): K and V head dims may differ (DeepSeek)
MATRIX = [
    (dt, page, gqa, DIMS[i % 3]) for i, (dt, page, gqa) in enumerate(itertools.product(DTYPES, (1, 16, 64), (1, 4, 8)))
]


@pytest.mark.parametrize(
    ("dtype", "page", "gqa", "dims"), MATRIX, ids=[f"{str(d)[6:]}-P{p}-G{g}-{k}x{v}" for d, p, g, (k, v) in MATRIX]
)
def test_decode_equals_reference_and_sdpa_exact_and_sparse(dtype, page, gqa, dims):
    case = _case(gqa, *dims, page, dtype)
    scale, tol = dims[0] ** -0.5, TOL[dtype]
    exact = decode_attention(
        case.query, case.keys, case.values, case.pos, case.valid, case.table, case.qpos, scale, num_splits=2
    )
    _assert_close(exact, _dense(case, case.stored, scale), tol)
    ref = decode_attention_reference(
        case.query, case.keys, case.values, case.pos, case.valid, case.table, case.qpos, scale
    )
    _assert_close(exact, ref, tol)
    plan = dict(page_full=case.sparse_full, n_sink=N_SINK, window=WINDOW, row_start=case.row_start)
    args = (case.query, case.keys, case.values, case.pos, case.valid, case.sparse, case.qpos, scale)
    sparse = decode_attention(*args, **plan)
    _assert_close(sparse, _dense(case, case.selected, scale), tol)
    _assert_close(sparse, decode_attention_reference(*args, **plan), tol)
    read = case.selected.sum().item() / case.stored.sum().item()
    assert 0.2 < read < 0.6  # a quarter of the shards, plus the sink and recent tokens


def test_many_query_tokens_row_tiles_splits_sliding_window_and_sinks():
    """q = 10 tokens x 8 query heads per KV head = 80 rows (two row tiles), split 1 or 5 ways, a sliding window
    and GPT-OSS sinks (a value-less extra logit per query head), against a dense softmax with a sink column."""
    case = _case(8, 64, 64, 16, torch.float32, q=10, seed=1)
    scale, window = 0.125, 50
    sinks = torch.randn(case.query.shape[1], generator=torch.Generator().manual_seed(2)).to(DEVICE)
    args = (case.query, case.keys, case.values, case.pos, case.valid, case.table, case.qpos, scale)
    one = decode_attention(*args, sliding_window=window, sinks=sinks, num_splits=1)
    five = decode_attention(*args, sliding_window=window, sinks=sinks, num_splits=5)
    _assert_close(one, five, 1e-5)
    o, lse = _dense(case, case.stored, scale, sliding_window=window)
    sink = sinks.cpu().view(1, -1, 1)
    total = torch.logaddexp(lse, sink)
    _assert_close(one, (o * torch.exp(lse - total).unsqueeze(-1), total), 1e-5)
    _assert_close(one, decode_attention_reference(*args, sliding_window=window, sinks=sinks), 1e-5)


def test_rows_with_nothing_to_read_give_zero_output_and_the_sink_alone():
    case = _case(4, 64, 64, 16, torch.float16)
    table = case.table.clone()
    table[1] = -1  # row 1 reads no page (every shard of the plan empty)
    args = (case.query, case.keys, case.values, case.pos, case.valid, table, case.qpos, 0.125)
    o, lse = decode_attention(*args, num_splits=3)
    assert torch.equal(o[1], torch.zeros_like(o[1])) and torch.isinf(lse[1]).all() and (lse[1] < 0).all()
    _assert_close((o[[0, 2]], lse[[0, 2]]), [t[[0, 2]] for t in _dense(case, case.stored, 0.125)], 1e-3)
    sinks = torch.full((case.query.shape[1],), 0.5, device=DEVICE)
    o, lse = decode_attention(*args, sinks=sinks)
    assert torch.equal(o[1], torch.zeros_like(o[1])) and torch.equal(lse[1], torch.full_like(lse[1], 0.5))
    none = case.table[:, :, :0]  # a table with no entries at all (the torch reference raised on it)
    for read in (decode_attention, decode_attention_reference):
        o, lse = read(case.query, case.keys, case.values, case.pos, case.valid, none, case.qpos, 0.125)
        assert torch.equal(o, torch.zeros_like(o)) and torch.isinf(lse).all() and (lse < 0).all()


def test_lengths_bound_the_table_rows_and_attended_counts_the_last_query():
    case = _case(4, 96, 48, 16, torch.float32, q=2)  # head dims that are not powers of two (masked channels)
    lengths = (case.table >= 0).sum(-1)  # runs fill their rows from the front
    cut = lengths.clone()
    cut[0, 1] -= 2  # row 0, head 1 reads two pages fewer
    args = (case.query, case.keys, case.values, case.pos, case.valid, case.table, case.qpos, 0.125)
    *full, attended = decode_attention(*args, lengths=lengths, count=True, num_splits=4)
    _assert_close(full, _dense(case, case.stored, 0.125), 1e-5)
    assert torch.equal(attended.cpu(), case.stored.sum(-1))  # every stored token is before the last query
    early = replace(case, qpos=case.qpos - 20)  # queries that precede the last 20 stored positions
    *got, attended = decode_attention(*args[:6], early.qpos, 0.125, lengths=lengths, count=True, num_splits=4)
    _assert_close(got, _dense(early, case.stored, 0.125), 1e-5)
    assert torch.equal(attended.cpu(), case.stored[..., : T - 20].sum(-1))
    short = decode_attention(*args, lengths=cut, num_splits=4)
    dropped = case.table.cpu()[0, 1, cut[0, 1] : lengths[0, 1]]
    keep = case.stored.clone()
    keep[0, 1, case.pos.cpu()[dropped][case.valid.cpu()[dropped]].long()] = False
    _assert_close(short, _dense(case, keep, 0.125), 1e-5)
    plan = dict(page_full=case.sparse_full, n_sink=N_SINK, window=WINDOW, row_start=case.row_start)
    _, _, attended = decode_attention(*args[:5], case.sparse, case.qpos, 0.125, count=True, sliding_window=30, **plan)
    recent = torch.arange(T) > case.qpos[-1].item() - 30
    assert torch.equal(attended.cpu(), (case.selected & recent).sum(-1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bool, torch.int32, torch.uint8])
@pytest.mark.parametrize("page_shape", [(16, 6), (1,), (64,), ()])
def test_gather_pages_equals_indexing_and_the_reference(dtype, page_shape):
    gen = torch.Generator().manual_seed(0)
    field = (torch.randn(9, *page_shape, generator=gen) * 100).to(dtype).to(DEVICE)
    pages = torch.tensor([[3, -1, 0, 8], [8, 2, -1, -1]], dtype=torch.int32, device=DEVICE)
    got = gather_pages(field, pages)
    want = torch.stack([field[p] if p >= 0 else torch.zeros_like(field[0]) for p in pages.flatten().tolist()])
    assert got.shape == (2, 4, *page_shape) and torch.equal(got.flatten(0, 1), want)
    assert torch.equal(gather_pages_reference(field, pages), got)
    out = torch.empty_like(got)
    assert gather_pages(field, pages, out=out) is out and torch.equal(out, got)


QUANT_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}  # the dequantised values are rounded


def _holding(case: Case, keys: torch.Tensor, values: torch.Tensor) -> Case:
    """``case`` with its dense tokens as the pool pages ``keys`` / ``values`` (``[N, P, D]``, e.g. dequantised) hold
    them."""
    dense = replace(case, dense_k=case.dense_k.clone(), dense_v=case.dense_v.clone())
    for bi, hi in itertools.product(range(len(PADS)), range(H)):
        run = case.table[bi, hi][case.table[bi, hi] >= 0]
        ok = case.valid[run]
        dense.dense_k[bi, hi, case.pos[run][ok].long()] = keys[run][ok].cpu()
        dense.dense_v[bi, hi, case.pos[run][ok].long()] = values[run][ok].cpu()
    return dense


@pytest.mark.parametrize(
    "bits, scale_dtype, dtype, group",
    [
        (4, torch.float32, torch.float16, 32),
        (8, torch.float32, torch.float32, 128),
        (2, torch.float16, torch.bfloat16, 16),
    ],
)
def test_quantised_decode_equals_dequantised_reference_and_sdpa(bits, scale_dtype, dtype, group):
    """The kernel rounds dequantised keys and values to the query's dtype for its tensor-core dots (float32 queries:
    float32 throughout), hence the 16-bit tolerances; value groups of 4, 1 and 8 per 128-channel row (the
    kernel broadcasts one scale / zero per slot and group)."""
    case = _case(4, 64, 128, 16, dtype, q=2)
    quant = quantize_pages(case.keys, case.values, bits, group=group, valid=case.valid, scale_dtype=scale_dtype)
    keys, values = dequantize_pages(quant)
    dense = _holding(case, keys, values)
    plan = dict(page_full=case.sparse_full, n_sink=N_SINK, window=WINDOW, row_start=case.row_start)
    for table, extra, allowed in ((case.table, {}, case.stored), (case.sparse, plan, case.selected)):
        args = (case.query, quant, case.pos, case.valid, table, case.qpos, 0.125)
        got = decode_attention_quant(*args, num_splits=2, **extra)
        _assert_close(got, _dense(dense, allowed, 0.125), QUANT_TOL[dtype])
        ref = decode_attention_reference(case.query, keys, values, *args[2:], **extra)
        _assert_close(got, ref, QUANT_TOL[dtype])


@pytest.mark.parametrize("bits", [0, 4])
def test_pages_of_more_than_a_tile_but_not_whole_tiles_read_each_tile_slot_from_its_own_page(bits):
    """Pages of 96 slots (a tile of 64 crosses a page boundary): each slot of such a tile is read from its own table
    entry's page (with that page's key scales), exact and sparse tables, against the dense float reference."""
    case = _case(4, 64, 64, 96, torch.float32, seed=3)
    assert (case.table >= 0).sum(-1).max() >= 3  # rows of several scattered pages: tiles cross page boundaries
    quant = quantize_pages(case.keys, case.values, bits, group=16, valid=case.valid) if bits else None
    dense = _holding(case, *dequantize_pages(quant)) if bits else case
    plan = dict(page_full=case.sparse_full, n_sink=N_SINK, window=WINDOW, row_start=case.row_start)
    for table, extra, allowed in ((case.table, {}, case.stored), (case.sparse, plan, case.selected)):
        if bits:
            got = decode_attention_quant(case.query, quant, case.pos, case.valid, table, case.qpos, 0.125, **extra)
        else:
            args = (case.query, case.keys, case.values, case.pos, case.valid, table, case.qpos, 0.125)
            got = decode_attention(*args, **extra)
        _assert_close(got, _dense(dense, allowed, 0.125), 1e-5)


def test_quantised_layout_packs_low_bits_first_with_per_channel_keys_and_grouped_values():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 16, 8), generator=gen)
    codes[:, 0], codes[:, 1] = 0, 15  # every page and channel spans [0, 15]: scale 1, zero 0
    keys = codes.float() * 0.5 - 2  # scale 0.5, zero -2 per page and channel
    quant = quantize_pages(keys, keys, 4, group=4)
    assert quant.kq.shape == (3, 16, 4) and quant.kq.dtype == torch.uint8
    assert torch.equal(quant.kq.long(), codes[..., 0::2] | (codes[..., 1::2] << 4))
    assert torch.equal(quant.k_scale, torch.full((3, 8), 0.5)) and torch.equal(quant.k_zero, torch.full((3, 8), -2.0))
    assert quant.v_scale.shape == (3, 16, 2) and quant.group == 4
    v = keys.view(3, 16, 2, 4)
    assert torch.allclose(quant.v_zero, v.amin(-1)) and torch.allclose(quant.v_scale, (v.amax(-1) - v.amin(-1)) / 15)
    deq_k, deq_v = dequantize_pages(quant)
    assert torch.equal(deq_k, keys)
    assert ((deq_v - keys).abs() <= quant.v_scale.repeat_interleave(4, -1) / 2 + 1e-6).all()
    eight = quantize_pages(keys, keys, 8, group=8)
    assert eight.kq.shape == (3, 16, 8) and (dequantize_pages(eight)[1] - keys).abs().max() < 7.5 / 255 / 2 + 1e-6


def _bad_inputs():
    case = _case(4, 64, 64, 16, torch.float16)
    base = dict(
        query=case.query, keys=case.keys, values=case.values, pos=case.pos, valid=case.valid, pages=case.table,
        qpos=case.qpos, scale=0.125,
    )  # fmt: skip
    n_pool = case.keys.shape[0]
    wide = torch.zeros(n_pool, 16, 128, dtype=torch.float16, device=DEVICE)
    table = case.table.clone()
    table[2, 1, 0] = n_pool
    return base, [
        (dict(keys=case.keys.transpose(0, 1).contiguous().transpose(0, 1)), ValueError, "keys must be contiguous"),
        (dict(values=wide[:, :, ::2]), ValueError, r"values must be contiguous; got strides \(2048, 128, 2\)"),
        (dict(query=case.query[..., :32].contiguous()), ValueError, rf"keys must have shape \[{n_pool}, 16, 32\]"),
        (dict(query=case.query[..., ::2]), ValueError, "unit stride on its last dim"),
        (dict(keys=case.keys.float()), TypeError, "keys must be torch.float16; got torch.float32"),
        (dict(pos=case.pos.long()), TypeError, "pos must be torch.int32; got torch.int64"),
        (dict(pages=case.table.float()), TypeError, "pages must be torch.int32 or torch.int64"),
        (dict(pages=table), IndexError, rf"page table ids must be in \[-1, {n_pool}\).*max {n_pool}"),
        (dict(pages=case.table[:, [0, 1, 1]]), ValueError, r"query heads \(8\) must be a multiple"),
        (dict(qpos=case.qpos.view(1, 1)), ValueError, r"qpos must have shape \[1\]"),
        (dict(lengths=torch.full((3, 2), 99, device=DEVICE)), IndexError, "lengths must be in"),
        (dict(sliding_window=0), ValueError, "sliding_window must be >= 1"),
    ]


def test_bad_inputs_raise_clear_errors_before_launch():
    base, cases = _bad_inputs()
    for change, error, message in cases:
        with pytest.raises(error, match=message):
            decode_attention(**{**base, **change})
    quant = quantize_pages(base["keys"], base["values"], 4, group=16)
    args = (base["query"], quant, base["pos"], base["valid"], base["pages"], base["qpos"], 0.125)
    with pytest.raises(ValueError, match="bits must be one of"):
        decode_attention_quant(base["query"], quantize_pages(base["keys"], base["values"], 3, group=16), *args[2:])
    with pytest.raises(TypeError, match="k_zero must be torch.float16"):  # the four scale fields share a dtype
        quant.k_scale = quant.k_scale.half()
        decode_attention_quant(*args)
    with pytest.raises(IndexError, match=r"page ids must be in \[-1, 9\)"):
        gather_pages(torch.zeros(9, 4, device=DEVICE), torch.tensor([0, 9], device=DEVICE))
    with pytest.raises(ValueError, match="field must be contiguous"):
        gather_pages(torch.zeros(9, 4, device=DEVICE).t(), torch.tensor([0], device=DEVICE))
    with pytest.raises(RuntimeError, match="Triton kernels run on CUDA tensors"):
        check_launchable(object(), torch.device("cpu"))  # a kernel decorated without TRITON_INTERPRET


def test_pikv_hf_and_the_references_import_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # import triton -> ImportError
        "import torch, pikv_hf\n"
        "from pikv_hf.kernels import decode_attention, dequantize_pages, quantize_pages\n"
        "from pikv_hf.attention.triton_backend import make_backend\n"
        "q = quantize_pages(torch.ones(2, 4, 8), torch.ones(2, 4, 8), 8, 4)\n"
        "assert torch.equal(dequantize_pages(q)[0], torch.ones(2, 4, 8))\n"
        # the operator's CPU implementation without triton is the torch reference
        "args = (torch.randn(1, 2, 1, 16), torch.randn(1, 1, 16), torch.randn(1, 1, 16),\n"
        "        torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1, dtype=torch.bool),\n"
        "        torch.zeros(1, 1, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 1.0)\n"
        "o, lse = decode_attention(*args)\n"
        "assert torch.equal(o, args[2].view(1, 1, 1, 16).expand(1, 2, 1, 16))\n"
        "assert torch.allclose(lse, (args[0] @ args[1][0, 0]).view(1, 2, 1), atol=1e-5)\n"
        "from pikv_hf.kernels.gather import gather_pages\n"
        "try:\n"
        "    gather_pages(torch.ones(2, 4), torch.zeros(1, dtype=torch.int64))\n"
        "except RuntimeError as e:\n"
        "    assert 'pip install pikv_hf[kernels]' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('launched without triton')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


_COMPILE_SM90 = """
import triton.language as tl
from sm90 import CODES, compile_sm90, registers
from pikv_hf.kernels import decode
cases = ((0, 1, 128, 2), (0, 64, 64, 1), (0, 16, 64, 0), (2, 16, 64, 1), (4, 64, 64, 2), (8, 16, 32, 0))
for bits, page, block_n, table in cases:  # table 0: global ids, 1: local ids of a run, 2: no table
    const = dict(G=4, Q=1, PAGE=page, DK=128, DV=128, BLOCK_R=16, BLOCK_DK=128, BLOCK_DV=128, HAS_LEN=True,
                 HAS_FULL=True, HAS_SLIDING=False, DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32", BITS=bits,
                 GROUP=64, TABLE=table, SPAN=4096, BLOCK_N=block_n)
    kv = CODES if bits else None
    kernel = compile_sm90(decode._split_kernel, const, kv, num_warps=4, num_stages=2)
    print(f"{bits}-{table}", kernel.metadata.shared)
    if (bits, table) == (0, 1):  # the autotuner's configurations capped in registers
        for block_n, warps, stages in decode._CAPPED:
            capped = compile_sm90(decode._split_kernel, const | dict(BLOCK_N=block_n), kv, num_warps=warps,
                                  num_stages=stages, maxnreg=decode._REG_CAP)
            print(f"capped-{block_n}", registers(capped)[0])
const = dict(R=4, G=4, Q=1, DV=128, BLOCK_S=16, BLOCK_DV=128, HAS_SINKS=True)
print("merge", compile_sm90(decode._merge_kernel, const).metadata.num_warps)
"""


def test_split_kernel_compiles_for_sm90_without_a_gpu():
    """The CUDA front end (unlike the interpreter) compiles every branch after a constexpr early return: the kernel
    of each code width and table mode (global ids, a run's local ids, no table) must compile for sm_90 (bfloat16
    dots, sparse plan, value groups of 64) as triton does on a GPU (an 8-bit ``reshape`` that could not change the
    element count failed only there), and so must the merge kernel and the autotuner's register-capped
    configurations (holding their cap). A subprocess without ``TRITON_INTERPRET`` (the interpreter's kernels cannot be
    compiled)."""
    shared = dict(line.split() for line in run_without_interpreter(_COMPILE_SM90).split("\n") if line)
    capped = {k: int(shared.pop(k)) for k in list(shared) if k.startswith("capped-")}
    assert sorted(shared) == ["0-0", "0-1", "0-2", "2-1", "4-2", "8-0", "merge"]
    assert all(int(v) > 0 for v in shared.values())
    assert sorted(capped) == ["capped-128", "capped-64"] and max(capped.values()) <= 128  # maxnreg holds


def as_runs(case):
    """``case``'s pool laid out as ``PageTable`` runs (each (row, head)'s pages back to back): the pool pages in run
    order (``[N']`` ids into ``case``'s pool), each run's first page and length (``[B, H]``), ``case.table`` and
    ``case.sparse`` as local ids of the runs (``-1`` kept)."""
    b, h, n = case.table.shape
    table = case.table.cpu()
    lengths = (table >= 0).sum(-1)
    order = torch.cat([row[: int(k)] for row, k in zip(table.view(b * h, n), lengths.view(-1), strict=True)])
    run_start = (lengths.view(-1).cumsum(0) - lengths.view(-1)).view(b, h)
    local_of = {g: i for row in table.view(b * h, n) for i, g in enumerate(row[row >= 0].tolist())}
    sparse = case.sparse.cpu().clone().apply_(lambda g: local_of[g] if g >= 0 else -1).to(DEVICE)
    local = torch.arange(n, device=DEVICE).expand(b, h, n).where(case.table >= 0, -1).contiguous()
    return order.to(DEVICE), run_start.to(DEVICE), lengths.to(DEVICE), local, sparse


def test_runs_read_by_local_ids_and_without_a_table_equal_the_global_table():
    """A pool laid out as ``PageTable`` runs (each (row, head)'s pages back to back from ``run_start``): the kernel
    reading the plan's local ids, or each run's first ``lengths`` pages with no table at all, gives what the same
    read through global ids gives, and the dense reference; ``attended`` is summed by the merge kernel."""
    case = _case(4, 64, 64, 16, torch.float32, q=2)
    b, h, n = case.table.shape
    order, run_start, lengths, local, sparse = as_runs(case)
    runs = replace(case, keys=case.keys[order], values=case.values[order], pos=case.pos[order],
                   valid=case.valid[order])  # fmt: skip
    plan = dict(page_full=case.sparse_full, n_sink=N_SINK, window=WINDOW, row_start=case.row_start)
    dense = _dense(case, case.stored, 0.125)
    want_sparse = _dense(case, case.selected, 0.125)
    for splits in (1, 3):
        pool = (runs.query, runs.keys, runs.values, runs.pos, runs.valid)
        *frame, counted = decode_attention(*pool, None, case.qpos, 0.125, lengths=lengths, run_start=run_start,
                                           width=n, count=True, num_splits=splits)  # fmt: skip
        _assert_close(frame, dense, 1e-5)
        assert torch.equal(counted.cpu(), case.stored.sum(-1))
        _assert_close(decode_attention(*pool, local, case.qpos, 0.125, run_start=run_start, num_splits=splits), dense,
                      1e-5)  # fmt: skip
        *got, counted = decode_attention(*pool, sparse, case.qpos, 0.125, run_start=run_start, count=True,
                                         num_splits=splits, **plan)  # fmt: skip
        _assert_close(got, want_sparse, 1e-5)
        assert torch.equal(counted.cpu(), case.selected.sum(-1))
    with pytest.raises(ValueError, match="run_start, lengths and width"):
        decode_attention(*pool, None, case.qpos, 0.125, run_start=run_start)


def test_short_reads_get_splits_until_every_sm_has_a_program(monkeypatch):
    """``auto_splits`` sizes splits from the slots read: a long read aims at ``_PROGRAMS_PER_SM`` programs per SM
    with splits of >= ``_MIN_SPLIT_SLOTS`` slots; a short one (a sparse plan) still gets one program per SM, with
    splits of down to one tile."""
    from pikv_hf.kernels import decode

    monkeypatch.setattr(decode, "_sm_count", lambda index: 132)  # an H200
    cuda = torch.device("cuda", 0)
    assert decode.auto_splits(cuda, 64, 32768) == 9  # 32k x batch 8 x 8 KV heads: 576 programs
    assert decode.auto_splits(cuda, 64, 4096) == 9  # 1/8 of it: the same programs, 455 slots each
    assert decode.auto_splits(cuda, 8, 4096) == 17  # batch 1: 136 programs of 241 slots (16 at >= 256 slots)
    assert decode.auto_splits(cuda, 8, 512) == 8  # a short plan: one tile per split, 64 programs
    assert decode.auto_splits(cuda, 8, 100_000) == 64  # capped at _MAX_SPLITS
    assert decode.auto_splits(torch.device("cpu"), 8, 4096) == 1


def test_autotuned_kernels_tune_once_per_key_then_launch_the_chosen_configuration_directly():
    """``launch_tuned`` (both split kernels on CUDA): the autotuner runs on the first call of a key (its key values and
    the argument dtypes), later calls of that key launch the jitted kernel with the chosen options, another key tunes
    again, and ``tuned_choices`` reports each choice (what the benchmarks record)."""
    from types import SimpleNamespace

    from pikv_hf.kernels import decode

    calls = []

    def fake_split_kernel():  # the name tuned_choices reports
        pass

    class Tuner:  # triton.autotune's surface that launch_tuned uses
        keys = ["PAGE", "SPAN"]
        best_config = SimpleNamespace(all_kwargs=lambda: {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3})

        def __getitem__(self, grid):
            return lambda *a, **k: calls.append(("tuned", grid, k))

    class Jitted:
        fn = fake_split_kernel

        def __getitem__(self, grid):
            return lambda *a, **k: calls.append(("direct", grid, k))

    tuner = Tuner()
    tuner.fn = Jitted()
    x16, x32 = torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1)
    for args, span in (((x16, 3), 4096), ((x16, 5), 4096), ((x32, 3), 4096), ((x16, 3), 512)):
        decode.launch_tuned(tuner, (2, 1), args, {"PAGE": 16, "SPAN": span, "G": 4})
    assert [c[0] for c in calls] == ["tuned", "direct", "tuned", "tuned"]  # another dtype or span: tuned again
    assert calls[1] == ("direct", (2, 1), {"PAGE": 16, "SPAN": 4096, "G": 4, "BLOCK_N": 128, "num_warps": 8,
                                           "num_stages": 3})  # fmt: skip
    mine = [c for c in decode.tuned_choices() if c["kernel"] == "fake_split_kernel"]
    assert [c["key"] for c in mine] == [{"PAGE": "16", "SPAN": "4096"}] * 2 + [{"PAGE": "16", "SPAN": "512"}]
    assert mine[0]["config"] == {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
    for key in [k for k in decode._TUNED if k[0] is tuner]:  # leave the process's table as it was
        del decode._TUNED[key]


@pytest.mark.parametrize("quant", [False, True])
def test_autotuner_tries_only_the_measured_choices_where_a_gpu_run_measured_them(quant):
    """The split kernels' ``early_config_prune``: heads of <= 128 channels with 16-bit pages (or 4-bit codes dotted)
    try only the configurations an H200 run chose; wider heads (MLA) and codes dequantised by the 16-bit kernel try
    every configuration; every chosen configuration is one of the list (pruning never empties it)."""
    from pikv_hf.kernels import decode, decode_quant

    if quant:
        configs = decode.tuned_configs(decode_quant._Q4_CONFIGS, decode_quant._Q4_CAPPED)
        chosen = decode_quant._Q4_CHOSEN
    else:
        configs = decode.tuned_configs(decode._CONFIGS, decode._CAPPED)
        chosen = decode._CHOSEN
    prune = decode.prune_to_chosen(chosen)
    shape = {(c.kwargs["BLOCK_N"], c.num_warps, c.num_stages, c.maxnreg) for c in configs}
    assert chosen <= shape and len(shape) == len(configs)
    kept = prune(configs, {}, DK=128, DV=128, **({} if quant else {"BITS": 0}))
    assert {(c.kwargs["BLOCK_N"], c.num_warps, c.num_stages, c.maxnreg) for c in kept} == chosen
    assert len(kept) == len(chosen) < len(configs)
    assert prune(configs, {}, DK=576, DV=512, BITS=0) == configs
    if not quant:
        assert prune(configs, {}, DK=128, DV=128, BITS=4) == configs
