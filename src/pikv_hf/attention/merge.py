"""Exact log-sum-exp merge of partial attention results.

Attention of a query over a set of key groups is computed as partial results ``(o_g, lse_g)`` with
``o_g = softmax(s_g) v_g`` and ``lse_g = logsumexp(s_g)``; merging them,
``o = sum_g exp(lse_g - lse) o_g`` with ``lse = logsumexp_g(lse_g)``, is exact. Partials may come from shard
groups, from splits of a long KV, from devices or from ranks. Attention sinks (GPT-OSS ``s_aux``) are one more
partial with ``o = 0`` and ``lse = sink logit``.
"""

from __future__ import annotations

import torch


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partials ``(o [..., R, Dv], lse [..., R])`` (rows with no key: ``o = 0``, ``lse = -inf``)."""
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:  # the common case (a hot store and one tier, a partial and the sinks)
        (o1, lse1), (o2, lse2) = parts
        same = o1.shape == o2.shape and lse1.shape == lse2.shape == o1.shape[:-1]
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (o1, lse1, o2, lse2))
        if same and not grad and o1.dtype == o2.dtype == lse1.dtype == lse2.dtype == torch.float32:
            if not torch.compiler.is_compiling():  # one operator (one kernel on CUDA); compiled: fused by inductor
                from pikv_hf.kernels.merge import merge_two_eager  # (kernels.merge imports this module)

                return merge_two_eager(o1, lse1, o2, lse2)
        return merge_two_reference(o1, lse1, o2, lse2)
    lse = torch.stack([lse for _, lse in parts])  # [P, ..., R]
    m = lse.amax(0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m)
    total = w.sum(0)
    o = sum(wi.unsqueeze(-1) * oi for wi, (oi, _) in zip(w, parts, strict=True))
    o = o / total.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1)
    return o, m + torch.log(total)


def merge_two_reference(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch merge of two partials ``(o [..., R, Dv], lse [..., R])`` (shapes broadcast): the CPU
    implementation of ``torch.ops.pikv.merge_partials`` and the code a compiled step traces."""
    lse = torch.logaddexp(lse1, lse2)
    m = lse.nan_to_num(neginf=0.0)  # rows with no key in either: weights exp(-inf) = 0, o = 0
    return torch.exp(lse1 - m).unsqueeze(-1) * o1 + torch.exp(lse2 - m).unsqueeze(-1) * o2, lse


def sink_partial(sinks: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial of per-query-head sink logits ``sinks`` (``[Hq]``) for outputs shaped like ``like``
    (``[B, Hq, q, Dv]``): a value-less key whose logit is the sink."""
    b, hq, q, _ = like.shape
    return torch.zeros_like(like), sinks.float().view(1, hq, 1).expand(b, hq, q)
