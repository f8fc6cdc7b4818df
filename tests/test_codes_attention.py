"""A decode token's attention over quantised pages read as codes (``pikv_hf.attention.codes.quant_decode``, the CPU
read of a QuantPress tier) against the pages decoded (``dequantize_pages``) and attended in float64."""

from __future__ import annotations

import pytest
import torch

from pikv_hf.attention.codes import quant_decode
from pikv_hf.kernels.decode_quant import dequantize_pages, quantize_pages


def _pages(bits: int, group: int, b: int, h: int, n: int, p: int, d: int, seed: int):
    """``n`` quantised pages of ``p`` slots per (row, head) as frame fields (``[B, H, C, ...]`` / ``[B, H, n, ...]``)
    and the decoded ``[B, H, C, D]`` keys and values."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b * h * n, p, d, generator=g) * torch.linspace(0.2, 3.0, d)  # channels of different ranges
    values = torch.randn(b * h * n, p, d, generator=g)
    quant = quantize_pages(keys, values, bits, group, torch.ones(b * h * n, p, dtype=torch.bool), torch.float16)
    fields = {
        "kq": quant.kq.view(b, h, n * p, -1),
        "k_scale": quant.k_scale.view(b, h, n, d),
        "k_zero": quant.k_zero.view(b, h, n, d),
        "vq": quant.vq.view(b, h, n * p, -1),
        "v_scale": quant.v_scale.view(b, h, n * p, -1),
        "v_zero": quant.v_zero.view(b, h, n * p, -1),
    }
    dk, dv = dequantize_pages(quant)
    return fields, dk.view(b, h, n * p, d), dv.view(b, h, n * p, d)


def _reference(query, keys, values, bias, scale):
    """Softmax attention in float64, the query heads of a KV head reading its slots: ``o`` and ``lse``."""
    b, hq, _, d = query.shape
    h = keys.shape[1]
    qg = query.double().reshape(b, h, hq // h, d)
    s = (qg @ keys.double().transpose(-1, -2)) * scale + bias.double().unsqueeze(2)
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1).nan_to_num(0.0) @ values.double()
    return o.reshape(b, hq, 1, d), lse.reshape(b, hq, 1)


@pytest.mark.parametrize("scratch", [False, True], ids=["allocated", "scratch"])
@pytest.mark.parametrize("bits, group, p", [(4, 64, 64), (4, 16, 16), (2, 32, 8), (8, 64, 32), (4, 32, 1)])
def test_codes_read_equals_decoded_pages_attended_in_float64(bits, group, p, scratch):
    """Each code field converted into fresh tensors or into workspace buffers (larger than one field, holding stale
    values) reads the same."""
    b, h, g, d, n = 2, 3, 3, 64, 6
    fields, keys, values = _pages(bits, group, b, h, n, p, d, seed=bits * 100 + group + p)
    query = torch.randn(b, h * g, 1, d, generator=torch.Generator().manual_seed(1))
    bias = torch.zeros(b, h, n * p)
    bias[0, 1, ::3] = float("-inf")  # some slots masked (padding, outside a plan)
    bias[1, 2] = float("-inf")  # a (row, head) with nothing to read
    buffers = None
    if scratch:
        size = fields["kq"].numel() + 7
        buffers = torch.full((size,), 255, dtype=torch.uint8), torch.full((size,), float("nan"))
    o, lse = quant_decode(query, fields, bias, d**-0.5, bits, buffers)
    want_o, want_lse = _reference(query, keys, values, bias, d**-0.5)
    assert o.dtype == lse.dtype == torch.float32 and o.shape == want_o.shape and lse.shape == want_lse.shape
    torch.testing.assert_close(o.double(), want_o, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    empty = slice(2 * g, 3 * g)
    assert torch.isneginf(lse[1, empty]).all() and (o[1, empty] == 0).all()


def test_quant_press_decode_reads_codes_and_matches_the_decoded_read(monkeypatch):
    """A QuantPress cache's CPU decode goes through the codes read, and its logits equal those of the same cache read
    by decoding the pages first (the path before it), within float32 rounding."""
    from helpers import prompt

    from pikv_hf import PiKVCache
    from pikv_hf.attention import codes
    from pikv_hf.codecs.quant import QuantCodec
    from pikv_hf.presses import QuantPress
    from pikv_hf.tiny import tiny_model

    model = tiny_model("llama", seed=0)
    ids = prompt(80, batch=2, seed=7)

    def decode(codes_read: bool) -> tuple[torch.Tensor, int]:
        calls = [0]
        real = codes.quant_decode

        def counted(*args):
            calls[0] += 1
            return real(*args)

        monkeypatch.setattr("pikv_hf.attention.backend.quant_decode", counted)
        monkeypatch.setattr(QuantCodec, "code_bits", property(lambda self: self.bits if codes_read else None),
                            raising=False)  # fmt: skip
        cache = PiKVCache(model, page_size=16)
        with torch.no_grad(), QuantPress(bits=4, group_size=16, window=8)(model):
            out = model(ids, past_key_values=cache, logits_to_keep=1)
        logits = []
        with torch.no_grad():
            for _ in range(3):
                out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache)
                logits.append(out.logits)
        return torch.cat(logits, 1), calls[0]

    got, reads = decode(True)
    want, none = decode(False)
    assert reads >= 3 * model.config.num_hidden_layers and none == 0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_operator_registration_and_one_count_under_a_dispatch_mode():
    """``torch.ops.pikv.quant_decode``: schema and fake implementation (``opcheck``); a dispatch mode sees one
    operator (``benchmarks/count_ops.py`` counts the read as the one kernel it is on a GPU), eager code gets the same
    numbers without it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from pikv_hf.attention.codes import quant_decode_op

    fields, _, _ = _pages(4, 32, 1, 2, 3, 16, 64, seed=5)
    query = torch.randn(1, 4, 1, 64, generator=torch.Generator().manual_seed(2))
    bias = torch.zeros(1, 2, 48)
    names = ("kq", "k_scale", "k_zero", "vq", "v_scale", "v_zero")
    args = (query, *(fields[n] for n in names), bias, 0.125, 4)
    torch.library.opcheck(quant_decode_op, args, test_utils=("test_schema", "test_faketensor"))

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.name())
            return func(*args, **(kwargs or {}))

    with Seen() as seen:
        counted = quant_decode(query, fields, bias, 0.125, 4)
    assert seen.ops == ["pikv::quant_decode"]
    for got, want in zip(counted, quant_decode(query, fields, bias, 0.125, 4), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
