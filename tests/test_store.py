"""PagedStore (pool + page table + shard statistics) against sequential pure-Python models of pages and shards."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pikv_hf.store import PagedStore
from pikv_hf.store.paged import MAX_SHARDS


def reference_slots(shards: list[list[int]], page_size: int) -> list[int]:
    """Slot of every token when tokens arrive in order and each shard fills its own pages (one (b, h) row)."""
    open_page: dict[int, tuple[int, int]] = {}
    n_pages, slots = 0, []
    for chunk in shards:
        for s in chunk:
            page, fill = open_page.get(s, (-1, page_size))
            if fill == page_size:
                page, fill, n_pages = n_pages, 0, n_pages + 1
            slots.append(page * page_size + fill)
            open_page[s] = (page, fill + 1)
    return slots


def _pages(slots: list[int], page_size: int) -> set[frozenset[int]]:
    groups: dict[int, set[int]] = {}
    for token, slot in enumerate(slots):
        groups.setdefault(slot // page_size, set()).add(token)
    return {frozenset(v) for v in groups.values()}


def _store(b, h, dk, dv, s, p, dtype=torch.float32):
    return PagedStore(b, h, dk, dv, s, p, dtype, torch.device("cpu"), track_stats=True)


def test_append_places_tokens_like_the_sequential_reference():
    g = torch.Generator().manual_seed(0)
    b, h, p, s = 2, 3, 4, 5
    store = _store(b, h, 8, 6, s, p)
    chunks, keys, seen = [], [], 0
    for q in (13, 1, 1, 7, 1, 40):
        shard = torch.randint(0, s, (b, h, q), generator=g)
        k = torch.randn(b, h, q, 8, generator=g)
        slot = store.append(k, torch.randn(b, h, q, 6, generator=g), shard, torch.arange(seen, seen + q))
        assert torch.equal(store.pool.flat("keys")[slot], k)  # slots as returned, valid until the pool moves
        chunks.append(shard)
        keys.append(k)
        seen += q
    all_slots = _current_slots(store, seen)
    for bi in range(b):
        for hi in range(h):
            expected = reference_slots([c[bi, hi].tolist() for c in chunks], p)
            got = all_slots[bi, hi].tolist()
            # same pages up to their numbering: which tokens share a page, and at which offset
            assert [x % p for x in got] == [x % p for x in expected]
            assert _pages(got, p) == _pages(expected, p)
            assert int(store.table.n_pages[bi, hi]) == len(_pages(expected, p))
    all_keys = torch.cat(keys, 2)
    assert torch.equal(store.pool.flat("keys")[all_slots], all_keys)
    assert torch.equal(store.pool.flat("pos")[all_slots], torch.arange(seen, dtype=torch.int32).expand(b, h, seen))
    assert int(store.pool["valid"].sum()) == b * h * seen
    # every page belongs to the shard of the tokens in it, and to the (row, head) whose run lists it
    all_shards = torch.cat(chunks, 2)
    assert torch.equal(store.pool["shard"][all_slots // p], all_shards)
    run_pages = store.table.pages()
    for bi in range(b):
        for hi in range(h):
            assert set((all_slots[bi, hi] // p).tolist()) <= set(run_pages[bi, hi].tolist())
    assert torch.equal(store.tokens_per_shard(), torch.nn.functional.one_hot(all_shards, s).sum(2))
    # the frame of uniform runs is a view of the pool, in run order
    assert store.table.uniform and store.frame("keys").data_ptr() == store.pool["keys"].data_ptr()


def _filled(seed, b=2, h=2, p=4, s=3, n=40, d=4):
    g = torch.Generator().manual_seed(seed)
    store = _store(b, h, d, d, s, p)
    shard = torch.randint(0, s, (b, h, n), generator=g)
    k = torch.randn(b, h, n, d, generator=g)
    slot = store.append(k, k + 1, shard, torch.arange(n))
    return store, g, shard, k, slot


def _frame_keep(store, keep_tok):
    """Frame mask (``[B, H, W * P]``) of the tokens at positions where ``keep_tok`` (``[B, H, n]``) holds."""
    pos = store.frame("pos").long().clamp(min=0, max=keep_tok.shape[-1] - 1)
    return store.frame("valid") & keep_tok.gather(2, pos)


def _current_slots(store, n):
    """``[B, H, n]`` flat pool slot now holding the token of each position (slots move when the pool grows)."""
    frame, pos, valid = store.frame_slots(), store.frame("pos").long(), store.frame("valid")
    out = torch.full((store.batch, store.heads, n), -1, dtype=torch.int64)
    for bi in range(store.batch):
        for hi in range(store.heads):
            out[bi, hi, pos[bi, hi][valid[bi, hi]]] = frame[bi, hi][valid[bi, hi]]
    return out


def test_retain_keeps_shards_positions_statistics_and_frees_pages():
    b, h, p, s, n = 2, 2, 4, 3, 40
    store, g, shard, k, slot = _filled(1, b, h, p, s, n)
    store.pool.flat("attn_mass")[slot] = torch.arange(n, dtype=torch.float32).expand(b, h, n)
    keep_tok = torch.rand(b, h, n, generator=g) < 0.4  # ragged per (b, h)
    bytes_before = store.kv_nbytes()
    removed = store.retain(_frame_keep(store, keep_tok), pool_tails=False)  # every shard keeps its tokens
    assert torch.equal(removed, (~keep_tok).sum(-1))
    valid = store.frame("valid")
    for bi in range(b):
        for hi in range(h):
            kept = keep_tok[bi, hi].nonzero().squeeze(-1)
            v = valid[bi, hi]
            order = store.frame("pos")[bi, hi][v].argsort()
            assert torch.equal(store.frame("pos")[bi, hi][v][order].long(), kept)
            assert torch.equal(store.frame("keys")[bi, hi][v][order], k[bi, hi, kept])
            assert torch.equal(store.frame("values")[bi, hi][v][order], k[bi, hi, kept] + 1)
            assert torch.equal(store.frame("attn_mass")[bi, hi][v][order], kept.float())
            slot_shard = store.frame("shard").repeat_interleave(p, -1)
            assert torch.equal(slot_shard[bi, hi][v][order], shard[bi, hi, kept])
    # each (row, head) holds exactly its own pages: whole pages per shard, at most one partly filled
    per_shard = torch.nn.functional.one_hot(shard, s).mul(keep_tok[..., None]).sum(2)  # [B, H, S]
    pages = per_shard.add(p - 1).div(p, rounding_mode="floor")
    assert torch.equal(store.table.n_pages, pages.sum(-1))
    assert store.pool.num_pages == int(pages.sum())
    assert store.kv_nbytes() == int(pages.sum()) * p * 2 * 4 * 4 < bytes_before
    assert not store.table.uniform


def test_appends_after_ragged_retain_fill_open_pages_then_grow_only_their_run():
    b, h, p, s, n = 2, 2, 4, 3, 40
    store, g, shard, k, slot = _filled(2, b, h, p, s, n)
    keep_tok = torch.ones(b, h, n, dtype=torch.bool)
    keep_tok[0, 1, :30] = False  # one head keeps 10 tokens, the others 40
    store.retain(_frame_keep(store, keep_tok), pool_tails=False)
    more = torch.randint(0, s, (b, h, 9), generator=g)
    k2 = torch.randn(b, h, 9, 4, generator=g)
    new_slots = store.append(k2, k2, more, torch.arange(n, n + 9))
    assert torch.equal(store.pool.flat("keys")[new_slots], k2)
    assert torch.equal(store.tokens_per_shard(), torch.nn.functional.one_hot(shard, s).mul(keep_tok[..., None]).sum(2)
                       + torch.nn.functional.one_hot(more, s).sum(2))  # fmt: skip
    # the short head's run stays short
    assert int(store.table.cap[0, 1]) < int(store.table.cap[0, 0])


def _summary_reference(k, shard, mask, s):
    member = torch.nn.functional.one_hot(shard, s).bool() & mask[..., None]  # [B, H, T, S]
    total = member.float().transpose(2, 3) @ k
    lo = torch.where(member[..., None], k[:, :, :, None], float("inf")).amin(2)
    hi = torch.where(member[..., None], k[:, :, :, None], float("-inf")).amax(2)
    return member.sum(2), total, lo, hi


B, H, P, S, D, N = 2, 2, 4, 3, 5, 30  # summary / bound tests: batch, KV heads, page size, shards, head dim, tokens


def _store_and_random_keys(
    seed: int, dtype: torch.dtype = torch.float32
) -> tuple[PagedStore, torch.Tensor, torch.Tensor]:
    """An empty ``[B, H]`` store of ``dtype``, and ``N`` random shard ids ``[B, H, N]`` and keys ``[B, H, N, D]`` to
    append."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, N, D, generator=g).to(dtype)
    return _store(B, H, D, D, S, P, dtype), torch.randint(0, S, (B, H, N), generator=g), keys


def test_shard_summaries_follow_appends_padding_and_retain():
    store, shard, k = _store_and_random_keys(2)
    mask = torch.ones(B, H, 30, dtype=torch.bool)
    mask[1, :, :6] = False  # left padding of row 1: stored nowhere, in no summary
    store.append(k[:, :, :20], k[:, :, :20], shard[:, :, :20], torch.arange(20), mask[..., :20])
    count, total, lo, hi = _summary_reference(k[:, :, :20], shard[:, :, :20], mask[..., :20], S)
    first = store.summary(torch.zeros_like(count))  # key statistics computed from the pages at the first read
    assert torch.equal(first.key_min, lo) and torch.equal(first.key_max, hi)  # exact while nothing left
    store.append(k[:, :, 20:], k[:, :, 20:], shard[:, :, 20:], torch.arange(20, 30))

    def check(mask):
        count, total, lo, hi = _summary_reference(k, shard, mask, S)
        summary = store.summary(torch.zeros_like(count))
        assert torch.equal(store.stats.count, count) and torch.equal(summary.counts, count)
        assert torch.allclose(store.stats.sum, total, atol=1e-5)
        # min / max are not shrunk on removal: still bounds of every remaining key
        assert (summary.key_min <= lo).all() and (summary.key_max >= hi).all()
        assert torch.allclose(summary.centroids, total / count.clamp(min=1)[..., None], atol=1e-6)
        for bi, hi_, si in torch.cartesian_prod(torch.arange(B), torch.arange(H), torch.arange(S)).tolist():
            members = k[bi, hi_][mask[bi, hi_] & (shard[bi, hi_] == si)]
            var = members.var(0, unbiased=False) if len(members) else torch.zeros(D)
            assert torch.allclose(summary.key_var[bi, hi_, si], var, atol=1e-5)

    check(mask)
    keep = mask.clone()
    keep[0, 1, 25:] = False  # a ragged eviction on one head
    store.retain(_frame_keep(store, keep), pool_tails=False)
    check(keep)


def test_shard_bounds_are_kept_only_from_the_first_summary_on():
    """``keep_summaries`` keeps sums and squares only (what the top-k centroid selector reads): no min / max is
    allocated while appends go on; the first ``summary`` computes them from the pages (equal to the bounds of the
    stored keys) and later appends fold into them."""
    store, shard, k = _store_and_random_keys(4)
    store.append(k[:, :, :12], k[:, :, :12], shard[:, :, :12], torch.arange(12))
    store.keep_summaries()
    store.append(k[:, :, 12:20], k[:, :, 12:20], shard[:, :, 12:20], torch.arange(12, 20))
    store.append_one(k[:, :, 20:21], k[:, :, 20:21], shard[:, :, 20:21], torch.tensor([20]))
    mask = torch.ones(B, H, 30, dtype=torch.bool)
    count, total = _summary_reference(k[:, :, :21], shard[:, :, :21], mask[..., :21], S)[:2]
    assert store.stats.min is None and store.stats.max is None and not store.stats.bounds_kept
    assert torch.allclose(store.shard_stats().sum, total, atol=1e-5) and torch.equal(store.stats.count, count)
    summary = store.summary(torch.zeros_like(count))
    lo, hi = _summary_reference(k[:, :, :21], shard[:, :, :21], mask[..., :21], S)[2:]
    assert torch.equal(summary.key_min, lo) and torch.equal(summary.key_max, hi)
    store.append_one(k[:, :, 21:22], k[:, :, 21:22], shard[:, :, 21:22], torch.tensor([21]))
    store.append(k[:, :, 22:], k[:, :, 22:], shard[:, :, 22:], torch.arange(22, 30))
    lo, hi = _summary_reference(k, shard, mask, S)[2:]
    summary = store.summary(torch.zeros_like(count))
    assert torch.equal(summary.key_min, lo) and torch.equal(summary.key_max, hi)


def test_retain_pools_the_shards_partly_filled_pages():
    """With ``pool_tails`` (evictions) kept tokens fill ``ceil(kept / P)`` pages per (row, head): only tokens past
    their shard's last whole page change shard, and the shard statistics (counts, sums, min / max) are those of the
    new shards, recounted from the pages."""
    b, h, p, s, n = 2, 2, 4, 5, 60
    store, g, shard, k, slot = _filled(3, b, h, p, s, n)
    store.summary(torch.zeros(b, h, s, dtype=torch.int64))  # key statistics kept from here on
    keep_tok = torch.rand(b, h, n, generator=g) < 0.5
    store.retain(_frame_keep(store, keep_tok))
    kept_n = keep_tok.sum(-1)
    assert torch.equal(store.table.n_pages, kept_n.add(p - 1).div(p, rounding_mode="floor"))
    assert store.kv_nbytes() == int(store.table.n_pages.sum()) * p * 2 * 4 * 4
    valid = store.frame("valid")
    new_shard = store.frame("shard").long().repeat_interleave(p, -1)
    old_count = torch.nn.functional.one_hot(shard, s).mul(keep_tok[..., None]).sum(2)  # [B, H, S]
    any_moved = False
    for bi in range(b):
        for hi in range(h):
            v = valid[bi, hi]
            order = store.frame("pos")[bi, hi][v].argsort()
            kept = keep_tok[bi, hi].nonzero().squeeze(-1)
            assert torch.equal(store.frame("keys")[bi, hi][v][order], k[bi, hi, kept])
            moved = new_shard[bi, hi][v][order] != shard[bi, hi, kept]
            any_moved |= bool(moved.any())
            tails = old_count[bi, hi] % p
            for si in range(s):  # a shard gives away at most its tail, and only its newest kept tokens
                own = (shard[bi, hi, kept] == si).nonzero().squeeze(-1)
                gone = moved[own]
                assert int(gone.sum()) <= int(tails[si])
                assert not bool(gone[: len(own) - int(tails[si])].any())
    assert any_moved  # this seed pools something
    count = torch.nn.functional.one_hot(new_shard.clamp(min=0), s).mul(valid[..., None]).sum(2)
    summary = store.summary(torch.zeros_like(count))
    assert torch.equal(summary.counts, count)
    keys = store.frame("keys")
    total, lo, hi = _summary_reference(keys, new_shard.clamp(min=0), valid, s)[1:]
    assert torch.allclose(summary.centroids * count.clamp(min=1)[..., None], total, atol=1e-5)
    assert torch.equal(summary.key_min, lo) and torch.equal(summary.key_max, hi)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_bounds_follow_appends_padding_retain_and_batch_indexing(dtype):
    """Bounds in the keys' own dtype (a lossless store): the min / max of bfloat16 keys are bfloat16 values, so the
    bounds stay exact at half of float32's bytes."""
    store, shard, k = _store_and_random_keys(3, dtype)
    present = torch.ones(B, H, 12, dtype=torch.bool)
    present[1, :, :3] = False  # left padding takes no slot
    store.append(k[:, :, :12], k[:, :, :12], shard[:, :, :12], torch.arange(12), present)
    store.enable_page_bounds()  # computed from what is stored, then maintained
    store.append(k[:, :, 12:20], k[:, :, 12:20], shard[:, :, 12:20], torch.arange(12, 20))
    keep = store.frame("valid").clone()
    keep[0, 0, :5] = False  # an eviction leaves the other pages' bounds as they were
    store.retain(keep)
    store.append(k[:, :, 20:], k[:, :, 20:], shard[:, :, 20:], torch.arange(20, 30))

    def check(exact: bool):
        # independent: every frame page's min / max over the keys of its valid slots, read slot by slot
        lo, hi, count = store.page_bounds()
        keys, valid = store.frame("keys"), store.frame("valid")
        for bi in range(store.batch):
            for hi_ in range(H):
                for page in range(store.table.width()):
                    sl = slice(page * P, (page + 1) * P)
                    members = keys[bi, hi_, sl][valid[bi, hi_, sl]]
                    assert count[bi, hi_, page] == members.shape[0]
                    if members.shape[0]:
                        bound_lo, bound_hi = lo[bi, hi_, page], hi[bi, hi_, page]
                        if exact:
                            assert torch.equal(bound_lo, members.amin(0)) and torch.equal(bound_hi, members.amax(0))
                        assert (bound_lo <= members.amin(0)).all() and (bound_hi >= members.amax(0)).all()

    check(exact=True)  # appends and re-packs keep exact bounds
    assert int(store.frame("valid").sum()) == B * H * 30 - 3 * H - 5
    keep = store.frame("valid").clone()
    keep[0, 1, :7] = False
    store.retain(keep)
    check(exact=True)  # re-packed pages get exact bounds
    store.index_batch(torch.tensor([1, 1, 0]))
    check(exact=True)
    assert store.pool["key_min"].dtype == store.pool["key_max"].dtype == dtype
    assert store.meta_nbytes() >= 2 * store.pool["key_min"].numel() * dtype.itemsize


def test_index_batch_reorders_rows_with_their_pages():
    store, g, shard, k, slot = _filled(4, b=3, h=2)
    before = {n: store.frame(n).clone() for n in ("keys", "values", "pos", "valid")}
    counts = store.tokens_per_shard()
    store.index_batch(torch.tensor([2, 0, 0, 1]))
    for name, t in before.items():
        assert torch.equal(store.frame(name), t[[2, 0, 0, 1]])
    assert torch.equal(store.tokens_per_shard(), counts[[2, 0, 0, 1]])


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_long_append_with_many_shards_builds_no_token_by_shard_tensor():
    # 4096 tokens x 256 shards x 2 heads would be a 2M-element one-hot; the keys themselves are 4096 x 2 x 8
    b, h, q, s, d = 1, 2, 4096, 256, 8
    g = torch.Generator().manual_seed(5)
    store = _store(b, h, d, d, s, 1)
    shard = torch.randint(0, s, (b, h, q), generator=g)
    k = torch.randn(b, h, q, d, generator=g)
    with _LargestTensor() as probe:
        store.append(k, k, shard, torch.arange(q))
    assert probe.largest <= store.pool["keys"].numel() + s * d * h  # pool pages (with headroom) or shard sums
    assert probe.largest < b * h * q * s


def test_shard_ids_hold_every_shard_of_a_store_up_to_the_bound():
    """A page's shard id is int16: the largest shard id of a store at the bound comes back as stored, one more shard
    is refused before anything is allocated (its id would wrap)."""
    top = MAX_SHARDS
    store = _store(1, 1, 4, 4, top, 1)
    store.append(torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4), torch.tensor([[[top - 1, 0]]]), torch.arange(2))
    by_pos = dict(zip(store.frame("pos")[0, 0].tolist(), store.frame("shard")[0, 0].tolist(), strict=True))
    assert by_pos[0] == top - 1 and by_pos[1] == 0
    with pytest.raises(ValueError, match=f"num_shards must be at most {top} \\(a page's shard id is int16\\)"):
        _store(1, 1, 4, 4, top + 1, 1)


def test_page_bounds_fold_operator_equals_the_bounds_of_each_page_and_passes_opcheck():
    """``pikv::fold_page_bounds`` (what a compiled step on CUDA folds through) widens each page's bounds to the
    elementwise min / max of the keys stored in it, and is checked by ``opcheck`` (schema, fake, in-place)."""
    from pikv_hf.store import bounds

    gen = torch.Generator().manual_seed(0)
    keys, page = torch.randn(12, 5, generator=gen), torch.randint(0, 4, (12,), generator=gen)
    kmin, kmax = torch.full((6, 5), float("inf")), torch.full((6, 5), float("-inf"))
    torch.ops.pikv.fold_page_bounds(kmin, kmax, page, keys)
    for p in range(6):
        mine = keys[page == p]
        if len(mine):
            assert torch.equal(kmin[p], mine.amin(0)) and torch.equal(kmax[p], mine.amax(0))
        else:
            assert bool(kmin[p].isposinf().all()) and bool(kmax[p].isneginf().all())
    fresh = (torch.full((6, 5), float("inf")), torch.full((6, 5), float("-inf")), page, keys)
    torch.library.opcheck(bounds._fold_op, fresh)


def _read_specials(store: PagedStore, n_sink: int, window: int, row_start: torch.Tensor, qpos: int) -> list[set]:
    """Per (row, head), the (slot, position) pairs of the store's special slots a query at ``qpos`` reads."""
    marks = store.special_slots(n_sink, window, row_start)
    read = (marks.slots >= 0) & ~marks.unread(torch.tensor([qpos]))
    return [{(int(s), int(p)) for s, p in zip(marks.slots[b, h][read[b, h]], marks.pos[b, h][read[b, h]], strict=True)}
            for b in range(store.batch) for h in range(store.heads)]  # fmt: skip


def _sinks_and_window(store: PagedStore, n_sink: int, window: int, row_start: torch.Tensor, qpos: int) -> list[set]:
    """The same from the frame itself: each (row, head)'s first ``n_sink`` stored tokens counted from its row's start
    and those at the last ``window`` positions up to ``qpos``."""
    pos, valid, slots = store.frame("pos").long(), store.frame("valid"), store.frame_slots()
    rel = pos - row_start.view(-1, 1, 1)
    keep = valid & (((rel >= 0) & (rel < n_sink)) | (pos > qpos - window))
    return [{(int(s), int(p)) for s, p in zip(slots[b, h][keep[b, h]], pos[b, h][keep[b, h]], strict=True)}
            for b in range(store.batch) for h in range(store.heads)]  # fmt: skip


@pytest.mark.parametrize("window, pad", [(6, 5), (1, 5), (6, 29), (0, 29)])
def test_special_slots_kept_through_decode_appends_are_the_sinks_and_the_last_window(window, pad):
    """The sink and recent slots a store keeps (found once by a scan, then a ring written by the append operator, or
    by the general append of one masked token) are at every step the row's first ``n_sink`` tokens and its tokens of
    the last ``window`` positions, as read from the frame; the decode steps never scan again (no page moves: a
    reserved store). Row 1 is left-padded (``pad`` 29: one real token, fewer than its sinks, which the next tokens
    become; the store scanned its frame again at every step until the row filled, and a compiled step recompiled
    then), and a pad token arrives in the middle of decoding (general append, masked: it takes no slot)."""
    from pikv_hf.store.special import SpecialSlots

    b, h, d, n_sink, t0 = 2, 2, 8, 3, 30
    g = torch.Generator().manual_seed(5)
    store = PagedStore(b, h, d, d, 3, 4, torch.float32, torch.device("cpu"))
    present = torch.ones(b, h, t0, dtype=torch.bool)
    present[1, :, :pad] = False  # left padding
    row_start = torch.tensor([0, pad])
    store.append(torch.randn(b, h, t0, d, generator=g), torch.randn(b, h, t0, d, generator=g),
                 torch.randint(0, 3, (b, h, t0), generator=g), torch.arange(t0), present)  # fmt: skip
    store.reserve(40)  # room for every decode token in every shard: no page moves, so no slot changes
    first = store.special_slots(n_sink, window, row_start)
    assert _read_specials(store, n_sink, window, row_start, t0 - 1) == _sinks_and_window(
        store, n_sink, window, row_start, t0 - 1
    )
    scans = 0
    real_scan = SpecialSlots.scan

    def counting(*args, **kwargs):
        nonlocal scans
        scans += 1
        return real_scan(*args, **kwargs)

    SpecialSlots.scan = counting
    try:
        for t in range(t0, t0 + 15):
            k, v = torch.randn(b, h, 1, d, generator=g), torch.randn(b, h, 1, d, generator=g)
            shard = torch.randint(0, 3, (b, h, 1), generator=g)
            if t == t0 + 7:  # row 0 pads this step (general append, masked)
                mask = torch.tensor([False, True]).view(b, 1, 1).expand(b, h, 1)
                store.append(k, v, shard, torch.tensor([t]), mask, grow=False, row_start=row_start)
            else:
                store.append_one(k, v, shard, torch.tensor([t]), row_start, grow=False)
            got = _read_specials(store, n_sink, window, row_start, t)
            assert got == _sinks_and_window(store, n_sink, window, row_start, t), t
    finally:
        SpecialSlots.scan = real_scan
    assert scans == 0 and store.special_slots(n_sink, window, row_start) is first
