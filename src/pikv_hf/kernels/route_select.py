"""Routed shard selection of one decode step as one kernel: centroid scores, top-k and the mass target (top-p)
-> the mask of the shards a (row, KV head) reads.

Program ``b * H + h`` (one per row and KV head) reads the shard statistics as kept (``pikv_hf.store.summary``:
per-shard key sums, squares and counts) and divides them itself (centroid ``sum / n``, variance ``sq / n -
centroid^2`` clamped at 0, as ``ShardStats.summary`` computes them):

1. over blocks of shards, the products ``q_g . c_s`` of the ``G`` query rows with every centroid, the score
   ``max_g q_g . c_s`` (``-inf`` for an empty shard) and, with a mass target, the logits of
   ``pikv_hf.routing.scores.estimated_mass`` (``s q.c + s^2 / 2 q^2.var + log n``) with their running
   max / sum per query row (online softmax); scores and logits go to a scratch buffer;
2. after a barrier, every shard's rank under the stable descending sort of the scores (ties to the lower id) and
   the estimated mass of the shards ranked before it, by comparing it with every other shard (``S^2 / BLOCK``
   vector steps, no sort): shard ``s`` is read when ``rank < k`` and (with a target) ``mass before < target``, the
   shortest ranked prefix reaching the target, as ``RoutedRead.choose`` computes it with a sort and a prefix sum.

The mass before a shard is summed in another order than the reference's prefix sum: a shard whose prefix lies within
float rounding of the target may be decided the other way. The operator is ``torch.ops.pikv.route_select`` (the
torch reference on the CPU, a fake implementation for tracing); it reads no value back to the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pikv_hf.kernels._host import next_power_of_2
from pikv_hf.kernels._triton import check_launchable, eager_direct, jit, tl
from pikv_hf.routing.scores import mass_of_dots, scores_of_dots
from pikv_hf.store.summary import shard_moments

_BLOCK_S = 64  # shards per block of either pass
_BLOCK_D = 32  # key dims per step of the products


@jit
def _route_select_kernel(
    q_ptr, sum_ptr, sq_ptr, n_ptr, score_ptr, logit_ptr, out_ptr, S, k, target, scale,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_MASS: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    gs = tl.arange(0, BLOCK_G)
    g_ok = gs < G
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_G], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        ss = s0 + tl.arange(0, BLOCK_S)
        s_ok = ss < S
        n = tl.load(n_ptr + r * S + ss, mask=s_ok, other=0)
        n_div = tl.maximum(n, 1).to(tl.float32)[:, None]  # an empty shard's zero sums stay zero
        dots = tl.zeros([BLOCK_G, BLOCK_S], tl.float32)
        spread = tl.zeros([BLOCK_G, BLOCK_S], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            ds = d0 + tl.arange(0, BLOCK_D)
            d_ok = ds < D
            q_at = q_ptr + r * G * D + gs[:, None] * D + ds[None, :]
            q = tl.load(q_at, mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            at = r * S * D + ss[:, None] * D + ds[None, :]
            cd_ok = s_ok[:, None] & d_ok[None, :]
            c = tl.load(sum_ptr + at, mask=cd_ok, other=0.0) / n_div
            dots += tl.sum(q[:, None, :] * c[None, :, :], 2)
            if HAS_MASS:
                v = tl.maximum(tl.load(sq_ptr + at, mask=cd_ok, other=0.0) / n_div - c * c, 0.0)
                spread += tl.sum((q * q)[:, None, :] * v[None, :, :], 2)
        score = tl.max(tl.where(g_ok[:, None], dots, float("-inf")), 0)
        tl.store(score_ptr + r * S + ss, tl.where(n == 0, float("-inf"), score), mask=s_ok)
        if HAS_MASS:
            log_n = tl.where(n > 0, tl.log(tl.maximum(n, 1).to(tl.float32)), float("-inf"))  # empty: no share
            logit = dots * scale + spread * (0.5 * scale * scale) + log_n[None, :]
            logit = tl.where(s_ok[None, :], logit, float("-inf"))
            tl.store(logit_ptr + r * G * S + gs[:, None] * S + ss[None, :], logit, mask=g_ok[:, None] & s_ok[None, :])
            m_new = tl.maximum(m, tl.max(logit, 1))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row of empty shards so far: no NaN
            den = den * tl.exp(m - base) + tl.sum(tl.exp(logit - base[:, None]), 1)
            m = m_new
    tl.debug_barrier()  # the scratch rows written above are read back by the whole program
    base = tl.where(m == float("-inf"), 0.0, m)
    for s0 in range(0, S, BLOCK_S):
        ss = s0 + tl.arange(0, BLOCK_S)
        s_ok = ss < S
        mine = tl.load(score_ptr + r * S + ss, mask=s_ok, other=float("-inf"))
        rank = tl.zeros([BLOCK_S], tl.int32)
        before = tl.zeros([BLOCK_S], tl.float32)
        for t0 in range(0, S, BLOCK_S):
            ts = t0 + tl.arange(0, BLOCK_S)
            t_ok = ts < S
            other = tl.load(score_ptr + r * S + ts, mask=t_ok, other=float("-inf"))
            ahead = (other[None, :] > mine[:, None]) | ((other[None, :] == mine[:, None]) & (ts[None, :] < ss[:, None]))
            ahead = ahead & t_ok[None, :]
            rank += tl.sum(ahead.to(tl.int32), 1)
            if HAS_MASS:
                logit = tl.load(
                    logit_ptr + r * G * S + gs[:, None] * S + ts[None, :],
                    mask=g_ok[:, None] & t_ok[None, :],
                    other=float("-inf"),
                )
                share = tl.where(g_ok[:, None], tl.exp(logit - base[:, None]) / den[:, None], 0.0)
                mass = tl.sum(share, 0) / G
                before += tl.sum(tl.where(ahead, mass[None, :], 0.0), 1)
        keep = rank < k
        if HAS_MASS:
            keep = keep & (before < target)
        tl.store(out_ptr + r * S + ss, keep.to(tl.uint8), mask=s_ok)


def route_select_reference(
    query: torch.Tensor,
    sums: torch.Tensor,
    squares: torch.Tensor | None,
    counts: torch.Tensor,
    scale: float,
    k: int,
    mass_target: float,
) -> torch.Tensor:
    """Torch reference of ``torch.ops.pikv.route_select`` (the selection ``RoutedRead`` makes with the top-k
    centroid selector, on the summary ``ShardStats.summary`` builds from the same statistics).

    Parameters
    ----------
    query : torch.Tensor
        ``[B, H, G, D]`` query rows of each KV head.
    sums, squares : torch.Tensor
        ``[B, H, S, D]`` float32 sum and sum of squares of every shard's keys (``squares`` may be None without a
        mass target).
    counts : torch.Tensor
        ``[B, H, S]`` int64 tokens per shard (0: empty, scored ``-inf``).
    scale : float
        Softmax scale of the attention.
    k : int
        Most shards read per (row, head), ``1 <= k <= S``.
    mass_target : float
        Read the shortest prefix of the ``k`` best shards whose estimated attention mass reaches it; ``< 0``: none.

    Returns
    -------
    torch.Tensor
        ``[B, H, S]`` bool, True for the shards read.
    """
    centroids, key_var = shard_moments(sums, squares if mass_target >= 0 else None, counts)
    dots = query.float() @ centroids.float().transpose(-1, -2)
    selected = scores_of_dots(dots, counts).argsort(dim=-1, descending=True, stable=True)[..., :k]
    if mass_target < 0:
        keep = torch.ones_like(selected, dtype=torch.bool)
    else:  # the shortest ranked prefix reaching the target (always >= 1 shard)
        covered = mass_of_dots(dots, query, key_var, counts, scale).gather(2, selected).cumsum(-1)
        keep = F.pad(covered[..., :-1] < mass_target, (1, 0), value=True)
    return torch.zeros(counts.shape, dtype=torch.bool, device=counts.device).scatter_(2, selected, keep)


def _launch(
    query: torch.Tensor,
    sums: torch.Tensor,
    squares: torch.Tensor | None,
    counts: torch.Tensor,
    scale: float,
    k: int,
    mass_target: float,
) -> torch.Tensor:
    """The kernel on contiguous inputs (the operator's CUDA implementation; also CPU under ``TRITON_INTERPRET``)."""
    b, h, g, d = query.shape
    s = counts.shape[-1]
    dev = query.device
    out = torch.empty(b, h, s, dtype=torch.bool, device=dev)
    if b * h * s == 0:
        return out
    check_launchable(_route_select_kernel, dev)
    has_mass = mass_target >= 0
    scores = torch.empty(b * h, s, dtype=torch.float32, device=dev)
    logits = torch.empty(b * h, g, s, dtype=torch.float32, device=dev) if has_mass else scores
    q, total, n = query.contiguous(), sums.contiguous(), counts.contiguous()
    square = squares.contiguous() if has_mass else total
    _route_select_kernel[(b * h,)](
        q, total, square, n, scores, logits, out.view(torch.uint8), s, k, float(mass_target), float(scale),
        G=g, D=d, BLOCK_G=next_power_of_2(g), BLOCK_S=_BLOCK_S, BLOCK_D=min(_BLOCK_D, next_power_of_2(d)),
        HAS_MASS=has_mass,
    )  # fmt: skip
    return out


route_select_op = torch.library.custom_op(
    "pikv::route_select", _launch, mutates_args=(), device_types="cuda",
    schema="(Tensor query, Tensor sums, Tensor? squares, Tensor counts, float scale, int k, float mass_target) "
    "-> Tensor",
)  # fmt: skip


@route_select_op.register_kernel("cpu")
def _route_select_cpu(query, sums, squares, counts, scale, k, mass_target):
    return route_select_reference(query, sums, squares, counts, scale, k, mass_target)


_route_select_eager = eager_direct(route_select_op, _launch, _route_select_cpu)


@route_select_op.register_fake
def _route_select_fake(query, sums, squares, counts, scale, k, mass_target):
    return counts.new_empty(counts.shape, dtype=torch.bool)


def route_select(
    query: torch.Tensor,
    sums: torch.Tensor,
    squares: torch.Tensor | None,
    counts: torch.Tensor,
    scale: float,
    k: int,
    mass_target: float | None,
) -> torch.Tensor:
    """``[B, H, S]`` bool: the shards each (row, KV head) reads (arguments of :func:`route_select_reference`;
    ``mass_target`` None: the ``k`` best), one operator (one kernel on CUDA). Checks shapes only (no host read)."""
    if query.dim() != 4 or counts.dim() != 3:
        raise ValueError(f"query must be [B, H, G, D], counts [B, H, S]; got {list(query.shape)}, {list(counts.shape)}")
    b, h, _, d = query.shape
    s = counts.shape[-1]
    for name, t in (("sums", sums), ("squares", squares)):
        if t is not None and (tuple(t.shape) != (b, h, s, d) or t.dtype != torch.float32):
            raise ValueError(f"{name} must be float32 [B={b}, H={h}, S={s}, D={d}]; got {t.dtype} {list(t.shape)}")
    if not 1 <= k <= s:
        raise ValueError(f"k (top_k_shards) must be in [1, {s}]; got {k}")
    if mass_target is not None and squares is None:
        raise ValueError("squares (the shards' key sums of squares) are required with a mass_target")
    target = -1.0 if mass_target is None else float(mass_target)
    return _route_select_eager(query, sums, squares if mass_target is not None else None, counts, float(scale),
                               int(k), target)  # fmt: skip
