"""Attention backends: ``(query, store, plan) -> Partial(o, lse)``, the seam between read policies and kernels.

``TorchBackend`` is the reference that runs everywhere: an exact read of uniform runs uses the pool's fields as
``[B, H, C, ...]`` views (no copy); any other plan gathers the planned pages into a scratch workspace. The slots a
query may read come from what every slot stores (``valid``, ``pos``) and the plan (:func:`readable`). A decode token
on the CPU goes through PyTorch's fused flash-attention kernel with that mask (one call: the query heads of a KV head
are its rows, GQA without copying keys), and so does a prefill chunk into a store that holds tokens already (one call
per chunk of query rows); attention mass, shard groups, keys and values of different head dims and other devices take
:func:`masked_attention`. A fused kernel that reads pages in place implements the same ``attend``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pikv_hf.attention.codes import Scratch, quant_decode
from pikv_hf.attention.merge import merge_partials, sink_partial
from pikv_hf.attention.packed import FLASH_CPU, packed_decode, packed_slots
from pikv_hf.attention.reference import _SCORE_BUDGET_BYTES, allowed_mask, masked_attention
from pikv_hf.kernels._triton import runs_eagerly
from pikv_hf.kernels.decode_quant import QUANT_FIELDS
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


def readable(ok: torch.Tensor, pos: torch.Tensor, plan: ReadPlan, qpos: torch.Tensor, p: int) -> torch.Tensor:
    """``ok`` (``[B, H, n * P]`` valid slots of the planned pages) restricted by the plan: slots of pages that are
    not read in full count only as sink or recent-window tokens."""
    if plan.page_full is None:
        return ok
    recent = sink_or_recent(pos, qpos[-1:], plan.n_sink, plan.window, plan.row_start)
    return ok & (plan.page_full.repeat_interleave(p, dim=-1) | recent)


def trimmed(plan: ReadPlan) -> ReadPlan:
    """``plan`` without the ``-1`` padding after its longest row's entries (its pages come first in every row), where
    the policy counted them (``ReadPlan.lengths``: a routed plan from its operator, or Quest's plans over a store
    group, are as wide as each frame and read a fraction of it; eager routed plans on the CPU are built trimmed). On
    the CPU only, outside compiled code: the longest is read back (no device to wait for), and a routed read of 2k
    tokens then gathers and attends about 2.2x faster (385 against 854 us per layer at SmolLM2's shape); on an
    accelerator the plan keeps its fixed width (the fused kernel reads each row's ``lengths``)."""
    if plan.lengths is None or plan.pages.device.type != "cpu" or torch.compiler.is_compiling():
        return plan
    used = int(plan.lengths.max()) if plan.lengths.numel() else 0
    if used == plan.pages.shape[-1]:
        return plan
    full = None if plan.page_full is None else plan.page_full[..., :used]
    return ReadPlan(plan.pages[..., :used], full, plan.n_sink, plan.window, plan.row_start, plan.lengths)


def fused_decode(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    check_empty: bool = True,
    attended: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token (``query`` ``[B, Hq, 1, D]``) over ``[B, H, C, D]`` keys / values with the additive mask
    ``bias`` (``[B, H, C]``, 0 or ``-inf``) through the CPU flash kernel, the query heads of a KV head as its rows:
    ``o [B, Hq, 1, D]`` float32 and ``lse [B, Hq, 1]``. ``check_empty``: rows with no readable slot get ``lse = -inf``
    (the kernel returns 0 there); a read that holds the newest token never has one. ``attended`` (``[B, H]``, the
    count of 0 entries of ``bias`` when the caller has it) finds those rows in one operator fewer."""
    b, hq, _, d = query.shape
    h = keys.shape[1]
    qg = query.reshape(b, h, hq // h, d).to(keys.dtype)
    o, lse = FLASH_CPU(qg, keys, values, 0.0, False, attn_mask=bias.unsqueeze(2), scale=scale)
    lse = lse.float()
    if check_empty:
        empty = torch.isneginf(bias).all(-1, keepdim=True) if attended is None else (attended == 0).unsqueeze(-1)
        lse = lse.masked_fill(empty, float("-inf"))
    return o.float().reshape(b, hq, 1, -1), lse.reshape(b, hq, 1)


def fused_prefill(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    ok: torch.Tensor,
    pos: torch.Tensor,
    qpos: torch.Tensor,
    sliding_window: int | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Several query rows (``query`` ``[B, Hq, q, D]`` at positions ``qpos`` ``[q]``) over ``[B, H, C, D]`` keys /
    values, each row reading the slots :func:`allowed_mask` of ``ok``, ``pos`` (``[B, H, C]``) lets it, through the
    CPU flash kernel: the query heads of a KV head times the query rows are its rows, in chunks of rows whose mask fits
    the score budget of :func:`masked_attention`. ``o [B, Hq, q, D]`` float32 and ``lse [B, Hq, q]`` (``-inf`` for a
    row with no readable slot, whose ``o`` the kernel leaves 0)."""
    b, hq, q, d = query.shape
    h, c = keys.shape[1], keys.shape[2]
    g = hq // h
    qg = query.reshape(b, h, g, q, d).to(keys.dtype)
    chunk = max(1, min(q, _SCORE_BUDGET_BYTES // max(1, b * hq * c * 4)))
    outs, lses = [], []
    for start in range(0, q, chunk):
        ok_rows = allowed_mask(ok, pos, qpos[start : start + chunk], sliding_window)
        n = ok_rows.shape[2]
        bias = torch.zeros(ok_rows.shape, dtype=keys.dtype, device=keys.device).masked_fill_(~ok_rows, float("-inf"))
        bias = bias.unsqueeze(2).expand(b, h, g, n, c).reshape(b, h, g * n, c)
        rows = qg[:, :, :, start : start + chunk].reshape(b, h, g * n, d)
        o, lse = FLASH_CPU(rows, keys, values, 0.0, False, attn_mask=bias, scale=scale)
        lse = lse.float().view(b, h, g, n).masked_fill(~ok_rows.any(-1).unsqueeze(2), float("-inf"))
        outs.append(o.float().view(b, h, g, n, -1))
        lses.append(lse)
    o = torch.cat(outs, dim=3).reshape(b, hq, q, -1)
    return o, torch.cat(lses, dim=3).reshape(b, hq, q)


class TorchBackend:
    """Gather + masked attention in torch ops; the reference every other backend is tested against.

    On the CPU, eager gathers go to a scratch workspace kept between calls (a fresh multi-megabyte tensor per decode
    step costs more in CPU page faults than the copy), keyed by field and dtype, and so do a quantised store's codes
    converted to float32 for its read (``_code_scratch``); its tensors never leave
    :meth:`attend`, so layers that attend one after the other may share a backend. On an accelerator and in compiled
    code a gather allocates its output (the caching allocator reuses memory; nothing is keyed by a stream or kept
    across a graph).
    """

    name = "torch"

    def __init__(self) -> None:
        self._workspace: dict[tuple, torch.Tensor] = {}

    def _gather(self, store: PagedStore, name: str, pages: torch.Tensor) -> torch.Tensor:
        field = store.pool[name]
        if field.device.type != "cpu" or torch.compiler.is_compiling():
            return store.pool.gather(name, pages)
        per_page = field[0].numel() if field.shape[0] else 0
        return store.pool.gather(name, pages, out=self._buffer(name, field.dtype, pages.numel() * per_page))

    def _buffer(self, name: str, dtype: torch.dtype, need: int) -> torch.Tensor:
        """The first ``need`` elements of the CPU workspace's buffer ``(name, dtype)``, grown when smaller."""
        buf = self._workspace.get((name, dtype))
        if buf is None or buf.numel() < need:
            buf = self._workspace[(name, dtype)] = torch.empty(need, dtype=dtype)
        return buf[:need]

    def _code_scratch(self, fields: dict[str, torch.Tensor]) -> Scratch | None:
        """Workspace buffers for one code field of ``fields`` at a time (``attention.codes.quant_decode``): on the
        CPU in eager code, else None (allocated per call)."""
        kq = fields["kq"]
        if kq.device.type != "cpu" or not runs_eagerly(kq):
            return None
        need = max(kq.numel(), fields["vq"].numel())
        return self._buffer("codes", torch.uint8, need), self._buffer("codes", torch.float32, need)

    def _gather_fields(
        self, store: PagedStore, flat: torch.Tensor, n: int, names: tuple[str, ...]
    ) -> dict[str, torch.Tensor]:
        """The fields ``names`` of the pool pages ``flat`` (``[B * H * n]`` valid ids) as ``[B, H, n * P, ...]``
        (``[B, H, n, ...]`` for a page field)."""
        b, h, p, specs = store.batch, store.heads, store.page_size, store.pool.specs
        return {
            name: self._gather(store, name, flat).view(b, h, n if specs[name].per_page else n * p, *specs[name].shape)
            for name in names
        }

    def _plan_fields(
        self, store: PagedStore, plan: ReadPlan, names: tuple[str, ...]
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """The fields ``names`` of the pages ``plan`` reads (as :meth:`read_fields`) and ``[B, H, n]`` bool, True for
        the planned entries that are real pages (None: all); no global page ids are built."""
        if plan.exact:
            fields, _, present = self.read_fields(store, plan, names, per_page=True)
            return fields, present
        present = plan.pages >= 0  # a padding entry (-1) maps below its run's start: gathered, never attended
        flat = (store.table.start.unsqueeze(-1) + plan.pages).clamp_(min=0).reshape(-1)
        return self._gather_fields(store, flat, present.shape[-1], names), present

    def read_fields(
        self, store: PagedStore, plan: ReadPlan, names: tuple[str, ...], per_page: bool = False
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
        """The fields ``names`` of the slots ``plan`` reads as ``[B, H, C, ...]`` (views of the pool for an exact
        read of uniform runs, a gather otherwise), the global page id of each planned page (``[B, H, n]``, ``-1``:
        none; None for a view of the whole frame: ``store.table.pages()``) and ``[B, H, C]`` bool, True for slots of
        real pages (None: all; ``per_page``: ``[B, H, n]``, per page)."""
        p, t = store.page_size, store.table
        if plan.exact and t.uniform:
            return {n: store.frame(n) for n in names}, None, None
        pages = t.pages(plan.pages)
        fields = self._gather_fields(store, pages.clamp(min=0).reshape(-1), pages.shape[-1], names)
        page_ok = pages >= 0
        return fields, pages, page_ok if p == 1 or per_page else page_ok.repeat_interleave(p, dim=-1)

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
        newest: bool = False,
        mass_lse: torch.Tensor | None = None,
    ) -> Partial:
        """Attention of ``query`` (``[B, Hq, q, Dk]`` at positions ``qpos`` ``[q]``) over what ``plan`` reads.

        ``groups > 1`` computes one partial per shard group (shard ``s`` in group ``s * groups // S``) and merges
        them exactly, as shards on several devices would be. ``newest``: the store holds the query's own token
        (every (row, head) has a slot to read). ``mass_lse`` (``[B, Hq, q]``): what ``want_mass``'s probabilities
        are normalised by when the queries read more than this store (``masked_attention``).
        """
        plan = trimmed(plan)
        if self._fusable(store, query.shape[2], groups, want_mass):
            return self._attend_fused(query, store, plan, qpos, scale, sliding_window, sinks, count, newest)
        p = store.page_size
        fields, pages, page_ok = self.read_fields(store, plan, (*store.kv_fields, "pos", "valid"))
        if pages is None and (groups > 1 or want_mass):
            pages = store.table.pages()
        ok = fields["valid"] if page_ok is None else fields["valid"] & page_ok
        ok = readable(ok, fields["pos"], plan, qpos, p)
        keys, values = store.codec.decode({name: fields[name] for name in store.kv_fields})
        if self._fusable(store, 1, groups, want_mass) and keys.shape[2]:  # a prefill chunk into a non-empty store
            o, lse = fused_prefill(query, keys, values, ok, fields["pos"], qpos, sliding_window, scale)
            if sinks is not None:
                o, lse = merge_partials([(o, lse), sink_partial(sinks, o)])
            attended = allowed_mask(ok, fields["pos"], qpos[-1:], sliding_window)[:, :, 0].sum(-1) if count else None
            return Partial(o, lse, attended=attended)
        shard = None
        if groups > 1:
            shard = store.pool["shard"][pages.clamp(min=0)].repeat_interleave(p, dim=-1).long().clamp(min=0)
        group = None if shard is None else shard * groups // store.num_shards
        o, lse, mass = masked_attention(
            query, keys, values, ok, fields["pos"], qpos, scale, sliding_window, sinks, group, groups, want_mass,
            mass_lse,
        )  # fmt: skip
        slots = None
        if want_mass:
            slots = pages.unsqueeze(-1) * p + torch.arange(p, device=store.device)
            slots = slots.flatten(2) if page_ok is None else torch.where(page_ok, slots.flatten(2), -1)
        attended = None
        if want_mass or count:
            attended = allowed_mask(ok, fields["pos"], qpos[-1:], sliding_window)[:, :, 0].sum(-1)
        return Partial(o, lse, mass, slots, attended)

    @staticmethod
    def _fusable(store: PagedStore, queries: int, groups: int, want_mass: bool) -> bool:
        """Whether a call goes through the CPU flash kernel: one decode token, no attention mass or shard groups,
        keys and values of one head dim."""
        return (
            FLASH_CPU is not None
            and queries == 1
            and not want_mass
            and groups == 1
            and store.device.type == "cpu"
            and store.k_dim == store.v_dim
        )

    def _attend_fused(
        self,
        query: torch.Tensor,
        store: PagedStore,
        plan: ReadPlan,
        qpos: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        sinks: torch.Tensor | None,
        count: bool,
        newest: bool,
    ) -> Partial:
        """A decode token through the flash kernel (quantised pages: read as codes, ``attention.codes``); the mask is
        the slots' stored ``bias``, restricted by the plan's pages and the sliding window where they apply."""
        restricted = plan.page_full is not None or sliding_window is not None
        whole = not plan.exact and store.page_size == 1 and not restricted  # planned one-token pages all hold one
        read = None
        if whole and store.codec.code_bits is None:
            read = self._attend_packed(query, store, plan, scale, count)
        elif not restricted and plan.lengths is not None and store.kv_fields == QUANT_FIELDS:
            read = self._attend_codes_op(query, store, plan, scale, count)
        if read is not None:
            o, lse, attended = read
            if sinks is not None:
                o, lse = merge_partials([(o, lse), sink_partial(sinks, o)])
            return Partial(o, lse, attended=attended)
        names = (*store.kv_fields, *(() if whole else ("bias",)), *(("pos",) if restricted else ()))
        fields, present = self._plan_fields(store, plan, names)
        if fields[store.kv_fields[0]].shape[2] == 0:  # a store with no page yet (a partition): a partial merging away
            b, hq = query.shape[:2]
            none = torch.zeros(store.batch, store.heads, dtype=torch.int64, device=query.device) if count else None
            empty = query.new_zeros(b, hq, 1, store.v_dim, dtype=torch.float32)
            return Partial(empty, torch.full((b, hq, 1), float("-inf"), device=query.device), attended=none)
        if whole:  # 0 for the planned pages' one slot, -inf for padding: log(1) and log(0)
            bias = present.to(store.dtype).log_()
            attended = present.sum(-1) if count else None
        else:
            bias = fields["bias"]
            if present is not None:  # padding entries of the plan: their pages' slots are not read
                b, h, n = present.shape
                bias = bias.view(b, h, n, -1).masked_fill(~present.unsqueeze(-1), float("-inf")).view(b, h, -1)
            keep = None
            if plan.page_full is not None:
                keep = plan.page_full.repeat_interleave(store.page_size, dim=-1)
                keep = keep | sink_or_recent(fields["pos"], qpos[-1:], plan.n_sink, plan.window, plan.row_start)
            if sliding_window is not None:
                near = qpos[-1:].to(torch.int64) - fields["pos"].to(torch.int64) < sliding_window
                keep = near if keep is None else keep & near
            if keep is not None:
                bias = bias.masked_fill(~keep, float("-inf"))
            attended = (bias == 0).sum(-1) if count else None
        if store.codec.code_bits is not None:
            o, lse = quant_decode(query, fields, bias, scale, store.codec.code_bits, self._code_scratch(fields))
        else:
            keys, values = store.codec.decode({name: fields[name] for name in store.kv_fields})
            o, lse = fused_decode(query, keys, values, bias, scale, check_empty=not newest, attended=attended)
        if sinks is not None:
            o, lse = merge_partials([(o, lse), sink_partial(sinks, o)])
        return Partial(o, lse, attended=attended)

    def _attend_packed(
        self, query: torch.Tensor, store: PagedStore, plan: ReadPlan, scale: float, count: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """A decode token over planned one-token pages, each (row, KV head) reading just its own pages
        (``attention.packed``): eager code gathers them packed into the workspace and decodes them with the store's
        codec; a compiled step on the CPU calls ``torch.ops.pikv.packed_read`` on an identity codec's fields, else
        None (the caller reads the plan as it is)."""
        start = store.table.start
        if not runs_eagerly(query):
            if not (torch.compiler.is_compiling() and store.kv_fields == ("keys", "values")):
                return None
            keys, values = (store.pool[name] for name in store.kv_fields)
            o, lse, lengths = torch.ops.pikv.packed_read(query, keys, values, start, plan.pages, scale)
            return o, lse, lengths if count else None
        lengths, flat = packed_slots(start, plan.pages)
        keys, values = store.codec.decode(
            {name: self._gather(store, name, flat).flatten(0, 1) for name in store.kv_fields}  # pages of one slot
        )
        o, lse = packed_decode(query, keys, values, lengths, scale)
        return o, lse, lengths if count else None

    @staticmethod
    def _attend_codes_op(
        query: torch.Tensor, store: PagedStore, plan: ReadPlan, scale: float, count: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """In a compiled step, a decode token over the planned pages of a quantised store as one operator,
        ``torch.ops.pikv.quant_read``, which reads no more than the plan's longest row (a Quest plan over a store
        group keeps its frame's width there); None elsewhere (eager code trimmed the plan already)."""
        if not torch.compiler.is_compiling():
            return None
        pool = store.pool
        fields = (pool[name] for name in QUANT_FIELDS)
        bits = store.codec.code_bits
        o, lse, attended = torch.ops.pikv.quant_read(
            query, *fields, pool["bias"], store.table.start, plan.pages, plan.lengths, scale, bits
        )
        return o, lse, attended if count else None

    def workspace_nbytes(self) -> int:
        """Bytes held by the CPU workspace: gathers and code conversion buffers (not part of the stored KV)."""
        return sum(t.numel() * t.element_size() for t in self._workspace.values())

    def reset(self) -> None:
        self._workspace.clear()
