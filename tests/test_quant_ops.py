"""Operators of the 4-bit (and 2 / 8-bit) quantised pages: each a torch custom operator whose CUDA implementation is
one Triton kernel, tested here in the interpreter (``conftest.py`` sets ``TRITON_INTERPRET=1`` without a GPU) against
its torch reference, through ``torch.library.opcheck`` (schema, fake implementation) and by counting what an eager
read of a quantised tier dispatches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import KERNEL_DEVICE, on_kernel_device, run_without_interpreter
from test_kernels import N_SINK, WINDOW, _assert_close, _case
from torch._dynamo.backends.debugging import aot_eager

from pikv_hf import PiKVCache
from pikv_hf.codecs.quant import QuantCodec
from pikv_hf.kernels import dequant
from pikv_hf.kernels._triton import jit, tl
from pikv_hf.kernels.decode import _exact_float, _reference_slots, decode_attention_reference
from pikv_hf.kernels.decode_quant import (
    _dot_codes,
    decode_attention_quant,
    dequantize_pages,
    q4_fits,
    quantize_pages,
)
from pikv_hf.presses import QuantPress
from pikv_hf.tiny import tiny_model

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))
import count_ops  # noqa: E402


def _pages(n, p, dk, dv, bits, group, scale_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(n, p, dk, generator=gen) * 3
    values = torch.randn(n, p, dv, generator=gen)
    valid = torch.rand(n, p, generator=gen) > 0.2
    return quantize_pages(keys, values, bits, group, valid, scale_dtype)


@pytest.mark.parametrize(
    "bits, n, p, dk, dv, group, scale_dtype, dtype",
    [
        (4, 5, 64, 64, 64, 64, torch.float16, torch.float32),
        (4, 3, 20, 128, 64, 16, torch.float32, torch.bfloat16),  # a partial block of slots, Dk != Dv
        (2, 4, 16, 32, 32, 8, torch.float16, torch.float16),
        (8, 2, 4, 24, 24, 12, torch.float32, torch.float32),  # head dims that are no power of two
    ],
)
def test_dequant_kernel_equals_the_torch_reference(bits, n, p, dk, dv, group, scale_dtype, dtype):
    quant = _pages(n, p, dk, dv, bits, group, scale_dtype)
    keys, values = dequantize_pages(quant)
    got_k, got_v = dequant._launch(*on_kernel_device(quant.fields()), bits, dtype)  # the kernel (CPU: interpreted)
    got_k, got_v = got_k.cpu(), got_v.cpu()
    assert got_k.dtype == got_v.dtype == dtype
    assert got_k.shape == (n, p, dk) and got_v.shape == (n, p, dv)
    # one rounding of the output dtype apart at most: float32 ``code * scale + zero`` may be fused (fma) on one side;
    # the interpreter also rounds float32 to bfloat16 toward zero (CUDA: to nearest even)
    ulp = {torch.float32: 2**-22, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    torch.testing.assert_close(got_k, keys.to(dtype), rtol=ulp, atol=1e-6)
    torch.testing.assert_close(got_v, values.to(dtype), rtol=ulp, atol=1e-6)
    op_k, op_v = torch.ops.pikv.dequant_pages(*quant.fields(), bits, dtype)  # CPU: the reference
    assert torch.equal(op_k, keys.to(dtype)) and torch.equal(op_v, values.to(dtype))


def test_dequant_operator_passes_opcheck_and_accepts_strided_fields():
    quant = _pages(4, 8, 16, 16, 4, 8, torch.float16)
    torch.library.opcheck(torch.ops.pikv.dequant_pages, (*quant.fields(), 4, torch.float32))
    wide = torch.zeros(4, 8, 16, dtype=torch.uint8, device=KERNEL_DEVICE)
    wide[..., ::2] = quant.kq.to(KERNEL_DEVICE)
    strided = dequant.QuantPages(wide[..., ::2], *on_kernel_device(quant.fields()[1:]), bits=4)
    assert not strided.kq.is_contiguous()
    assert torch.equal(dequant._launch(*strided.fields(), 4, torch.float32)[0].cpu(), dequantize_pages(quant)[0])
    with pytest.raises(ValueError, match="bits must be one of"):
        dequant.dequantize(dequant.QuantPages(*quant.fields(), bits=3))


def test_an_eager_read_of_a_quantised_tier_dispatches_one_operator():
    codec = QuantCodec(4, 16)
    specs = codec.fields(32, 32, torch.float32)
    quant = _pages(6, 8, 32, 32, 4, 16, torch.float16)
    fields = {name: getattr(quant, name).reshape(2, 3, -1, *specs[name].shape) for name in specs}
    with count_ops.OpCounter() as counter:
        keys, values = codec.decode(fields)
    assert dict(counter.counts) == {"dequant_pages": 1}
    want_k, want_v = dequantize_pages(quant)
    assert torch.equal(keys, want_k.reshape(2, 3, 8, 32)) and torch.equal(values, want_v.reshape(2, 3, 8, 32))


# ---------------------------------------------------------------------------------------------- 4-bit decode kernel
def _quant_case(gqa, dk, dv, page, dtype, group, q=1, seed=0):
    """A decode case of ``test_kernels`` whose pages hold 4-bit codes, and its dense side as the pages decode."""
    case = _case(gqa, dk, dv, page, dtype, q=q, seed=seed)
    quant = quantize_pages(case.keys, case.values, 4, group=group, valid=case.valid, scale_dtype=torch.float16)
    keys, values = dequantize_pages(quant)
    return case, quant, keys.to(dtype), values.to(dtype)


@pytest.mark.parametrize(
    "dtype, page, gqa, dims, group, tol",
    [
        (torch.float32, 64, 4, (128, 128), 64, 1e-5),  # tiles inside one page: scales folded into the query
        (torch.float32, 16, 8, (64, 64), 64, 1e-5),  # tiles over several pages, one value group
        (torch.float16, 64, 1, (64, 128), 32, 2e-3),  # four value groups, Dk != Dv
        (torch.bfloat16, 32, 4, (128, 128), 64, 8e-3),  # float32 dots in the interpreter (see decode._dot_dtype)
    ],
)
def test_4bit_kernel_equals_the_reference_on_decoded_pages_exact_and_sparse(dtype, page, gqa, dims, group, tol):
    """The 4-bit kernel dots codes in even / odd channel halves with the scales moved out of the tile; its result
    equals attention over the decoded pages (``decode_attention_reference``), for an exact and a sparse plan, and it
    is the operator that runs (one ``paged_decode_q4``)."""
    assert q4_fits(dims[0], dims[1], group)
    case, quant, keys, values = _quant_case(gqa, *dims, page, dtype, group)
    plan = dict(page_full=case.sparse_full, n_sink=N_SINK, window=WINDOW, row_start=case.row_start)
    for table, extra in ((case.table, {}), (case.sparse, plan)):
        args = (case.query, quant, case.pos, case.valid, table, case.qpos, dims[0] ** -0.5)
        with count_ops.OpCounter() as counter:
            got = decode_attention_quant(*args, num_splits=2, check=False, **extra)
        assert counter.counts["paged_decode_q4"] == 1 and "paged_decode" not in counter.counts
        want = decode_attention_reference(case.query, keys, values, *args[2:], **extra)
        _assert_close(got, want, tol)


@pytest.mark.parametrize("bits, group", [(4, 64), (2, 16)])
def test_quantised_runs_read_by_local_ids_and_without_a_table_equal_the_global_table(bits, group):
    """Quantised pages laid out as ``PageTable`` runs, as ``TritonBackend`` reads a 4-bit tier: the 4-bit kernel (and
    the generic kernel over 2-bit codes) reading the plan's local ids, or each run's first ``lengths`` pages with no
    table at all, give what the read through global ids gives, and the reference on the decoded pages."""
    from test_kernels import as_runs

    case = _case(4, 64, 64, 16, torch.float32, q=1, seed=3)
    quant = quantize_pages(case.keys, case.values, bits, group=group, valid=case.valid, scale_dtype=torch.float16)
    keys, values = dequantize_pages(quant)
    order, run_start, lengths, local, sparse = as_runs(case)
    runs = type(quant)(*(f[order] for f in quant.fields()), bits=bits)
    pos, valid = case.pos[order], case.valid[order]
    plan = dict(page_full=case.sparse_full, n_sink=N_SINK, window=WINDOW, row_start=case.row_start)
    n = case.table.shape[-1]
    op = "paged_decode_q4" if bits == 4 else "paged_decode"
    for table, local_table, extra in ((case.table, None, {}), (case.table, local, {}), (case.sparse, sparse, plan)):
        args = (case.query, quant, case.pos, case.valid, table, case.qpos, 0.125)
        want = decode_attention_reference(case.query, keys, values, *args[2:], **extra)
        by_ids = decode_attention_quant(*args, num_splits=2, **extra)
        extra = extra | (dict(lengths=lengths, width=n) if local_table is None else {})
        with count_ops.OpCounter() as counter:
            got = decode_attention_quant(case.query, runs, pos, valid, local_table, case.qpos, 0.125, num_splits=2,
                                         check=False, run_start=run_start, **extra)  # fmt: skip
        assert counter.counts[op] == 1 and sum(counter.counts.values()) == 1  # no table built on the host
        _assert_close(got, by_ids, 1e-5)
        _assert_close(got, want, 1e-5)


def test_4bit_kernel_rows_splits_sliding_window_sinks_lengths_and_attended():
    """q = 3 tokens x 8 query heads (24 rows), 1 or 3 splits, a sliding window, GPT-OSS sinks, shortened table rows,
    the slots the last query attends, and a row that reads nothing (zero output, the sink alone)."""
    case, quant, keys, values = _quant_case(8, 64, 64, 16, torch.float32, 32, q=3, seed=1)
    sinks = torch.randn(case.query.shape[1], generator=torch.Generator().manual_seed(2)).to(KERNEL_DEVICE)
    lengths = (case.table >= 0).sum(-1)
    lengths[0, 1] -= 2
    table = case.table.clone()
    table[2] = -1
    args = (case.query, quant, case.pos, case.valid, table, case.qpos, 0.125)
    extra = dict(sliding_window=50, sinks=sinks, lengths=lengths)
    *one, attended = decode_attention_quant(*args, num_splits=1, count=True, **extra)
    three = decode_attention_quant(*args, num_splits=3, **extra)
    _assert_close(one, three, 1e-5)
    _assert_close(one, decode_attention_reference(case.query, keys, values, *args[2:], **extra), 1e-5)
    assert torch.equal(one[0][2], torch.zeros_like(one[0][2]))  # row 2 reads nothing: the sink alone
    assert torch.equal(one[1][2], sinks.view(-1, 1).expand(-1, 3))
    ok, pos = _reference_slots(case.pos, case.valid, table, case.qpos, None, 0, 0, None, lengths)
    assert torch.equal(attended, (ok & (case.qpos[-1] - pos < 50) & (pos <= case.qpos[-1])).sum(-1))


def test_4bit_kernel_takes_only_the_shapes_it_is_built_for():
    """Head dims that are no powers of two or under 64 (keys) / 32 (values), value groups under 32 channels or more
    than four groups per head go through ``decode.py``'s kernel (``paged_decode`` with ``bits = 4``), with the same
    result."""
    assert q4_fits(128, 128, 32) and q4_fits(64, 64, 64) and q4_fits(64, 32, 32) and q4_fits(256, 128, 128)
    assert not q4_fits(96, 96, 32) and not q4_fits(128, 128, 16) and not q4_fits(32, 64, 32)
    assert not q4_fits(64, 64, 48) and not q4_fits(64, 256, 32)
    case, quant, keys, values = _quant_case(4, 64, 64, 16, torch.float32, 8)  # eight groups: the generic kernel
    args = (case.query, quant, case.pos, case.valid, case.table, case.qpos, 0.125)
    with count_ops.OpCounter() as counter:
        got = decode_attention_quant(*args, check=False)
    assert counter.counts["paged_decode"] == 1 and "paged_decode_q4" not in counter.counts
    _assert_close(got, decode_attention_reference(case.query, keys, values, *args[2:]), 1e-5)


def test_4bit_operator_on_the_cpu_without_the_interpreter_runs_the_reference(monkeypatch):
    """Without ``TRITON_INTERPRET`` (a CPU step traced or counted with the Triton backend selected) the operator's CPU
    implementation is the torch reference on the decoded pages, for global ids and for local ids of the runs."""
    from pikv_hf.kernels import decode_quant

    monkeypatch.setattr(decode_quant, "interpreted", lambda kernel: False)
    case, quant, keys, values = _quant_case(4, 64, 64, 16, torch.float32, 64)
    fields = tuple(t.cpu() for t in (quant.kq, quant.vq, quant.k_scale, quant.k_zero, quant.v_scale, quant.v_zero))
    table, pos, valid, qpos = case.table.cpu(), case.pos.cpu(), case.valid.cpu(), case.qpos.cpu()
    want = decode_attention_reference(case.query.cpu(), keys.cpu(), values.cpu(), pos, valid, table, qpos, 0.125)
    rest = (None, None, None, None, 0.125, 0, 0, 0, 64, 1)
    query = case.query.cpu()
    o, lse, attended = torch.ops.pikv.paged_decode_q4(query, *fields, pos, valid, table, qpos, *rest, None, 0)
    _assert_close((o, lse), want, 1e-5)
    assert torch.equal(attended, case.stored.sum(-1))
    start = torch.zeros(table.shape[:2], dtype=torch.int64)  # runs starting at page 0: local ids are the global ones
    local = torch.ops.pikv.paged_decode_q4(query, *fields, pos, valid, table, qpos, *rest, start, 0)
    _assert_close(local[:2], want, 1e-5)



@jit
def _codes_kernel(x_ptr, lo_ptr, hi_ptr, N: tl.constexpr, DOT_DTYPE: tl.constexpr):
    i = tl.arange(0, N)
    byte = tl.load(x_ptr + i)
    if DOT_DTYPE == tl.float32:  # the dequantising kernels' float32 codes
        lo, hi = _exact_float(byte & 15), _exact_float(byte >> 4)
    else:  # the 4-bit kernel's dot operands
        lo, hi = _dot_codes(byte & 15, DOT_DTYPE), _dot_codes(byte >> 4, DOT_DTYPE)
    tl.store(lo_ptr + i, lo.to(tl.float32))
    tl.store(hi_ptr + i, hi.to(tl.float32))


@pytest.mark.parametrize("dot_dtype", ["float32", "float16"])
def test_codes_built_from_bits_equal_their_integers(dot_dtype):
    """The kernels make 4-bit codes floats from bits (``decode._exact_float``, ``decode_quant._dot_codes``), not
    with an integer-to-float conversion: both nibbles of every byte must come out as their integers, exactly.
    (``_dot_codes``' bfloat16 case, the same construction on ``0x4300``, runs on CUDA only, in the 4-bit kernel's
    bfloat16 test: the interpreter's bfloat16 arithmetic is wrong in triton 3.9, see ``decode._dot_dtype``.)"""
    byte = torch.arange(256, dtype=torch.uint8, device=KERNEL_DEVICE)
    lo, hi = (torch.full((256,), -1.0, device=KERNEL_DEVICE) for _ in range(2))
    _codes_kernel[(1,)](byte, lo, hi, N=256, DOT_DTYPE=getattr(tl, dot_dtype))
    assert torch.equal(lo, (byte & 15).float()) and torch.equal(hi, (byte >> 4).float())

def test_4bit_operator_passes_opcheck():
    case, quant, _, _ = _quant_case(4, 64, 64, 16, torch.float32, 64)
    args = (case.query, quant.kq, quant.vq, quant.k_scale, quant.k_zero, quant.v_scale, quant.v_zero, case.pos,
            case.valid, case.table, case.qpos, None, None, None, None, 0.125, 0, 0, 0, 64, 1, None, 0)  # fmt: skip
    torch.library.opcheck(torch.ops.pikv.paged_decode_q4, args, test_utils=("test_schema", "test_faketensor"))


_COMPILE_SM90 = """
import triton.language as tl
from sm90 import compile_sm90, cuobjdump, registers
from pikv_hf.kernels import decode, decode_quant, dequant

for page, block_n, group in ((64, 64, 64), (16, 128, 128), (128, 64, 32)):
    const = dict(G=4, Q=1, PAGE=page, DK=128, DV=128, BLOCK_R=16, HAS_LEN=True, HAS_FULL=True, HAS_SLIDING=True,
                 DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32", GROUP=group, TABLE=1, SPAN=4096, BLOCK_N=block_n)
    k = compile_sm90(decode_quant._split_q4_kernel, const, num_warps=4, num_stages=3)
    print(f"q4-{page}", k.metadata.shared)
    print(f"i2f-q4-{page}", cuobjdump(k, "-sass").count("I2F"))
    if page == 64:  # the autotuner's configurations capped in registers
        for block_n, warps, stages in decode_quant._Q4_CAPPED:
            k = compile_sm90(decode_quant._split_q4_kernel, const | dict(BLOCK_N=block_n), num_warps=warps,
                             num_stages=stages, maxnreg=decode._REG_CAP)
            print(f"capped-{warps}", registers(k)[0])
const = dict(P=64, DK=128, DV=128, BITS=4, GROUP=64, BLOCK_P=16, BLOCK_BK=64, BLOCK_BV=64)
k = compile_sm90(dequant._dequant_kernel, const, num_warps=4, num_stages=3)
print("dequant", k.metadata.shared)
print("i2f-dequant", cuobjdump(k, "-sass").count("I2F"))
"""


def test_4bit_kernels_compile_for_sm90_without_a_gpu():
    """The CUDA front end compiles what the interpreter does not check (dot shapes and dtypes, layouts of the
    nibble halves): the 4-bit decode kernel (a tile in one page and over several pages, one to four value groups)
    and the dequantisation kernel must compile for sm_90 with bfloat16 dots, in a subprocess without
    ``TRITON_INTERPRET``, with no integer-to-float conversion per code; so must the autotuner's register-capped
    configurations of the 4-bit kernel, within their cap."""
    built = dict(line.split() for line in run_without_interpreter(_COMPILE_SM90).split("\n") if line)
    capped = {k: int(built.pop(k)) for k in list(built) if k.startswith("capped-")}
    # codes become floats from bits (decode._exact_float): the few integer-to-float conversions left are the tile's
    # counts and positions, not one per code (132 to 260 per kernel before)
    conversions = {k: int(built.pop(k)) for k in list(built) if k.startswith("i2f-")}
    assert len(conversions) == 4 and max(conversions.values()) <= 4, conversions
    assert sorted(capped) == ["capped-4", "capped-8"] and max(capped.values()) <= 128  # maxnreg holds
    assert sorted(built) == ["dequant", "q4-128", "q4-16", "q4-64"]
    assert all(int(built[name]) > 0 for name in ("q4-128", "q4-16", "q4-64"))  # the dots stage tiles in shared memory


def test_a_compiled_step_over_a_4bit_tier_calls_the_4bit_operator_in_one_graph_and_equals_eager():
    """Triton backend (kernels interpreted on CPU), head dim 64 and value groups of 32: the compressed tier of every
    layer is read by ``paged_decode_q4`` inside one ``fullgraph`` graph (the hot store by ``paged_decode``), and the
    compiled step equals the eager one."""
    model = tiny_model("llama", seed=0, head_dim=64)
    cache = PiKVCache(model, max_cache_len=48, attention_backend="triton", page_size=8)
    graphs = []

    def count_graphs(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    with torch.no_grad():
        with QuantPress(bits=4, group_size=32, key_group_size=16, window=4)(model):
            model(torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(0)), past_key_values=cache)
        assert cache.layers[0].tiers["compressed"].tokens_per_shard().sum() > 0
        reference = cache.fork()
        torch._dynamo.reset()
        step = torch.compile(
            lambda t, pos: model(t, past_key_values=cache, cache_position=pos).logits, backend=count_graphs,
            fullgraph=True,
        )  # fmt: skip
        token, pos = torch.tensor([[7]]), torch.tensor([40])
        got = step(token, pos)
        want = model(token, past_key_values=reference, cache_position=pos).logits
    assert (got - want).abs().max() < 1e-5
    targets = [n.target for n in graphs[0].graph.nodes]
    assert len(graphs) == 1 and targets.count(torch.ops.pikv.paged_decode_q4.default) == len(cache.layers)
