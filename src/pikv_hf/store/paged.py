"""``PagedStore``: the expert-sharded paged KV of one layer on one device (pool + page table + shard statistics).

Every token lives in one slot of one page; every page belongs to one shard and to one (batch row, KV head), whose
page table run lists it (``table.py``). Per slot the pool holds the codec's key/value fields and:

============  ========  ==========================================================================
pos           int32     the token's sequence position (the layer's token ordinal, pads included); -1: empty
valid         bool      False for empty slots
bias          model     0 for a token, -inf for an empty slot: the additive attention mask of an exact read
attn_mass     float32   accumulated attention probability (``track_stats``)
last_access   int32     position of the latest query that hit the slot (its own position until one does)
hits          int32     queries that gave it more than a uniform share of their mass
============  ========  ==========================================================================

(the three statistics only with ``track_stats``) and per page ``shard`` (int16, -1 unused: at most ``MAX_SHARDS``
shards) and, once Quest reads are asked for, ``key_min`` / ``key_max``.

The *frame* of the store is ``[B, H, W * P]``: the pages ``0 .. W - 1`` of every run (``PageTable.width``). While
runs are uniform a field's frame is a view of the pool; after ragged eviction it is a gather.
"""

from __future__ import annotations

import torch

from pikv_hf.checks import check_int_at_least
from pikv_hf.codecs import Codec, IdentityCodec
from pikv_hf.kernels.append import append_one
from pikv_hf.routing.base import ShardSummary
from pikv_hf.store.bounds import add_page_bounds, fold_page_bounds, rebuild_page_bounds
from pikv_hf.store.page_codec import append_to_pages, encode_pages
from pikv_hf.store.pool import FieldSpec, PagePool
from pikv_hf.store.repack import repack
from pikv_hf.store.special import SpecialSlots
from pikv_hf.store.summary import ShardStats
from pikv_hf.store.table import PageTable

SHARD_DTYPE = torch.int16  # a page's shard id: 2 bytes a page (a routed page of one token holds one token)
MAX_SHARDS = torch.iinfo(SHARD_DTYPE).max
MAX_PAGE_SIZE = 2**16  # tokens per page
MAX_POSITION = torch.iinfo(torch.int32).max  # a slot's position is int32


def check_num_shards(num_shards: object) -> None:
    """``ValueError`` naming ``num_shards`` unless it is an integer in ``[1, MAX_SHARDS]`` (a page's shard id is
    ``SHARD_DTYPE``: a larger id would wrap)."""
    check_int_at_least("num_shards", num_shards, 1)
    if num_shards > MAX_SHARDS:
        raise ValueError(f"num_shards must be at most {MAX_SHARDS} (a page's shard id is int16), got {num_shards}")


def check_page_size(page_size: object) -> None:
    """``ValueError`` naming ``page_size`` unless it is an integer in ``[1, MAX_PAGE_SIZE]`` (every shard of every
    (row, KV head) opens a page at its first token: a page of millions of slots asked the allocator for terabytes)."""
    check_int_at_least("page_size", page_size, 1)
    if page_size > MAX_PAGE_SIZE:
        raise ValueError(f"page_size must be at most {MAX_PAGE_SIZE} tokens, got {page_size}")


_META_FIELDS = {
    "pos": FieldSpec((), torch.int32, -1),
    "valid": FieldSpec((), torch.bool, False),
    "shard": FieldSpec((), SHARD_DTYPE, -1, per_page=True),
}
_STAT_SPECS = {
    "attn_mass": FieldSpec((), torch.float32),
    "last_access": FieldSpec((), torch.int32),
    "hits": FieldSpec((), torch.int32),
}
STAT_FIELDS = tuple(_STAT_SPECS)


class PagedStore:
    """Paged, sharded KV storage of one layer.

    Parameters
    ----------
    batch, heads : int
        Batch rows ``B`` and KV heads ``H``.
    k_dim, v_dim : int
        Key and value head dims (they may differ, as in DeepSeek).
    num_shards, page_size : int
        Shards ``S`` per (row, head) and slots ``P`` per page.
    dtype, device
        Model dtype of keys and values; device of every tensor.
    codec : Codec, optional
        How pages hold keys and values (default: identity).
    track_stats : bool
        Hold the per-slot attention statistics (``attn_mass``, ``last_access``, ``hits``).
    storage : str or None
        Where a CPU store's pool lives (``PagePool``: ``"pinned"`` or a directory of memory-mapped files).
    """

    def __init__(
        self,
        batch: int,
        heads: int,
        k_dim: int,
        v_dim: int,
        num_shards: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        codec: Codec | None = None,
        track_stats: bool = False,
        storage: str | None = None,
    ) -> None:
        check_num_shards(num_shards)
        check_page_size(page_size)
        self.k_dim, self.v_dim, self.dtype, self.device = int(k_dim), int(v_dim), dtype, device
        self.num_shards, self.page_size = int(num_shards), int(page_size)
        self.codec = codec or IdentityCodec()
        codec_fields = self.codec.fields(self.k_dim, self.v_dim, dtype)
        self.kv_fields = tuple(codec_fields)
        specs = {**codec_fields, **_META_FIELDS, "bias": FieldSpec((), dtype, float("-inf"))}
        self.pool = PagePool({**specs, **(_STAT_SPECS if track_stats else {})}, page_size, device, storage)
        self.table = PageTable(batch, heads, num_shards, page_size, device)
        self.stats = ShardStats(batch, heads, num_shards, self.k_dim, device)
        self._sums_stale = False  # key sums lost track after a re-pack: recounted when a selector reads them
        self._bounds_stale = False  # shard min / max too: a re-pack moved tokens between shards (pooled tails)
        self._summarised = False  # key sums kept at all (from keep_summaries() on; counts always; bounds: summary())
        self._room = 0  # pages every run could still take when last counted (a lower bound, kept on the host)
        self._since = 0  # decode tokens per run appended since (append_one): the pages they opened are bounded
        self._first: int | None = None  # the ordinal of the first of them, when known on the host
        self._reserved = 0  # capacity every run keeps through re-packs (reserve)
        self.repacks = 0  # re-packs so far (evictions, crops, moves to a tier)
        self._marks: SpecialSlots | None = None  # the sink and recent-window slots (special_slots), kept on appends
        # stores whose tokens this store's shard key sums, squares and bounds count too: a layer's tiers, which
        # receive their tokens from this store (LayerStores.tier); every recount reads their pages as well
        self.summed_with: list[PagedStore] = []

    @property
    def batch(self) -> int:
        return self.table.batch

    @property
    def heads(self) -> int:
        return self.table.heads

    @property
    def stat_fields(self) -> tuple[str, ...]:
        return tuple(n for n in STAT_FIELDS if n in self.pool.fields)

    @property
    def reserved(self) -> bool:
        """Whether the runs keep a reserved capacity (:meth:`reserve`, ``max_cache_len``)."""
        return self._reserved > 0

    @property
    def page_bounds_kept(self) -> bool:
        return "key_min" in self.pool.fields

    # ------------------------------------------------------------------ layout
    def _relayout(self, cap: torch.Tensor, src_start: torch.Tensor, n_pages: torch.Tensor) -> None:
        """Runs of capacity ``cap``; run ``i`` takes the ``n_pages[i]`` pages starting at old page ``src_start[i]``."""
        total = self.table.set_caps(cap)
        src = torch.full((total,), -1, dtype=torch.int64, device=self.device)
        j = torch.arange(int(n_pages.max()) if n_pages.numel() else 0, device=self.device)
        used = j < n_pages.unsqueeze(-1)
        src[(self.table.start.unsqueeze(-1) + j)[used]] = (src_start.unsqueeze(-1) + j)[used]
        self.pool.remap_pages(src)
        self._marks = None  # pages moved: slot ids changed
        self._set_room(int((cap - n_pages).min()) if cap.numel() else 0)

    def _set_room(self, room: int) -> None:
        self._room, self._since, self._first = room, 0, None

    def _reserve(self, need: torch.Tensor, q: int) -> None:
        """Grow the runs that need more than ``need`` (``[B, H]``) pages, with 1/64 headroom (uniform stays uniform).

        An append of ``q`` tokens opens at most ``min(q, S) + q // P`` pages per run; while every run has that much
        room (``_room``, counted down on the host) nothing is read back from the device."""
        t = self.table
        most = min(q, self.num_shards) + q // self.page_size
        left = self._room - self._opened(self._since, False)  # room the decode tokens since the count may have left
        if left >= most:
            self._set_room(left - most)
            return
        room = int((t.cap - need).min())
        self._set_room(room if room >= 0 else self._grow(need))

    def _grow(self, need: torch.Tensor) -> int:
        """Give every run short of ``need`` (``[B, H]``) pages that many plus 1/64 headroom (uniform runs all the
        largest need: uniform stays uniform); returns the room left beyond ``need`` in the least roomy run."""
        t = self.table
        if t.uniform:
            top = int(need.max())
            cap = torch.full_like(t.cap, top + top // 64)
        else:
            cap = torch.where(need > t.cap, need + need // 64, t.cap)
        self._relayout(cap, t.start, t.n_pages)
        return int((cap - need).min())

    def _opened(self, n: int, round_robin: bool, first: int | None = None) -> int:
        """Most pages one run can have opened for ``n`` decode tokens. A shard given ``n_j`` of them opens at most
        ``ceil(n_j / P)``: summed, ``n // P`` plus one per shard left with a partial page. Under the page-granular
        round robin the tokens of one group of ``P`` ordinals all go to one shard and open at most one page
        (whatever its open page held before), so the groups the ordinals ``first .. first + n - 1`` touch bound it
        (``first`` None: unknown alignment, as in a left-padded batch)."""
        p = self.page_size
        if n == 0 or p == 1:
            return n
        if round_robin:
            return min(n, (n - 1) // p + 2 if first is None else (first % p + n - 1) // p + 1)
        return n // p + min(self.num_shards, n)

    def _reserve_one(self, round_robin: bool, position: int | None) -> None:
        """Room for one more token per run (``position``: its ordinal, the same in every row, when known on the
        host). While the pages the decode tokens since the last count can have opened stay within the room counted
        then, nothing is read back from the device: under the round robin a count comes once per page (when the
        tokens enter a new group), otherwise about every ``P * cap / 128`` steps with the 1/64 headroom. A count
        that finds a run full grows it to one page more than it uses, plus 1/64: the next page is reserved before a
        token needs it (the operator cannot grow a run)."""
        n = self._since + 1
        if self._opened(n, round_robin, self._first) <= self._room:
            self._since = n
            return
        t = self.table
        room = int((t.cap - t.n_pages).min()) if t.cap.numel() else 0
        if room < 1:
            room = self._grow(t.n_pages + 1) + 1
        self._room, self._since, self._first = room, 1, position

    # ------------------------------------------------------------------ writes
    def reserve(self, pages: int, shrink: bool = False) -> None:
        """Give every run a capacity of ``pages`` pages now and after every re-pack (uniform), so that appends within
        it never move the pool; with ``append(..., grow=False)`` an append is then free of host synchronisation
        (``torch.compile``). ``shrink``: also give back capacity past ``pages`` (never below the pages in use)."""
        t = self.table
        self._reserved = pages
        if shrink and t.width() > pages:
            self._relayout(torch.full_like(t.cap, max(pages, int(t.n_pages.max()))), t.start, t.n_pages)
        elif pages > t.width() or not t.uniform:
            self._relayout(torch.full_like(t.cap, max(pages, int(t.cap.max()))), t.start, t.n_pages)

    def append(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        shard: torch.Tensor,
        pos: torch.Tensor,
        present: torch.Tensor | None = None,
        grow: bool = True,
        row_start: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store new tokens in their shards' pages.

        Parameters
        ----------
        keys, values : torch.Tensor
            ``[B, H, q, Dk]`` and ``[B, H, q, Dv]``.
        shard : torch.Tensor
            ``[B, H, q]`` int64 shard ids in ``[0, S)``.
        pos : torch.Tensor
            ``[q]`` or ``[B, H, q]`` sequence positions.
        present : torch.Tensor, optional
            ``[B, H, q]`` bool: only these tokens are stored (a partition of a distributed layer holds only its
            own shards); the others take no slot and stay out of this store's shard statistics. Default: all.
        grow : bool
            Grow the runs that need more pages. False: the capacity reserved beforehand (:meth:`reserve`) must
            suffice; nothing is checked (no host synchronisation), and a run past its capacity writes into its own
            last page (never another run's; ``table.n_pages`` then exceeds ``table.cap``).
        row_start : torch.Tensor, optional
            ``[B]`` position of each row's first real token (default 0): where a decode token's row counts its sinks
            (the special slots, once found, are kept as tokens arrive).

        Returns
        -------
        torch.Tensor
            ``[B, H, q]`` int64 flat pool slot id of every token (``-1`` for tokens not present).
        """
        b, h, q = shard.shape
        positions = pos  # [q] or [B, H, q]
        a = self.table.assign(shard, present)
        if grow:
            self._reserve(a.need, q)
        self.table.commit(a)
        local = a.local_page
        if not grow:  # saturate: a run past its reservation (compiled code, unchecked) overwrites its own last page
            local = torch.minimum(local, self.table.cap.unsqueeze(-1) - 1)
        slot = (self.table.start.unsqueeze(-1) + local) * self.page_size + a.offset
        flat_tokens = (
            keys.reshape(-1, self.k_dim),
            values.reshape(-1, self.v_dim),
            shard.reshape(-1),
            pos.to(torch.int32).expand(b, h, q).reshape(-1),
            self._bhs(shard).reshape(-1),
            slot.reshape(-1),
        )
        if present is not None:
            slot = slot.masked_fill(~present, -1)
            take = present.reshape(-1)
            flat_tokens = tuple(x[take] for x in flat_tokens)
        k, v, sh, pos, bhs, flat = flat_tokens
        self.pool.write("pos", flat, pos)
        self.pool.flat("valid").index_fill_(0, flat, True)
        self.pool.flat("bias").index_fill_(0, flat, 0.0)
        self.pool["shard"].index_copy_(0, flat.div(self.page_size, rounding_mode="floor"), sh.to(SHARD_DTYPE))
        self.stats.add(bhs, k, counts_only=not self._summarised)
        self._write_tokens(flat, k, v, pos, kv_written=False)
        if q > 1:  # a chunk (or tokens moved in from another store) may hold sinks: found again when next asked
            self._marks = None
        elif self._marks is not None:
            self._marks.push(slot, positions, row_start)
        return slot

    def append_one(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        shard: torch.Tensor | None,
        pos: torch.Tensor,
        row_start: torch.Tensor | None = None,
        grow: bool = True,
        position: int | None = None,
    ) -> torch.Tensor:
        """:meth:`append` of one token per (row, head), every token present: a decode step.

        ``keys`` / ``values`` ``[B, H, 1, D]``; ``shard`` ``[B, H, 1]``, or None for the page-granular round robin on
        each row's token ordinal (``pos - row_start``, ``row_start`` ``[B]`` or None: 0); ``pos`` ``[1]``: the tokens'
        sequence position (``position``: the same as a host int, when known and every row counts from 0). Slot
        assignment and the writes of the token, its page's shard, the shard's count and (once kept) key statistics
        are one operator (``pikv_hf.kernels.append``: one kernel launch on CUDA), with Quest's page bounds once kept
        and the token's entries among the special slots once found (a recent one; a sink while its row is short); a
        codec's encoding and slot statistics follow. Returns ``[B, H, 1]`` flat slots."""
        if grow:
            self._reserve_one(shard is None, position)
        t, pool = self.table, self.pool
        sums = self.stats.key_stats() if self._summarised else (None,) * 4
        identity = isinstance(self.codec, IdentityCodec)
        bounds = (pool["key_min"], pool["key_max"]) if self.page_bounds_kept else (None, None)
        marks = self._marks
        kept = marks is not None and (marks.n_sink or marks.window)
        ring = (marks.slots, marks.pos, marks.n_sink, marks.window) if kept else (None, None, 0, 0)
        slot = append_one(
            t.open_page, t.open_fill, t.n_pages, t.start, None if grow else t.cap,
            None if shard is None else shard.squeeze(-1), row_start, pos, keys.squeeze(2), values.squeeze(2),
            pool["keys"] if identity else None, pool["values"] if identity else None,
            pool["pos"], pool["valid"], pool["bias"], pool["shard"], self.stats.count, *sums, *bounds, *ring,
        ).unsqueeze(-1)  # fmt: skip
        k, v = keys.reshape(-1, self.k_dim), values.reshape(-1, self.v_dim)
        self._write_tokens(slot.view(-1), k, v, pos, kv_written=identity, bounds_written=True)
        return slot

    def _write_tokens(
        self,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pos: torch.Tensor,
        kv_written: bool,
        bounds_written: bool = False,
    ) -> None:
        """What an append writes past the slot bookkeeping, for tokens at flat ``slots`` (``[M]``), keys / values
        ``[M, D]`` and positions ``pos`` (``[M]``, or ``[1]`` for all): their codec's fields (a page-level codec
        re-encodes their pages; ``kv_written``: identity K/V already written), slot statistics (inserting a token
        counts as its last access) and Quest's page bounds (unless ``bounds_written``)."""
        if self.codec.page_level:
            append_to_pages(self.pool, self.codec, self.kv_fields, slots, k, v, self.page_heads())
        elif not kv_written:
            for name, field in self.codec.encode(k, v).items():
                self.pool.write(name, slots, field)
        for name in self.stat_fields:
            fresh = pos.expand(slots.numel()) if name == "last_access" else torch.zeros_like(slots)
            self.pool.write(name, slots, fresh)
        if not self.page_bounds_kept:
            return
        if not self.codec.lossless:  # bounds of what a read decodes: a page-level codec re-encodes its older keys too
            pages = slots.div(self.page_size, rounding_mode="floor").unique()
            decoded = self.codec.decode({n: self.pool.gather(n, pages) for n in self.kv_fields})[0]
            rebuild_page_bounds(self.pool, decoded, pages)
        elif not bounds_written:
            fold_page_bounds(self.pool, slots.div(self.page_size, rounding_mode="floor"), k)

    def special_slots(self, n_sink: int, window: int, row_start: torch.Tensor) -> SpecialSlots:
        """The flat slots (``[B, H, n_sink + window]``, ``-1``: none) and positions of each (row, head)'s first
        ``n_sink`` real tokens (positions counted from ``row_start``) and of its ``window`` most recently stored ones:
        what sparse reads always read (:class:`SpecialSlots`); a caller restricts the recent ones to its window's
        positions (``SpecialSlots.unread``)."""
        if self._marks is None or not self._marks.fits(n_sink, window):
            pos, valid = self.frame("pos").to(torch.int64), self.frame("valid")
            self._marks = SpecialSlots.scan(pos, valid, self.frame_slots(), n_sink, window, row_start)
        return self._marks

    def page_heads(self) -> torch.Tensor:
        """``[N]`` int64 KV head owning each pool page (runs lie back to back in (row, head) order)."""
        run = torch.arange(self.batch * self.heads, device=self.device).repeat_interleave(self.table.cap.reshape(-1))
        return run % self.heads

    def _bhs(self, shard: torch.Tensor) -> torch.Tensor:
        """Flat ``(row, head, shard)`` index of ``[B, H, n]`` shard ids."""
        b, h, _ = shard.shape
        bh = torch.arange(b * h, device=shard.device).view(b, h, 1)
        return bh * self.num_shards + shard

    def retain(self, keep: torch.Tensor, pool_tails: bool = True) -> torch.Tensor:
        """Keep only the frame slots where ``keep`` (``[B, H, W * P]`` bool) is True; returns ``[B, H]`` valid tokens
        removed.

        Kept tokens are re-packed shard by shard in position order into exactly as many pages as they need, with
        their statistics; with ``pool_tails`` the shards' partly filled pages are pooled so that at most one page per
        (row, head) is partly filled (``repack.py``: a few tokens change shard), else one per (row, head, shard). The
        pool is reallocated to that size (or to the capacity ``reserve`` keeps), so freed pages are really released.
        One copy of the kept slots; no token is re-appended.
        """
        p, s = self.page_size, self.num_shards
        slots = self.frame_slots()
        valid = self.frame("valid") & (slots >= 0)
        kept = keep & valid
        removed = valid & ~kept
        shard = self.frame("shard").long().clamp(min=0).repeat_interleave(p, dim=-1)
        r = repack(kept, slots, shard, self.frame("pos"), p, s, pool_tails)
        t = self.table
        n_pages = r.n_pages.sum(-1)
        total = t.set_caps(n_pages.clamp(min=self._reserved))
        page = (t.start.unsqueeze(-1) + r.local)[r.ok]
        shard_of_page = torch.full((total,), -1, dtype=SHARD_DTYPE, device=self.device)
        shard_of_page.index_copy_(0, page, r.shard[r.ok].to(SHARD_DTYPE))
        src_of_slot = torch.full((total * p,), -1, dtype=torch.int64, device=self.device)
        src_of_slot[page * p + (r.rank % p)[r.ok]] = r.src
        bounds = self.page_bounds_kept
        page_values, redo = {"shard": shard_of_page}, None
        if self.codec.page_level:
            # a new page whose tokens all come from one old page keeps that page's fields (its codes stay valid: a
            # crop keeps a quantised page's values as they were); the others are re-encoded from decoded content
            src_page = torch.where(src_of_slot >= 0, src_of_slot.div(p, rounding_mode="floor"), -1).view(total, p)
            first = src_page.amax(-1)
            whole = (first >= 0) & ((src_page == first.unsqueeze(-1)) | (src_page < 0)).all(-1)
            at = first.clamp(min=0)
            for name, spec in self.pool.specs.items():
                if spec.per_page and name != "shard":
                    page_values[name] = self.pool.gather(name, at)
            redo = (~whole).nonzero().squeeze(-1)
            if redo.numel():  # decoded before the slots move
                dec_k, dec_v = self._decoded()
        self.pool.remap_slots(src_of_slot, page_values)
        self._marks = None  # slots moved
        if redo is not None and redo.numel():
            take = src_of_slot.view(total, p).index_select(0, redo).clamp(min=0).reshape(-1)
            keys = dec_k.reshape(-1, self.k_dim)[take].view(-1, p, self.k_dim)
            values = dec_v.reshape(-1, self.v_dim)[take].view(-1, p, self.v_dim)
            fresh = torch.zeros(redo.numel(), p, dtype=torch.bool, device=self.device)
            old = {name: self.pool.gather(name, redo) for name in self.pool.fields}
            encode_pages(self.pool, self.codec, redo, keys, values, fresh, old, self.page_heads()[redo])
        used = r.count > 0
        t.n_pages = n_pages
        t.open_page = torch.where(used, r.page_base + r.n_pages - 1, -1)
        t.open_fill = torch.where(used, r.count - (r.n_pages - 1) * p, p)
        self.stats.count = r.count
        self.repacks += 1
        self._sums_stale = True  # recounted from the pages when a selector next reads them (exact reads never do)
        self._bounds_stale |= r.moved
        self._set_room(int((t.cap - n_pages).min()) if n_pages.numel() else 0)
        if bounds:
            rebuild_page_bounds(self.pool, self._decoded()[0])
        return removed.sum(-1)

    def index_batch(self, index: torch.Tensor) -> None:
        """Keep / reorder batch rows along ``index`` (int64 ``[B']``)."""
        self._marks = None
        t = self.table
        src_start, cap = t.start.index_select(0, index), t.cap.index_select(0, index)
        t.index_batch(index)
        self._relayout(cap, src_start, t.n_pages)
        self.stats.index_batch(index)

    def add_stats(self, slots: torch.Tensor, mass: torch.Tensor, hit: torch.Tensor, step: torch.Tensor) -> None:
        """Add attention ``mass`` (float32) and ``hit`` (bool) of the flat slot ids ``slots`` (all ``[M]``, ``-1``:
        skip); hit slots get ``last_access = step`` (a one-element tensor: positions only grow, so the largest wins).
        Tensor operations only (no host read)."""
        ok = slots >= 0
        at = slots.clamp(min=0)
        self.pool.flat("attn_mass").index_add_(0, at, mass * ok)
        self.pool.flat("hits").index_add_(0, at, (hit & ok).to(torch.int32))
        last = torch.where(hit & ok, step.to(torch.int32).reshape(()), -1)
        self.pool.flat("last_access").scatter_reduce_(0, at, last, "amax")

    def enable_stats(self) -> None:
        """Hold the per-slot attention statistics from now on (zero mass and hits; a token's last access is its
        insertion)."""
        if "attn_mass" not in self.pool.fields:
            for name, spec in _STAT_SPECS.items():
                self.pool.add_field(name, spec)
            self.pool["last_access"].copy_(self.pool["pos"])

    def to(self, device: torch.device) -> None:
        """Move every tensor (pool, page table, shard statistics) to ``device``."""
        self._marks = None
        self.device = self.pool.device = self.table.device = device
        self.pool.fields = {n: t.to(device, non_blocking=True) for n, t in self.pool.fields.items()}
        for owner, names in (
            (self.table, ("start", "cap", "n_pages", "open_page", "open_fill")),
            (self.stats, ("sum", "sq", "count", "min", "max")),
        ):
            for name in names:
                if getattr(owner, name) is not None:  # shard key statistics exist once summaries are kept
                    setattr(owner, name, getattr(owner, name).to(device, non_blocking=True))

    # ------------------------------------------------------------------ reads
    def frame_slots(self) -> torch.Tensor:
        """``[B, H, W * P]`` flat pool slot id of every frame slot (``-1`` past a run's capacity)."""
        pages = self.table.pages()
        slots = (pages.unsqueeze(-1) * self.page_size + torch.arange(self.page_size, device=self.device)).flatten(2)
        return torch.where(pages.repeat_interleave(self.page_size, dim=-1) >= 0, slots, -1)

    def frame(self, name: str) -> torch.Tensor:
        """Field ``name`` over the frame: ``[B, H, W * P, ...]`` for a slot field, ``[B, H, W, ...]`` for a page field.
        A view of the pool while runs are uniform, a gathered copy otherwise."""
        t = self.table
        b, h, w, p = self.batch, self.heads, t.width(), self.page_size
        spec = self.pool.specs[name]
        per = (w,) if spec.per_page else (w * p,)
        if t.uniform:
            return self.pool[name].view(b, h, *per, *spec.shape)
        pages = t.pages().reshape(-1)
        g = self.pool.gather(name, pages.clamp(min=0))
        g.masked_fill_((pages < 0).view(-1, *([1] * (g.dim() - 1))), spec.fill)  # frame pages past a run's end
        return g.reshape(b, h, *per, *spec.shape)

    def frame_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded keys ``[B, H, W * P, Dk]`` and values ``[B, H, W * P, Dv]`` over the frame."""
        return self.codec.decode({n: self.frame(n) for n in self.kv_fields})

    def write_slots(self, name: str, slots: torch.Tensor, new: torch.Tensor) -> None:
        """Overwrite the ``name`` (``"keys"`` / ``"values"``) of flat ``slots`` (``[M]``) with ``new`` (``[M, D]``)
        in a store that keeps them as they are (identity codec): the tokens stay in their slots; new keys leave the
        shard key statistics to be recounted when next read and rebuild Quest's page bounds."""
        if not isinstance(self.codec, IdentityCodec):
            raise ValueError(
                f"{name} can be overwritten in a store that keeps them as they are; this one encodes them with "
                f"{type(self.codec).__name__}"
            )
        self.pool.write(name, slots, new)
        if name == "keys":
            self._sums_stale = self._bounds_stale = True
            if self.page_bounds_kept:
                rebuild_page_bounds(self.pool, self._decoded()[0])

    def mark_sums_stale(self) -> None:
        """Recount the shard key sums from the pages before they are next read (the stores they span changed)."""
        self._sums_stale = True

    def keep_summaries(self) -> None:
        """Keep the key statistics selectors read (sums and squares per shard) from now on: computed from the pages
        here, incrementally afterwards. A store nobody selects shards of (exact and Quest reads) keeps only counts;
        the shard bounds are kept from the first :meth:`summary` on (the top-k centroid selector never asks)."""
        if not self._summarised:
            self._recount(bounds=False)
            self._summarised = True

    def _recount(self, bounds: bool) -> None:
        self.stats.recount([s.shard_pages() for s in (self, *self.summed_with)], bounds=bounds)
        self._sums_stale = False
        self._bounds_stale &= not bounds

    def shard_pages(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a recount of shard key statistics reads: the flat ``(row, head, shard)`` id of every pool page
        (``[N]``), its decoded keys (``[N, P, Dk]``) and valid slots (``[N, P]``)."""
        run = torch.arange(self.batch * self.heads, device=self.device).repeat_interleave(self.table.cap.reshape(-1))
        shard = self.pool["shard"].long().clamp(min=0)
        return run * self.num_shards + shard, self._decoded()[0], self.pool["valid"]

    @property
    def summaries_kept(self) -> bool:
        """Whether shard key statistics are kept (from the first :meth:`summary` or :meth:`keep_summaries` on)."""
        return self._summarised

    def shard_stats(self, bounds: bool = False) -> ShardStats:
        """The per-shard key statistics (kept from the first call on, see :meth:`keep_summaries`; the sums recounted
        first after an eviction re-packed the pages); ``bounds``: with the shard min / max, computed from the pages
        in the same pass the first time they are asked for. With tiers (``summed_with``) the sums, squares and
        bounds are those of the layer's tokens in every store; the counts stay this store's own."""
        first_bounds = bounds and not self.stats.bounds_kept
        if not self._summarised or self._sums_stale or first_bounds:
            self._recount(bounds=first_bounds or (self._bounds_stale and self.stats.bounds_kept))
            self._summarised = True
        return self.stats

    def summary(self, misses: torch.Tensor) -> ShardSummary:
        """The shard summaries a selector reads, from :meth:`shard_stats` with bounds (computed from the pages at the
        first call, kept incrementally afterwards); a store with tiers is summarised with them (``StoreGroup``)."""
        if self.summed_with:
            raise RuntimeError("this store's shard sums count its tiers' tokens too: read StoreGroup.summary")
        return self.shard_stats(bounds=True).summary(misses)

    def tokens_per_shard(self) -> torch.Tensor:
        """``[B, H, S]`` valid tokens held by each shard."""
        return self.stats.count.clone()

    def enable_page_bounds(self) -> None:
        """Keep per-page key min / max from now on (computed once here from the stored keys)."""
        if not self.page_bounds_kept:
            add_page_bounds(self.pool, self._decoded()[0], self.dtype if self.codec.lossless else torch.float32)

    def _decoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded keys ``[N, P, Dk]`` and values ``[N, P, Dv]`` of every pool page."""
        return self.codec.decode({n: self.pool[n] for n in self.kv_fields})

    def page_bounds(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Quest's page metadata over the frame's pages: ``(key_min, key_max)`` ``[B, H, W, Dk]`` and valid tokens per
        page ``[B, H, W]``."""
        if not self.page_bounds_kept:
            raise RuntimeError("page bounds are not kept: call enable_page_bounds() first")
        b, h, w, p = self.batch, self.heads, self.table.width(), self.page_size
        count = self.frame("valid").view(b, h, w, p).sum(-1)
        return self.frame("key_min"), self.frame("key_max"), count

    def kv_nbytes(self) -> int:
        """Bytes allocated for the codec's key/value fields."""
        return self.pool.nbytes(self.kv_fields)

    def empty_nbytes(self) -> int:
        """The share of :meth:`kv_nbytes` in slots that hold no token (partly filled pages, growth headroom, a
        reservation): what a press's ratio cannot free (``kv_nbytes * empty slots / slots``, measured on the pool)."""
        slots = self.pool.num_pages * self.page_size
        empty = slots - int(self.pool["valid"].sum())
        return self.kv_nbytes() * empty // slots if slots else 0

    def meta_nbytes(self) -> int:
        """Bytes allocated for positions, valid bits, statistics, page shards and bounds, page table, shard sums,
        the sink / recent-window slots a sparse read keeps and the codec's own tensors (a projection's maps)."""
        t = self.table
        small = [t.start, t.cap, t.n_pages, t.open_page, t.open_fill, *self.codec.tensors()]
        if self._marks is not None:
            small += [self._marks.slots, self._marks.pos, self._marks.reach]
        meta = tuple(n for n in self.pool.fields if n not in self.kv_fields)
        return self.pool.nbytes(meta) + sum(x.numel() * x.element_size() for x in small) + self.stats.nbytes()
