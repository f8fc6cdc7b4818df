"""The ``"pikv"`` attention implementation: masking owned by the cache, per-shard partials merged by log-sum-exp.

transformers' mask builder assumes the cached keys are one contiguous range of positions. PiKVCache keeps shards
of pages whose slots are not in position order (and later, evicted or per-head budgets), so masking here is
computed from what every slot stores: ``allowed[b, h, i, j] = valid[b, h, j] & pos[b, h, j] <= qpos[i]`` (and
``qpos[i] - pos[b, h, j] < sliding_window`` when the layer slides). The registered mask function only forwards the
2-D padding mask, which marks the padding tokens of the current forward as invalid.

Attention of a query over a set of key groups is computed as partial results ``(o_g, lse_g)`` with
``o_g = softmax(s_g) v_g`` and ``lse_g = logsumexp(s_g)``; merging them,
``o = sum_g exp(lse_g - lse) o_g`` with ``lse = logsumexp_g(lse_g)``, is exact. Attention sinks (GPT-OSS ``s_aux``)
are one more partial with ``o = 0`` and ``lse = sink logit``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

ATTN_IMPLEMENTATION = "pikv"
_SCORE_BUDGET_BYTES = 256 * 2**20  # fp32 score-matrix bytes per query chunk


@dataclass
class PiKVMask:
    """What the ``pikv`` mask function hands to the attention function.

    Attributes
    ----------
    padding : torch.Tensor or None
        ``[B, T]`` bool, False for padding tokens, over all ``T`` tokens seen so far including the current ones
        (the 2-D ``attention_mask`` of ``generate``); None when the caller gave no mask.
    """

    padding: torch.Tensor | None


def pikv_mask(
    batch_size: int,
    cache_position: torch.Tensor,
    kv_length: int,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> PiKVMask:
    """Mask function registered under ``"pikv"``: keeps only the padding information, masking happens later."""
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"pikv attention expects a 2-D padding attention_mask, got shape {tuple(attention_mask.shape)}"
        )
    return PiKVMask(padding=None if attention_mask is None else attention_mask.to(torch.bool))


def allowed_mask(
    valid: torch.Tensor,
    pos: torch.Tensor,
    qpos: torch.Tensor,
    sliding_window: int | None,
    routed: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """``[B, H, q, C]`` bool: which stored slots each query may attend to.

    ``valid`` and ``pos`` are ``[B, H, C]``; ``qpos`` is ``[q]``. ``routed = (chosen, window)`` further keeps only
    slots where ``chosen`` (``[B, H, C]``: selected shard or sink) holds or that lie in the query's last
    ``window`` positions.
    """
    rel = qpos.view(1, 1, -1, 1).to(pos.dtype) - pos.unsqueeze(2)  # distance query -> key, [B,H,q,C]
    allowed = valid.unsqueeze(2) & (rel >= 0)
    if sliding_window is not None:
        allowed &= rel < sliding_window
    if routed is not None:
        chosen, window = routed
        allowed &= chosen.unsqueeze(2) | (rel < window)
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
        ``o [B, H, R, Dv]`` float32 (zeros for rows with no key) and ``lse [B, H, R]`` (``-inf`` there).
    """
    m = logits.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(logits - m)
    denom = p.sum(-1, keepdim=True)
    o = torch.matmul(p.to(values.dtype), values).float() / denom.clamp(min=torch.finfo(torch.float32).tiny)
    return o, (m + torch.log(denom)).squeeze(-1)


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact log-sum-exp merge of partial attention results ``(o [..., R, Dv], lse [..., R])``."""
    if len(parts) == 1:
        return parts[0]
    lse = torch.stack([lse for _, lse in parts])  # [P, ..., R]
    m = lse.amax(0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m)
    total = w.sum(0)
    o = sum(wi.unsqueeze(-1) * oi for wi, (oi, _) in zip(w, parts, strict=True))
    o = o / total.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1)
    return o, m + torch.log(total)


def masked_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    pos: torch.Tensor,
    qpos: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    groups: list[torch.Tensor] | None = None,
    mass_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact GQA attention of new queries over stored slots, per key group, merged by log-sum-exp.

    Parameters
    ----------
    query : torch.Tensor
        ``[B, Hq, q, Dk]``; query head ``i`` reads KV head ``i // (Hq // H)``.
    keys, values : torch.Tensor
        ``[B, H, C, Dk]`` and ``[B, H, C, Dv]`` slot arrays.
    valid, pos : torch.Tensor
        ``[B, H, C]`` valid bits and sequence positions of the slots.
    qpos : torch.Tensor
        ``[q]`` sequence positions of the queries.
    scale : float
        Logit scale.
    sliding_window : int, optional
        Keys with ``qpos - pos >= sliding_window`` are masked.
    sinks : torch.Tensor, optional
        ``[Hq]`` attention-sink logits (GPT-OSS), a value-less extra key per head.
    groups : list of torch.Tensor, optional
        ``[B, H, C]`` bool slot masks (e.g. the slots of each shard group); one partial per group. They must
        partition the valid slots. Default: one group holding every slot.
    mass_out : torch.Tensor, optional
        ``[B, H, C]`` float32; when given, the attention probability each slot received (summed over the query
        rows of its KV head) is added to it.
    Returns
    -------
    torch.Tensor
        ``[B, q, Hq, Dv]`` in the query dtype.
    """
    b, hq, q, dk = query.shape
    h, c, dv = keys.shape[1], keys.shape[2], values.shape[-1]
    if hq % h:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({h})")
    g = hq // h
    qg = query.reshape(b, h, g, q, dk)
    chunk = max(1, min(q, _SCORE_BUDGET_BYTES // max(1, b * hq * c * 4)))
    outs = []
    for start in range(0, q, chunk):
        qc = qg[:, :, :, start : start + chunk]
        n = qc.shape[3]
        # K @ q^T is ~30% faster than q @ K^T for a few query rows on CPU BLAS; the transpose back is a view
        scores = torch.matmul(keys, qc.reshape(b, h, g * n, dk).transpose(-1, -2)).transpose(-1, -2)
        scores = scores.float().mul_(scale)
        allowed = allowed_mask(valid, pos, qpos[start : start + chunk], sliding_window).unsqueeze(2)
        scores5 = scores.view(b, h, g, n, c)
        parts = []
        for group in groups or [None]:
            a = allowed if group is None else allowed & group.view(b, h, 1, 1, c)
            parts.append(partial_attention(scores5.masked_fill(~a, float("-inf")).view(b, h, g * n, c), values))
        if sinks is not None:
            sink_lse = sinks.float().view(1, h, g, 1).expand(b, h, g, n).reshape(b, h, g * n)
            parts.append((torch.zeros_like(parts[0][0]), sink_lse))
        o, lse = merge_partials(parts)
        if mass_out is not None:
            prob = torch.exp(scores5.masked_fill(~allowed, float("-inf")) - lse.view(b, h, g, n, 1))
            mass_out += prob.sum(dim=(2, 3))
        outs.append(o.view(b, h, g, n, dv))
    out = torch.cat(outs, dim=3) if len(outs) > 1 else outs[0]
    return out.reshape(b, hq, q, dv).transpose(1, 2).to(query.dtype)


def pikv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key,
    value,
    attention_mask: PiKVMask | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention function registered under ``"pikv"`` (signature of transformers' attention interface).

    With a ``PiKVCache`` the ``key``/``value`` arguments are the layer's ``PagedKV`` view and masking comes from
    the store; with any other cache (or none) they are dense ``[B, H, T, D]`` tensors holding the last ``T``
    positions, and the same exact computation runs on them.
    """
    from pikv_hf.cache import PagedKV

    if dropout and module.training:
        raise ValueError("pikv attention does not implement attention dropout; call model.eval()")
    if kwargs.get("softcap") is not None:
        raise ValueError("pikv attention does not implement logit soft-capping (softcap)")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    padding = attention_mask.padding if isinstance(attention_mask, PiKVMask) else None
    if isinstance(key, PagedKV):
        return key.layer.attend(query, scale, padding, sliding_window, s_aux), None
    b, _, q, _ = query.shape
    t_kv = key.shape[2]
    total = padding.shape[-1] if padding is not None else t_kv
    pos = torch.arange(total - t_kv, total, device=key.device, dtype=torch.int32).expand(b, key.shape[1], t_kv)
    valid = (
        padding[:, -t_kv:].unsqueeze(1).expand(b, key.shape[1], t_kv)
        if padding is not None
        else torch.ones(b, key.shape[1], t_kv, dtype=torch.bool, device=key.device)
    )
    qpos = torch.arange(total - q, total, device=key.device)
    return masked_attention(query, key, value, valid, pos, qpos, scale, sliding_window, s_aux), None


def register() -> None:
    """Register the ``"pikv"`` attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, pikv_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, pikv_mask)
