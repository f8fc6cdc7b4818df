"""Key-cluster placement of one decode token per (row, KV head) as one kernel: the nearest centroid, then its running
mean moves towards the key (MacQueen's online k-means step of ``pikv_hf.routing.key_cluster``).

Program ``b * H + h``: over blocks of centroids, ``k . c - |c|^2 / 2`` (``|c|^2 / 2`` kept in ``norms``, ``+inf``
for a centroid not seeded) and its running argmax (the first of equal maxima, as ``torch.argmax``); then the chosen
centroid ``c += (k - c) / n`` with ``n`` its count plus one, its count and ``|c|^2 / 2`` written back in place. The
operator is ``torch.ops.pikv.place_key`` (mutating ``centroids``, ``counts`` and ``norms``; the torch reference on
the CPU, a fake implementation for tracing); it reads no value back to the host.
"""

from __future__ import annotations

import torch

from pikv_hf.kernels._host import next_power_of_2
from pikv_hf.kernels._triton import check_launchable, eager_direct, jit, tl

_BLOCK_S = 64  # centroids per step


@jit
def _place_key_kernel(
    k_ptr, c_ptr, n_ptr, norm_ptr, out_ptr, S, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr
):
    r = tl.program_id(0).to(tl.int64)
    ds = tl.arange(0, BLOCK_D)
    d_ok = ds < D
    key = tl.load(k_ptr + r * D + ds, mask=d_ok, other=0.0)
    best = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
    best_at = tl.sum(tl.zeros([BLOCK_S], tl.int64), 0)
    for s0 in range(0, S, BLOCK_S):
        ss = s0 + tl.arange(0, BLOCK_S)
        s_ok = ss < S
        c = tl.load(c_ptr + r * S * D + ss[:, None] * D + ds[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        half = tl.load(norm_ptr + r * S + ss, mask=s_ok, other=float("inf"))
        score = tl.where(s_ok, tl.sum(c * key[None, :], 1) - half, float("-inf"))
        top = tl.max(score, 0)
        at = tl.min(tl.where(score == top, ss, S), 0).to(tl.int64)
        better = top > best  # an earlier block keeps a tie
        best_at = tl.where(better, at, best_at)
        best = tl.maximum(best, top)
    n = tl.load(n_ptr + r * S + best_at) + 1
    row = c_ptr + r * S * D + best_at * D + ds
    c = tl.load(row, mask=d_ok, other=0.0)
    c = c + (key - c) / n.to(tl.float32)
    tl.store(row, c, mask=d_ok)
    tl.store(n_ptr + r * S + best_at, n)
    tl.store(norm_ptr + r * S + best_at, tl.sum(c * c, 0) / 2)
    tl.store(out_ptr + r, best_at)


def place_key_reference(
    keys: torch.Tensor, centroids: torch.Tensor, counts: torch.Tensor, norms: torch.Tensor
) -> torch.Tensor:
    """Torch reference of ``torch.ops.pikv.place_key``.

    Parameters
    ----------
    keys : torch.Tensor
        ``[B, H, 1, D]`` float32 key of each (row, KV head)'s new token.
    centroids : torch.Tensor
        ``[B, H, S, D]`` float32 running means, updated in place.
    counts : torch.Tensor
        ``[B, H, S]`` int64 tokens per centroid, updated in place.
    norms : torch.Tensor
        ``[B, H, S]`` float32 ``|c|^2 / 2`` (``+inf``: not seeded), updated in place.

    Returns
    -------
    torch.Tensor
        ``[B, H, 1]`` int64 nearest centroid of every key (squared L2 distance, the first on a tie).
    """
    score = (keys @ centroids.transpose(-1, -2)).squeeze(2) - norms  # [B, H, S]
    shard = score.argmax(-1, keepdim=True)  # [B, H, 1]
    at = shard.unsqueeze(-1).expand(*shard.shape, keys.shape[-1])
    n = counts.gather(2, shard) + 1
    c = centroids.gather(2, at)
    c = c + (keys - c) / n.unsqueeze(-1).to(keys.dtype)
    centroids.scatter_(2, at, c)
    counts.scatter_(2, shard, n)
    norms.scatter_(2, shard, c.square().sum(-1) / 2)
    return shard


def _launch(keys: torch.Tensor, centroids: torch.Tensor, counts: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """The kernel on contiguous state (the operator's CUDA implementation; also CPU under ``TRITON_INTERPRET``)."""
    b, h, _, d = keys.shape
    s = counts.shape[-1]
    out = torch.empty(b, h, 1, dtype=torch.int64, device=keys.device)
    if b * h == 0:
        return out
    check_launchable(_place_key_kernel, keys.device)
    _place_key_kernel[(b * h,)](
        keys.contiguous(), centroids, counts, norms, out, s, D=d, BLOCK_S=_BLOCK_S, BLOCK_D=next_power_of_2(d)
    )
    return out


place_key_op = torch.library.custom_op(
    "pikv::place_key", _launch, mutates_args=("centroids", "counts", "norms"), device_types="cuda",
    schema="(Tensor keys, Tensor(a!) centroids, Tensor(b!) counts, Tensor(c!) norms) -> Tensor",
)  # fmt: skip


@place_key_op.register_kernel("cpu")
def _place_key_cpu(keys, centroids, counts, norms):
    return place_key_reference(keys, centroids, counts, norms)


_place_key_eager = eager_direct(place_key_op, _launch, _place_key_cpu)


@place_key_op.register_fake
def _place_key_fake(keys, centroids, counts, norms):
    return counts.new_empty(*keys.shape[:2], 1)


def place_key(keys: torch.Tensor, centroids: torch.Tensor, counts: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """``[B, H, 1]`` shard of each key, the state moved in place (arguments of :func:`place_key_reference`), one
    operator (one kernel on CUDA). Checks shapes, dtypes and contiguity only (no host read)."""
    b, h, q, d = keys.shape
    s = counts.shape[-1]
    if q != 1 or keys.dtype != torch.float32:
        raise ValueError(f"keys must be float32 [B, H, 1, D]; got {keys.dtype} {list(keys.shape)}")
    for name, t, shape, dtype in (
        ("centroids", centroids, (b, h, s, d), torch.float32),
        ("counts", counts, (b, h, s), torch.int64),
        ("norms", norms, (b, h, s), torch.float32),
    ):
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous {dtype} {list(shape)}; got {t.dtype} {list(t.shape)}")
    return _place_key_eager(keys, centroids, counts, norms)
