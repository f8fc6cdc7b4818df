"""The plan of a routed read as one kernel: the frame pages of the selected shards and the always-read (sink /
recent) pages, compacted to the front of each (row, KV head)'s plan.

Program ``b * H + h`` walks the frame in blocks: a page is *full* when its shard is selected, *needed* when full
or special; a block's needed pages go to ``carry + prefix sum - 1`` (the prefix sum within the block, ``carry`` the
needed pages of the blocks before), then the rest of the plan is ``-1``. Output ``pages`` (``[B, H, W]`` local page
indices, ``-1`` padded, as ``pikv_hf.read.plan.compact``) and ``page_full`` (``[B, H, W]`` bool, True for a
selected shard's page). The operator is ``torch.ops.pikv.routed_plan`` (the torch reference on the CPU, a fake
implementation for tracing); it reads no value back to the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pikv_hf.kernels._triton import check_launchable, jit, tl
from pikv_hf.read.plan import compact

_BLOCK_W = 256  # frame pages per step


@jit
def _routed_plan_kernel(chosen_ptr, shard_ptr, special_ptr, pages_ptr, full_ptr, S, W, BLOCK_W: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    carry = tl.sum(tl.zeros([BLOCK_W], tl.int32), 0)
    for w0 in range(0, W, BLOCK_W):
        ws = w0 + tl.arange(0, BLOCK_W)
        w_ok = ws < W
        shard = tl.load(shard_ptr + r * W + ws, mask=w_ok, other=-1).to(tl.int64)
        full = tl.load(chosen_ptr + r * S + shard, mask=w_ok & (shard >= 0), other=0) != 0
        need = (full | (tl.load(special_ptr + r * W + ws, mask=w_ok, other=0) != 0)) & w_ok
        at = carry + tl.cumsum(need.to(tl.int32), 0) - 1
        tl.store(pages_ptr + r * W + at, ws.to(tl.int64), mask=need)
        tl.store(full_ptr + r * W + at, full.to(tl.uint8), mask=need)
        carry += tl.sum(need.to(tl.int32), 0)
    for w0 in range(0, W, BLOCK_W):
        ws = w0 + tl.arange(0, BLOCK_W)
        rest = (ws >= carry) & (ws < W)
        tl.store(pages_ptr + r * W + ws, tl.full([BLOCK_W], -1, tl.int64), mask=rest)
        tl.store(full_ptr + r * W + ws, tl.zeros([BLOCK_W], tl.uint8), mask=rest)


def routed_plan_reference(
    chosen: torch.Tensor, shard: torch.Tensor, special: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of ``torch.ops.pikv.routed_plan``.

    Parameters
    ----------
    chosen : torch.Tensor
        ``[B, H, S]`` bool, the selected shards.
    shard : torch.Tensor
        ``[B, H, W]`` integer shard of every frame page (``-1``: unused page).
    special : torch.Tensor
        ``[B, H, W]`` bool, pages always read (sinks, recent window).

    Returns
    -------
    tuple of torch.Tensor
        ``pages`` ``[B, H, W]`` int64 local indices of the needed pages in frame order, ``-1`` padded, and
        ``page_full`` ``[B, H, W]`` bool, True for the entries that are pages of a selected shard.
    """
    s = chosen.shape[-1]
    full = F.pad(chosen, (0, 1)).gather(2, shard.long() % (s + 1))  # an unused page (-1) reads column S: False
    pages = compact(full | special, shard.shape[-1])
    return pages, full.gather(2, pages.clamp(min=0)) & (pages >= 0)


def _launch(chosen: torch.Tensor, shard: torch.Tensor, special: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel (the operator's CUDA implementation; also CPU under ``TRITON_INTERPRET``)."""
    b, h, w = shard.shape
    dev = shard.device
    pages = torch.empty(b, h, w, dtype=torch.int64, device=dev)
    full = torch.empty(b, h, w, dtype=torch.bool, device=dev)
    if b * h * w == 0:
        return pages, full
    check_launchable(_routed_plan_kernel, dev)
    _routed_plan_kernel[(b * h,)](
        chosen.contiguous().view(torch.uint8), shard.contiguous(), special.contiguous().view(torch.uint8), pages,
        full.view(torch.uint8), chosen.shape[-1], w, BLOCK_W=_BLOCK_W,
    )  # fmt: skip
    return pages, full


routed_plan_op = torch.library.custom_op(
    "pikv::routed_plan", _launch, mutates_args=(), device_types="cuda",
    schema="(Tensor chosen, Tensor shard, Tensor special) -> (Tensor, Tensor)",
)  # fmt: skip


@routed_plan_op.register_kernel("cpu")
def _routed_plan_cpu(chosen, shard, special):
    return routed_plan_reference(chosen, shard, special)


@routed_plan_op.register_fake
def _routed_plan_fake(chosen, shard, special):
    return shard.new_empty(shard.shape, dtype=torch.int64), shard.new_empty(shard.shape, dtype=torch.bool)


def routed_plan(chosen: torch.Tensor, shard: torch.Tensor, special: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pages, page_full)`` of a routed read (arguments and results of :func:`routed_plan_reference`), one operator
    (one kernel on CUDA). Checks shapes only (no host read)."""
    b, h, w = shard.shape
    if chosen.dim() != 3 or tuple(chosen.shape[:2]) != (b, h) or chosen.dtype != torch.bool:
        raise ValueError(f"chosen must be bool [B={b}, H={h}, S]; got {chosen.dtype} {list(chosen.shape)}")
    if tuple(special.shape) != (b, h, w) or special.dtype != torch.bool:
        raise ValueError(f"special must be bool [B={b}, H={h}, W={w}]; got {special.dtype} {list(special.shape)}")
    return routed_plan_op(chosen, shard, special)
