"""Operators of the 4-bit (and 2 / 8-bit) quantised pages: each a torch custom operator whose CUDA implementation is
one Triton kernel, tested here in the interpreter (``conftest.py`` sets ``TRITON_INTERPRET=1`` without a GPU) against
its torch reference, through ``torch.library.opcheck`` (schema, fake implementation) and by counting what an eager
read of a quantised tier dispatches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pikv_hf.codecs.quant import QuantCodec
from pikv_hf.kernels import dequant
from pikv_hf.kernels.decode_quant import dequantize_pages, quantize_pages

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
    got_k, got_v = dequant._launch(*quant.fields(), bits, dtype)  # the Triton kernel (interpreted on the CPU)
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
    wide = torch.zeros(4, 8, 16, dtype=torch.uint8)
    wide[..., ::2] = quant.kq
    strided = dequant.QuantPages(wide[..., ::2], *quant.fields()[1:], bits=4)
    assert not strided.kq.is_contiguous()
    assert torch.equal(dequant._launch(*strided.fields(), 4, torch.float32)[0], dequantize_pages(quant)[0])
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
