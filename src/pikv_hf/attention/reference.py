"""Torch reference of masked attention over stored slots: exact GQA partials ``(o, lse)``.

transformers' mask builder assumes the cached keys are one contiguous range of positions. A PiKVCache keeps
shards of pages whose slots are not in position order (and evicted, per-head ragged budgets), so the mask is
computed from what every slot stores: ``allowed[b, h, i, j] = ok[b, h, j] & pos[b, h, j] <= qpos[i]`` (and
``qpos[i] - pos[b, h, j] < sliding_window`` when the layer slides), where ``ok`` is the slot's valid bit combined
with whatever a read plan restricts.
"""

from __future__ import annotations

import torch

from pikv_hf.attention.merge import merge_partials, sink_partial

_SCORE_BUDGET_BYTES = 256 * 2**20  # fp32 score-matrix bytes per query chunk


def allowed_mask(ok: torch.Tensor, pos: torch.Tensor, qpos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """``[B, H, q, C]`` bool: which slots (``ok``, ``pos``: ``[B, H, C]``) each query (``qpos``: ``[q]``) may read."""
    rel = qpos.view(1, 1, -1, 1).to(pos.dtype) - pos.unsqueeze(2)  # distance query -> key
    allowed = ok.unsqueeze(2) & (rel >= 0)
    if sliding_window is not None:
        allowed &= rel < sliding_window
    return allowed


def partial_attention(logits: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over the keys whose logit is finite, as a mergeable partial result.

    Parameters
    ----------
    logits : torch.Tensor
        ``[B, H, R, C]`` float32 scaled logits of ``R`` query rows, ``-inf`` for keys outside the partial.
    values : torch.Tensor
        ``[B, H, C, Dv]``.

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``o [B, H, R, Dv]`` float32 (zeros for rows with no key, also when ``C`` is 0: a read plan that selects no
        page of a store) and ``lse [B, H, R]`` (``-inf`` there).
    """
    if logits.shape[-1] == 0:
        return logits.new_zeros(*logits.shape[:-1], values.shape[-1]), logits.new_full(logits.shape[:-1], -torch.inf)
    m = logits.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(logits - m)
    denom = p.sum(-1, keepdim=True)
    o = torch.matmul(p.to(values.dtype), values).float() / denom.clamp(min=torch.finfo(torch.float32).tiny)
    return o, (m + torch.log(denom)).squeeze(-1)


def masked_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    ok: torch.Tensor,
    pos: torch.Tensor,
    qpos: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    group_of_slot: torch.Tensor | None = None,
    groups: int = 1,
    want_mass: bool = False,
    mass_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Exact GQA attention of new queries over slots, one partial per slot group, merged by log-sum-exp.

    Parameters
    ----------
    query : torch.Tensor
        ``[B, Hq, q, Dk]``; query head ``i`` reads KV head ``i // (Hq // H)``.
    keys, values : torch.Tensor
        ``[B, H, C, Dk]`` and ``[B, H, C, Dv]``.
    ok, pos : torch.Tensor
        ``[B, H, C]`` readable slots (valid and in the read plan) and their sequence positions.
    qpos : torch.Tensor
        ``[q]`` sequence positions of the queries.
    scale : float
        Logit scale.
    sliding_window : int, optional
        Keys with ``qpos - pos >= sliding_window`` are masked.
    sinks : torch.Tensor, optional
        ``[Hq]`` attention-sink logits (GPT-OSS), a value-less extra key per head.
    group_of_slot : torch.Tensor, optional
        ``[B, H, C]`` int64 group id in ``[0, groups)`` of every slot; one partial per group.
    want_mass : bool
        Also return the attention probability each slot received, summed over the query rows of its KV head.
    mass_lse : torch.Tensor, optional
        ``[B, Hq, q]``: the log-sum-exp the probabilities of ``want_mass`` are normalised by, when the queries read
        more than these slots (other stores, other ranks); default: this call's own ``lse``.

    Returns
    -------
    (torch.Tensor, torch.Tensor, torch.Tensor or None)
        ``o [B, Hq, q, Dv]`` float32, ``lse [B, Hq, q]`` and ``mass [B, H, C]`` float32 (or None).
    """
    b, hq, q, dk = query.shape
    h, c, dv = keys.shape[1], keys.shape[2], values.shape[-1]
    if hq % h:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({h})")
    g = hq // h
    qg = query.reshape(b, h, g, q, dk)
    chunk = max(1, min(q, _SCORE_BUDGET_BYTES // max(1, b * hq * c * 4)))
    outs, lses = [], []
    mass = torch.zeros(b, h, c, device=keys.device) if want_mass else None
    for start in range(0, q, chunk):
        qc = qg[:, :, :, start : start + chunk]
        n = qc.shape[3]
        # K @ q^T is ~30% faster than q @ K^T for a few query rows on CPU BLAS; the transpose back is a view
        scores = torch.matmul(keys, qc.reshape(b, h, g * n, dk).to(keys.dtype).transpose(-1, -2)).transpose(-1, -2)
        scores5 = scores.float().mul_(scale).view(b, h, g, n, c)
        allowed = allowed_mask(ok, pos, qpos[start : start + chunk], sliding_window).unsqueeze(2)
        parts = []
        for gi in range(groups):
            a = allowed if groups == 1 else allowed & (group_of_slot == gi).view(b, h, 1, 1, c)
            parts.append(partial_attention(scores5.masked_fill(~a, float("-inf")).view(b, h, g * n, c), values))
        o, lse = merge_partials(parts)
        o, lse = o.view(b, hq, n, dv), lse.view(b, hq, n)
        if sinks is not None:
            o, lse = merge_partials([(o, lse), sink_partial(sinks, o)])
        if mass is not None:
            norm = lse if mass_lse is None else mass_lse[:, :, start : start + chunk]
            prob = torch.exp(scores5 - norm.reshape(b, h, g, n, 1)).masked_fill(~allowed, 0.0)  # 0: rows of no key
            mass += prob.sum(dim=(2, 3))
        outs.append(o)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0], mass
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2), mass
