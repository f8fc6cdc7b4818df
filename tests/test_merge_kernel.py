"""``torch.ops.pikv.merge_partials`` (``pikv_hf.kernels.merge``): the Triton kernel, run interpreted on the CPU
(``conftest.py`` sets ``TRITON_INTERPRET=1`` without a GPU), against the torch reference the operator runs on the
CPU, which is checked against softmax attention over the union of both partials' keys."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import on_kernel_device, run_without_interpreter

from pikv_hf.attention.merge import merge_partials, merge_two_reference
from pikv_hf.kernels import merge
from pikv_hf.kernels._triton import interpreted

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreted(merge._merge_kernel)),
    reason="needs a GPU or TRITON_INTERPRET=1",
)


def _partials(b=2, hq=6, q=1, d=40, n1=7, n2=5, seed=0):
    """Two partials of softmax attention over two key sets (per row, some keys masked out; one row with no key in
    the first set, one with no key in either), and the attention over both sets."""
    gen = torch.Generator().manual_seed(seed)
    s1, s2 = torch.randn(b, hq, q, n1, generator=gen) * 3, torch.randn(b, hq, q, n2, generator=gen) * 3
    v1, v2 = torch.randn(b, hq, n1, d, generator=gen), torch.randn(b, hq, n2, d, generator=gen)
    s1[0, -1] = -math.inf
    s1[-1, 0], s2[-1, 0] = -math.inf, -math.inf
    parts = []
    for s, v in ((s1, v1), (s2, v2)):
        lse = torch.logsumexp(s, -1)
        o = torch.nan_to_num(torch.softmax(s, -1)) @ v
        parts.append((o, lse))
    both = torch.cat([s1, s2], -1)
    want = torch.nan_to_num(torch.softmax(both, -1)) @ torch.cat([v1, v2], 2)
    return parts, want, torch.logsumexp(both, -1)


def test_reference_is_attention_over_both_key_sets():
    parts, want, want_lse = _partials()
    o, lse = merge_two_reference(*parts[0], *parts[1])
    torch.testing.assert_close(o, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse)) and torch.isneginf(lse).sum() == 1
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[fin], want_lse[fin])
    assert torch.equal(o[-1, 0], torch.zeros_like(o[-1, 0]))  # no key in either: o = 0


@pytest.mark.parametrize("shape", [dict(), dict(b=1, hq=3, q=4, d=64), dict(b=3, hq=2, d=5)])
def test_kernel_equals_reference(shape):
    parts, _, _ = _partials(**shape)
    want_o, want_lse = merge_two_reference(*parts[0], *parts[1])
    got_o, got_lse = (t.cpu() for t in merge._launch(*on_kernel_device((*parts[0], *parts[1]))))
    torch.testing.assert_close(got_o, want_o, rtol=1e-6, atol=1e-6)
    assert torch.equal(torch.isneginf(got_lse), torch.isneginf(want_lse))
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(got_lse[fin], want_lse[fin], rtol=1e-6, atol=1e-6)


def test_merge_partials_dispatches_one_operator_equal_to_the_reference():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Names(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    parts, _, _ = _partials()
    with Names() as seen:
        o, lse = merge_partials(parts)
    assert seen.names == ["merge_partials"]
    want_o, want_lse = merge_two_reference(*parts[0], *parts[1])
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)  # the CPU implementation is the reference
    # a broadcast sink partial and a partial that needs gradients take the torch code
    sink = (torch.zeros(1, 6, 1, 40), torch.zeros(6, 1))
    torch.testing.assert_close(merge_partials([parts[0], sink])[0], merge_two_reference(*parts[0], *sink)[0])
    torch.library.opcheck(torch.ops.pikv.merge_partials.default, (*parts[0], *parts[1]))
    compiled = torch.compile(lambda *a: torch.ops.pikv.merge_partials(*a), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*parts[0], *parts[1]), (want_o, want_lse))


_COMPILE_SM90 = """
from sm90 import compile_sm90, registers
from pikv_hf.kernels import merge, quest

cases = [(merge._merge_kernel, dict(BLOCK_R=16, BLOCK_D=128), 4)]
cases += [(quest._group_kernel, dict(NS=ns, BLOCK=512), 4) for ns in (2, 4)]
cases.append((quest._select_kernel, dict(BLOCK=2048), 4))
cases.append((quest._scores_kernel, dict(G=4, D=128, P=16, BLOCK_W=quest._BLOCK_W, BLOCK_D=128, BLOCK_P=16,
                                         BLOCK_S=128), quest._SCORES_WARPS))
for kernel, const, warps in cases:
    compiled = compile_sm90(kernel, const, num_warps=warps, num_stages=2)
    print(compiled.name, *registers(compiled))
"""


def test_kernels_compile_for_sm90_without_a_gpu():
    """The CUDA front end types what the interpreter does not check: the merge kernel, Quest's group selection
    kernel (two and four stores), its selection of one store (2048 pages) and its score kernel (an 8B model's shape:
    4 query rows per KV head, head dim 128, pages of 16, 68 sink and window entries) compile for sm_90 in a
    subprocess without ``TRITON_INTERPRET``. The score kernel, launched with ``_SCORES_WARPS`` warps, holds at most
    128 registers a thread without spilling (16 warps per SM; with 4 warps its key min / max tiles took 254, 8 warps
    per SM)."""
    built = [line.split() for line in run_without_interpreter(_COMPILE_SM90).splitlines()]
    assert [name for name, _, _ in built] == [
        "_merge_kernel", "_group_kernel", "_group_kernel", "_select_kernel", "_scores_kernel"
    ]
    _, regs, stack = built[-1]
    assert int(regs) <= 128 and int(stack) == 0, f"quest scores: {regs} registers, {stack} bytes of stack a thread"
