"""Attention backends: ``(query, store, plan) -> Partial(o, lse)``, the seam between read policies and kernels.

``TorchBackend`` is the reference that runs everywhere: an exact read of uniform runs uses the pool's fields as
``[B, H, C, ...]`` views (no copy); any other plan gathers the planned pages into a scratch workspace and runs
:func:`masked_attention` on them. A fused kernel that reads pages in place implements the same ``attend``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pikv_hf.attention.reference import allowed_mask, masked_attention
from pikv_hf.read.plan import ReadPlan, sink_or_recent
from pikv_hf.store import PagedStore


@dataclass
class Partial:
    """One attention call's result over the slots it read.

    Attributes
    ----------
    o, lse : torch.Tensor
        ``[B, Hq, q, Dv]`` float32 output and ``[B, Hq, q]`` log-sum-exp of the logits (mergeable).
    mass, slots : torch.Tensor or None
        With ``want_mass``: ``[B, H, C]`` attention probability of each slot read (summed over the query rows of
        its KV head) and its flat pool slot id (``-1``: not a slot).
    attended : torch.Tensor or None
        With ``want_mass`` or ``count``: ``[B, H]`` slots the last query row may attend.
    """

    o: torch.Tensor
    lse: torch.Tensor
    mass: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    attended: torch.Tensor | None = None


def _stream_key(device: torch.device) -> int | None:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None


class TorchBackend:
    """Gather + masked attention in torch ops; the reference every other backend is tested against.

    Gathers go to a scratch workspace kept between calls (a fresh multi-megabyte tensor per decode step costs more
    in CPU page faults than the copy). It is keyed by field, dtype, device and CUDA stream, and its tensors never
    leave :meth:`attend`, so layers that attend one after the other on one stream may share a backend.
    """

    name = "torch"

    def __init__(self) -> None:
        self._workspace: dict[tuple, torch.Tensor] = {}

    def _gather(self, store: PagedStore, name: str, pages: torch.Tensor) -> torch.Tensor:
        field = store.pool[name]
        per_page = field[0].numel() if field.shape[0] else 0
        need = pages.numel() * per_page
        key = (name, field.dtype, field.device, _stream_key(field.device))
        buf = self._workspace.get(key)
        if buf is None or buf.numel() < need:
            buf = self._workspace[key] = field.new_empty(need)
        return store.pool.gather(name, pages, out=buf[:need])

    def attend(
        self,
        query: torch.Tensor,
        store: PagedStore,
        plan: ReadPlan,
        qpos: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
        groups: int = 1,
        want_mass: bool = False,
        count: bool = False,
    ) -> Partial:
        """Attention of ``query`` (``[B, Hq, q, Dk]`` at positions ``qpos`` ``[q]``) over what ``plan`` reads.

        ``groups > 1`` computes one partial per shard group (shard ``s`` in group ``s * groups // S``) and merges
        them exactly, as shards on several devices would be.
        """
        b, h, p = store.batch, store.heads, store.page_size
        t = store.table
        if plan.exact and t.uniform:
            fields = {n: store.frame(n) for n in (*store.kv_fields, "pos", "valid")}
            ok = fields["valid"]
            shard = store.frame("shard").repeat_interleave(p, dim=-1) if groups > 1 else None
            slots = store.frame_slots() if want_mass else None
        else:
            local = plan.pages
            if local is None:
                local = torch.arange(t.width(), device=store.device).expand(b, h, -1)
            pages = t.pages(local)
            flat = pages.clamp(min=0).reshape(-1)
            n = local.shape[-1]
            specs = store.pool.specs
            fields = {
                name: self._gather(store, name, flat).view(
                    b, h, n if specs[name].per_page else n * p, *specs[name].shape
                )
                for name in (*store.kv_fields, "pos", "valid")
            }
            page_ok = (pages >= 0).repeat_interleave(p, dim=-1)
            ok = fields["valid"] & page_ok
            if plan.page_full is not None:
                recent = sink_or_recent(fields["pos"], int(qpos[-1]), plan.n_sink, plan.window, plan.row_start)
                ok = ok & (plan.page_full.repeat_interleave(p, dim=-1) | recent)
            shard = store.pool["shard"][flat].view(b, h, n).repeat_interleave(p, dim=-1) if groups > 1 else None
            slots = None
            if want_mass:
                slots = (pages.unsqueeze(-1) * p + torch.arange(p, device=store.device)).view(b, h, n * p)
                slots = torch.where(page_ok, slots, -1)
        keys, values = store.codec.decode({name: fields[name] for name in store.kv_fields})
        group = None if shard is None else shard.clamp(min=0) * groups // store.num_shards
        o, lse, mass = masked_attention(
            query, keys, values, ok, fields["pos"], qpos, scale, sliding_window, sinks, group, groups, want_mass
        )
        attended = None
        if want_mass or count:
            attended = allowed_mask(ok, fields["pos"], qpos[-1:], sliding_window)[:, :, 0].sum(-1)
        return Partial(o, lse, mass, slots, attended)

    def workspace_nbytes(self) -> int:
        """Bytes held by the gather workspace (not part of the stored KV)."""
        return sum(t.numel() * t.element_size() for t in self._workspace.values())

    def reset(self) -> None:
        self._workspace.clear()
