"""A decode token's attention over quantised pages read as codes, in torch: the CPU read of a QuantPress tier.

Decoding the pages first (``dequantize_pages``: every code times its scale plus its zero, in float32) and then
attending writes and reads the dense K/V once more than the attention itself; on one CPU thread at 8k tokens it is
two thirds of the read. Here the scales are folded in where the KIVI layout (``pikv_hf.codecs.quant``) makes that
exact, as the 4-bit Triton kernel does:

- keys, per page ``n`` and channel ``c``: ``k[t, c] = s[n, c] * code[t, c] + z[n, c]``, so
  ``q . k_t = sum_j (q * s_n)[j::per] . field_j(code_t) + q . z_n`` with ``field_j`` the ``j``-th code of every byte
  (channel ``per * i + j``; ``per = 8 // bits``): one small matmul per code field and page, on the codes converted
  to float, no interleave;
- values, per token ``t`` and group ``g`` of channels: ``sum_t p_t v[t, c] = sum_t (p_t s[t, g]) field_j(code_t)
  + sum_t p_t z[t, g]``: the probabilities are scaled once per group.

The same numbers as decoding then attending in float32, up to the order of the sums. It is one torch custom
operator, ``torch.ops.pikv.quant_decode`` (CPU; on CUDA the Triton backend reads the codes with
``torch.ops.pikv.paged_decode_q4``), called directly in eager code and traced under ``torch.compile``
(``kernels._triton.eager_direct``): a dispatch mode (``benchmarks/count_ops.py``) counts the read as the one kernel it
is on a GPU. Traced, inductor's code for it is the faster: a compiled SmolLM2 step of a 4-bit cache at 8k tokens ran
at 0.84x DynamicCache's so, 1.01x with the operator running this implementation (two runs). A plan that keeps its
frame's width in a compiled step (Quest's plans over a store group) goes through ``torch.ops.pikv.quant_read``
instead, which reads no more than the plan's longest row.
"""

from __future__ import annotations

import torch

from pikv_hf.kernels._triton import eager_direct, runs_eagerly

Scratch = tuple[torch.Tensor, torch.Tensor]  # flat uint8 and float32 buffers, each as large as one code field


def _field(codes: torch.Tensor, j: int, bits: int, scratch: Scratch | None = None) -> torch.Tensor:
    """The ``j``-th ``bits``-bit code of every byte of ``codes`` (low bits first), as float32; written into
    ``scratch`` when given (its contents are overwritten: one field is live at a time)."""
    if scratch is None:
        if bits == 8:
            return codes.float()
        shifted = codes >> (j * bits) if j else codes
        return (shifted & ((1 << bits) - 1)).float()
    small, wide = (buf[: codes.numel()].view(codes.shape) for buf in scratch)
    if bits == 8:
        return wide.copy_(codes)
    if j:
        torch.bitwise_right_shift(codes, j * bits, out=small)
        small.bitwise_and_((1 << bits) - 1)
    else:
        torch.bitwise_and(codes, (1 << bits) - 1, out=small)
    return wide.copy_(small)


def quant_decode(
    query: torch.Tensor,
    fields: dict[str, torch.Tensor],
    bias: torch.Tensor,
    scale: float,
    bits: int,
    scratch: Scratch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token over quantised pages.

    Parameters
    ----------
    query : torch.Tensor
        ``[B, Hq, 1, Dk]``; the ``Hq // H`` query heads of a KV head read its pages together.
    fields : dict
        The pages' codec fields (``QuantCodec.fields``) over ``C = n * P`` slots of ``n`` pages: ``kq`` ``[B, H, C,
        Dk * bits // 8]`` and ``vq`` ``[B, H, C, Dv * bits // 8]`` uint8 codes, ``k_scale`` / ``k_zero`` ``[B, H, n,
        Dk]`` per page and channel, ``v_scale`` / ``v_zero`` ``[B, H, C, Dv // G]`` per slot and group of ``G``
        channels.
    bias : torch.Tensor
        ``[B, H, C]`` additive mask, 0 (read) or ``-inf``.
    scale : float
        Softmax scale.
    bits : int
        Bits per code (2, 4 or 8).
    scratch : tuple of torch.Tensor, optional
        Flat uint8 and float32 buffers of at least ``C * max(Dk, Dv) * bits // 8`` elements (one code field) that an
        eager call converts the codes into, one field at a time, instead of allocating each field: on the CPU a
        fresh multi-megabyte tensor per field and layer costs page faults (a 4-bit read at 8k tokens: about a third
        of the read). Ignored under tracing or a dispatch mode.

    Returns
    -------
    tuple of torch.Tensor
        ``o`` ``[B, Hq, 1, Dv]`` float32 and ``lse`` ``[B, Hq, 1]`` (``-inf`` and ``o = 0`` for a row with no slot
        to read).
    """
    names = ("kq", "k_scale", "k_zero", "vq", "v_scale", "v_zero")
    args = (query, *(fields[name] for name in names), bias, scale, bits)
    if scratch is not None and runs_eagerly(query):
        return _read_codes(*args, scratch=scratch)
    return _quant_decode_eager(*args)


def _quant_decode(
    query: torch.Tensor, kq: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor, vq: torch.Tensor,
    v_scale: torch.Tensor, v_zero: torch.Tensor, bias: torch.Tensor, scale: float, bits: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`quant_decode` on the fields as arguments (the operator's implementation)."""
    return _read_codes(query, kq, k_scale, k_zero, vq, v_scale, v_zero, bias, scale, bits)


def _read_codes(
    query: torch.Tensor, kq: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor, vq: torch.Tensor,
    v_scale: torch.Tensor, v_zero: torch.Tensor, bias: torch.Tensor, scale: float, bits: int,
    scratch: Scratch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`_quant_decode`, each code field converted into ``scratch`` when given."""
    b, hq, q, dk = query.shape
    h, c = bias.shape[1], bias.shape[2]
    n = k_scale.shape[2]
    assert q == 1 and hq % h == 0 and n * (c // max(n, 1)) == c, (query.shape, bias.shape, k_scale.shape)
    g, p, per = hq // h, c // max(n, 1), 8 // bits
    qg = query.reshape(b, h, 1, g, dk).float()
    k_scale = k_scale.unsqueeze(3)  # [B, H, n, 1, Dk]
    kq = kq.view(b, h, n, p, -1)
    scores = torch.matmul(k_zero.unsqueeze(3).float(), qg.transpose(-1, -2)).transpose(-1, -2)
    for j in range(per):  # [B, H, n, G, P]
        field = _field(kq, j, bits, scratch).transpose(-1, -2)
        scores = scores + torch.matmul(qg[..., j::per] * k_scale[..., j::per], field)
    scores = scores.transpose(2, 3).reshape(b, h, g, c).mul_(scale).add_(bias.unsqueeze(2))
    top = scores.amax(-1, keepdim=True)
    top = top.masked_fill(torch.isneginf(top), 0.0)  # a row with nothing to read: every probability 0
    probs = scores.sub_(top).exp_()
    total = probs.sum(-1, keepdim=True)  # [B, H, G, 1]
    lse = top + total.log()
    groups = v_scale.shape[-1]
    vq = vq.view(b, h, c, groups, -1).transpose(2, 3).contiguous()  # [B, H, NG, C, G / per]
    weights = probs.unsqueeze(2) * v_scale.transpose(2, 3).unsqueeze(3)  # [B, H, NG, G, C]
    o = torch.stack([torch.matmul(weights, _field(vq, j, bits, scratch)) for j in range(per)], -1).flatten(-2)
    o = o + torch.matmul(probs, v_zero.float()).transpose(2, 3).unsqueeze(-1)  # [B, H, NG, G, G_v]
    o = o.transpose(2, 3).reshape(b, h, g, -1).div_(total.clamp(min=torch.finfo(torch.float32).tiny))
    return o.reshape(b, hq, 1, -1), lse.reshape(b, hq, 1)


quant_decode_op = torch.library.custom_op("pikv::quant_decode", _quant_decode, mutates_args=(), device_types="cpu")


@quant_decode_op.register_fake
def _quant_decode_fake(query, kq, k_scale, k_zero, vq, v_scale, v_zero, bias, scale, bits):
    b, hq, q, _ = query.shape
    dv = vq.shape[-1] * (8 // bits)
    return query.new_empty(b, hq, q, dv, dtype=torch.float32), query.new_empty(b, hq, q, dtype=torch.float32)


# traced code runs the implementation itself (inductor fuses it), a dispatch mode sees the operator
_quant_decode_eager = eager_direct(quant_decode_op, _quant_decode, _quant_decode, traced=_quant_decode)


def _quant_read(
    query: torch.Tensor, kq: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor, vq: torch.Tensor,
    v_scale: torch.Tensor, v_zero: torch.Tensor, bias: torch.Tensor, start: torch.Tensor, pages: torch.Tensor,
    lengths: torch.Tensor, scale: float, bits: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    used = int(lengths.max()) if lengths.numel() else 0
    pages = pages[..., :used]
    b, h, n = pages.shape
    present = pages >= 0
    flat = (start.unsqueeze(-1) + pages).clamp(min=0).reshape(-1)

    def gather(field: torch.Tensor, per_page: bool = False) -> torch.Tensor:
        out = field.index_select(0, flat)
        return out.view(b, h, n, *field.shape[1:]) if per_page else out.view(b, h, n * field.shape[1], *field.shape[2:])

    if not n:  # nothing planned in any row: a partial that merges away
        hq, dv = query.shape[1], vq.shape[-1] * (8 // bits)
        o = query.new_zeros(b, hq, 1, dv, dtype=torch.float32)
        return o, query.new_full((b, hq, 1), float("-inf"), dtype=torch.float32), pages.new_zeros(b, h)
    mask = gather(bias).view(b, h, n, -1).masked_fill(~present.unsqueeze(-1), float("-inf")).view(b, h, -1)
    attended = (mask == 0).sum(-1)
    keys = gather(kq), gather(k_scale, True), gather(k_zero, True)
    o, lse = _read_codes(query, *keys, gather(vq), gather(v_scale), gather(v_zero), mask, scale, bits)
    return o, lse, attended


quant_read = torch.library.custom_op("pikv::quant_read", _quant_read, mutates_args=(), device_types="cpu")
quant_read.__doc__ = """``torch.ops.pikv.quant_read(query, kq, k_scale, k_zero, vq, v_scale, v_zero, bias, start,
pages, lengths, scale, bits)``: a decode token over the planned pages of a quantised store, read as codes
(:func:`quant_decode`): ``pages`` ``[B, H, W]`` local ids (``-1`` padded) of the runs starting at ``start``
(``[B, H]``), each row's entries in use first (``lengths`` ``[B, H]``), over the pool's fields (``[N, P, ...]`` per
slot, ``k_scale`` / ``k_zero`` ``[N, Dk]`` per page, ``bias`` ``[N, P]``) -> ``(o [B, Hq, 1, Dv] float32, lse
[B, Hq, 1], attended [B, H])``. It gathers no more than the longest row's entries: what a compiled CPU step calls on a
plan that keeps the frame's width (a Quest plan over a store group). CPU only; nothing is checked here."""


@quant_read.register_fake
def _quant_read_fake(query, kq, k_scale, k_zero, vq, v_scale, v_zero, bias, start, pages, lengths, scale, bits):
    b, hq, q, _ = query.shape
    o = query.new_empty(b, hq, q, vq.shape[-1] * (8 // bits), dtype=torch.float32)
    return o, query.new_empty(b, hq, q, dtype=torch.float32), pages.new_empty(pages.shape[:2], dtype=torch.int64)
