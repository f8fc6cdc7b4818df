"""Two attention partials merged by log-sum-exp in one operator, ``torch.ops.pikv.merge_partials``: the merge of a
layer's hot store with its tier (and of a partial with the attention sinks).

``(o1, lse1)`` and ``(o2, lse2)`` (``o = softmax(s) v`` and ``lse = logsumexp(s)`` of two sets of keys) merge
exactly to ``lse = logaddexp(lse1, lse2)``, ``o = exp(lse1 - lse) o1 + exp(lse2 - lse) o2``; a row with no key in
either (``lse = -inf`` in both) gets ``o = 0``, ``lse = -inf``. In torch that is nine small operators, each a launch
on a GPU; on CUDA the operator is one Triton kernel (program: a block of rows, every output channel). On the CPU it
runs the torch reference :func:`pikv_hf.attention.merge.merge_two_reference`, and a fake implementation gives
shapes for tracing.
"""

from __future__ import annotations

import torch

from pikv_hf.attention.merge import merge_two_reference
from pikv_hf.kernels._host import cdiv, next_power_of_2
from pikv_hf.kernels._triton import check_launchable, eager_direct, jit, tl

_BLOCK_R = 16  # rows per program


@jit
def _merge_kernel(
    o1_ptr, lse1_ptr, o2_ptr, lse2_ptr, o_ptr, lse_ptr, R, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    r_ok = r < R
    a = tl.load(lse1_ptr + r, mask=r_ok, other=float("-inf"))
    b = tl.load(lse2_ptr + r, mask=r_ok, other=float("-inf"))
    hi = tl.maximum(a, b)
    none = hi == float("-inf")
    hi0 = tl.where(none, 0.0, hi)
    lse = tl.where(none, float("-inf"), hi0 + tl.log(1.0 + tl.exp(tl.minimum(a, b) - hi0)))
    m = tl.where(none, 0.0, lse)
    w1 = tl.exp(a - m)
    w2 = tl.exp(b - m)
    at = r[:, None].to(tl.int64) * D + d[None, :]
    ok = r_ok[:, None] & (d < D)[None, :]
    o1 = tl.load(o1_ptr + at, mask=ok, other=0.0)
    o2 = tl.load(o2_ptr + at, mask=ok, other=0.0)
    tl.store(o_ptr + at, w1[:, None] * o1 + w2[:, None] * o2, mask=ok)
    tl.store(lse_ptr + r, lse, mask=r_ok)


def _launch(o1, lse1, o2, lse2):
    d = o1.shape[-1]
    o = torch.empty_like(o1, memory_format=torch.contiguous_format)
    lse = torch.empty_like(lse1, memory_format=torch.contiguous_format)
    rows = lse.numel()
    if rows and d:
        check_launchable(_merge_kernel, o.device)
        _merge_kernel[(cdiv(rows, _BLOCK_R),)](
            o1.contiguous(), lse1.contiguous(), o2.contiguous(), lse2.contiguous(), o, lse, rows, d,
            BLOCK_R=_BLOCK_R, BLOCK_D=next_power_of_2(d),
        )  # fmt: skip
    return o, lse


merge_two = torch.library.custom_op(
    "pikv::merge_partials", _launch, mutates_args=(), device_types="cuda",
    schema="(Tensor o1, Tensor lse1, Tensor o2, Tensor lse2) -> (Tensor, Tensor)",
)  # fmt: skip
merge_two.__doc__ = """``torch.ops.pikv.merge_partials(o1, lse1, o2, lse2)``: float32 ``o [..., R, Dv]`` of equal
shapes and ``lse [..., R]`` -> the merged ``(o, lse)`` (module docstring). No argument is checked here: call
:func:`pikv_hf.attention.merge.merge_partials`."""


@merge_two.register_kernel("cpu")
def _merge_cpu(*args):
    return merge_two_reference(*args)


merge_two_eager = eager_direct(merge_two, _launch, _merge_cpu)  # what library code calls


@merge_two.register_fake
def _merge_fake(o1, lse1, o2, lse2):
    return torch.empty_like(o1, memory_format=torch.contiguous_format), torch.empty_like(
        lse1, memory_format=torch.contiguous_format
    )
