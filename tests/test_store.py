"""PagedShardStore against a sequential pure-Python model of pages and shards."""

import torch

from pikv_hf.store import PagedShardStore


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


def test_append_places_tokens_like_the_sequential_reference():
    g = torch.Generator().manual_seed(0)
    b, h, p, s = 2, 3, 4, 5
    store = PagedShardStore(b, h, 8, 6, s, p, torch.float32, torch.device("cpu"))
    chunks, keys, seen = [], [], 0
    for q in (13, 1, 1, 7, 1):
        shard = torch.randint(0, s, (b, h, q), generator=g)
        k = torch.randn(b, h, q, 8, generator=g)
        slot = store.append(k, torch.randn(b, h, q, 6, generator=g), shard, torch.arange(seen, seen + q))
        chunks.append((shard, slot))
        keys.append(k)
        seen += q
    for bi in range(b):
        for hi in range(h):
            expected = reference_slots([c[0][bi, hi].tolist() for c in chunks], p)
            got = torch.cat([c[1][bi, hi] for c in chunks]).tolist()
            # same pages up to their numbering: which tokens share a page, and at which offset
            assert [x % p for x in got] == [x % p for x in expected]
            assert _pages(got, p) == _pages(expected, p)
            assert int(store.n_pages[bi, hi]) == len(_pages(expected, p))
    all_keys, all_slots = torch.cat(keys, 2), torch.cat([c[1] for c in chunks], 2)
    assert torch.equal(store.keys.gather(2, all_slots[..., None].expand(-1, -1, -1, 8)), all_keys)
    assert torch.equal(store.pos.gather(2, all_slots), torch.arange(seen, dtype=torch.int32).expand(b, h, seen))
    assert int(store.valid.sum()) == b * h * seen
    # every page belongs to the shard of the tokens in it
    all_shards = torch.cat([c[0] for c in chunks], 2)
    assert torch.equal(store.slot_shard().gather(2, all_slots), all_shards)
    assert torch.equal(store.tokens_per_shard(), torch.nn.functional.one_hot(all_shards, s).sum(2))


def test_compact_keeps_shards_positions_and_statistics_and_releases_pages():
    g = torch.Generator().manual_seed(1)
    b, h, p, s, n = 2, 2, 4, 3, 40
    store = PagedShardStore(b, h, 4, 4, s, p, torch.float32, torch.device("cpu"))
    shard = torch.randint(0, s, (b, h, n), generator=g)
    k = torch.randn(b, h, n, 4, generator=g)
    slot = store.append(k, k + 1, shard, torch.arange(n))
    store.attn_mass.scatter_(2, slot, torch.arange(n, dtype=torch.float32).expand(b, h, n).contiguous())
    keep_tok = torch.rand(b, h, n, generator=g) < 0.4  # ragged per (b, h)
    keep = torch.zeros_like(store.valid).scatter_(2, slot, keep_tok)
    pages_before = store.capacity_pages
    store.compact(keep)
    for bi in range(b):
        for hi in range(h):
            kept = keep_tok[bi, hi].nonzero().squeeze(-1)
            valid = store.valid[bi, hi]
            order = store.pos[bi, hi][valid].argsort()
            assert torch.equal(store.pos[bi, hi][valid][order].long(), kept)
            assert torch.equal(store.keys[bi, hi][valid][order], k[bi, hi, kept])
            assert torch.equal(store.values[bi, hi][valid][order], k[bi, hi, kept] + 1)
            assert torch.equal(store.attn_mass[bi, hi][valid][order], kept.float())
            assert torch.equal(store.slot_shard()[bi, hi][valid][order], shard[bi, hi, kept])
    assert store.capacity_pages < pages_before


def _summary_reference(k, shard, mask, s):
    member = torch.nn.functional.one_hot(shard, s).bool() & mask[..., None]  # [B, H, T, S]
    total = member.float().transpose(2, 3) @ k
    lo = torch.where(member[..., None], k[:, :, :, None], float("inf")).amin(2)
    hi = torch.where(member[..., None], k[:, :, :, None], float("-inf")).amax(2)
    return member.sum(2), total, lo, hi


B, H, P, S, D, N = 2, 2, 4, 3, 5, 30  # summary / bound tests: batch, KV heads, page size, shards, head dim, tokens


def _store_and_random_keys(seed: int) -> tuple[PagedShardStore, torch.Tensor, torch.Tensor]:
    """An empty ``[B, H]`` store, and ``N`` random shard ids ``[B, H, N]`` and keys ``[B, H, N, D]`` to append."""
    g = torch.Generator().manual_seed(seed)
    store = PagedShardStore(B, H, D, D, S, P, torch.float32, torch.device("cpu"))
    return store, torch.randint(0, S, (B, H, N), generator=g), torch.randn(B, H, N, D, generator=g)


def test_shard_summaries_follow_appends_invalidation_and_compaction():
    store, shard, k = _store_and_random_keys(2)
    first = store.append(k[:, :, :20], k[:, :, :20], shard[:, :, :20], torch.arange(20))
    pad = torch.ones(B, 20, dtype=torch.bool)
    pad[1, :6] = False  # left padding of row 1
    store.invalidate(first, pad)
    second = store.append(k[:, :, 20:], k[:, :, 20:], shard[:, :, 20:], torch.arange(20, 30))
    mask = torch.ones(B, H, 30, dtype=torch.bool)
    mask[1, :, :6] = False

    def check(mask):
        count, total, lo, hi = _summary_reference(k, shard, mask, S)
        assert torch.equal(store.shard_count, count)
        assert torch.allclose(store.shard_sum, total, atol=1e-5)
        assert torch.equal(store.shard_min, lo) and torch.equal(store.shard_max, hi)
        summary = store.summary(torch.zeros_like(count))
        assert torch.allclose(summary.centroids, total / count.clamp(min=1)[..., None], atol=1e-6)
        for bi, hi_, si in torch.cartesian_prod(torch.arange(B), torch.arange(H), torch.arange(S)).tolist():
            members = k[bi, hi_][mask[bi, hi_] & (shard[bi, hi_] == si)]
            var = members.var(0, unbiased=False) if len(members) else torch.zeros(D)
            assert torch.allclose(summary.key_var[bi, hi_, si], var, atol=1e-5)

    check(mask)
    keep = mask.clone()
    keep[0, 1, 25:] = False  # a ragged eviction on one head
    slots = torch.cat([first, second], 2)
    store.compact(torch.zeros_like(store.valid).scatter_(2, slots, keep))
    check(keep)


def test_page_bounds_follow_appends_invalidation_compaction_and_batch_indexing():
    store, shard, k = _store_and_random_keys(3)
    store.append(k[:, :, :12], k[:, :, :12], shard[:, :, :12], torch.arange(12))
    store.enable_page_bounds()  # computed from what is stored, then maintained
    more = store.append(k[:, :, 12:20], k[:, :, 12:20], shard[:, :, 12:20], torch.arange(12, 20))
    pad = torch.ones(B, 8, dtype=torch.bool)
    pad[1, :3] = False
    store.invalidate(more, pad)
    store.append(k[:, :, 20:], k[:, :, 20:], shard[:, :, 20:], torch.arange(20, 30))

    def check():
        # independent: every page's min / max over the keys of its valid slots, read slot by slot
        lo, hi, count = store.page_bounds()
        for bi in range(store.batch):
            for hi_ in range(H):
                for page in range(store.capacity_pages):
                    sl = slice(page * P, (page + 1) * P)
                    keys = store.keys[bi, hi_, sl][store.valid[bi, hi_, sl]]
                    assert count[bi, hi_, page] == keys.shape[0]
                    if keys.shape[0]:
                        assert torch.equal(lo[bi, hi_, page], keys.amin(0))
                        assert torch.equal(hi[bi, hi_, page], keys.amax(0))

    check()
    assert int(store.valid.sum()) == B * H * 30 - 3 * H
    keep = store.valid.clone()
    keep[0, 1, :7] = False
    store.compact(keep)
    check()
    store.index_batch(torch.tensor([1, 1, 0]))
    check()
    assert store.meta_nbytes() >= 2 * store.page_min.numel() * 4


def test_gather_pages_copies_the_listed_pages_into_a_reused_workspace():
    g = torch.Generator().manual_seed(3)
    b, h, p, s = 2, 3, 4, 5
    workspace: dict = {}
    store = PagedShardStore(b, h, 8, 6, s, p, torch.float32, torch.device("cpu"), workspace=workspace)
    q = 40
    store.append(
        torch.randn(b, h, q, 8, generator=g),
        torch.randn(b, h, q, 6, generator=g),
        torch.randint(0, s, (b, h, q), generator=g),
        torch.arange(q),
    )
    assert store.workspace_nbytes() == 0
    held = 0
    for n in (5, 3, 7):  # grows, then a smaller gather reuses it, then grows again
        pages = torch.stack([torch.randperm(int(store.n_pages.min()), generator=g)[:n] for _ in range(b * h)])
        pages = pages.view(b, h, n)
        part = store.gather_pages(pages)
        slots = (pages.unsqueeze(-1) * p + torch.arange(p)).view(b, h, n * p)  # reference: slot indexing
        assert torch.equal(part["keys"], store.keys.gather(2, slots[..., None].expand(-1, -1, -1, 8)))
        assert torch.equal(part["values"], store.values.gather(2, slots[..., None].expand(-1, -1, -1, 6)))
        assert torch.equal(part["pos"], store.pos.gather(2, slots))
        assert torch.equal(part["valid"], store.valid.gather(2, slots))
        assert torch.equal(part["shard"], store.slot_shard().gather(2, slots))
        held = max(held, n)
        per_page = p * (8 + 6) * 4 + p * 4 + p  # fp32 keys + values, int32 pos, bool valid
        assert store.workspace_nbytes() == b * h * held * per_page
    # a second store given the same workspace (as PiKVCache's layers are) reuses it instead of allocating
    other = PagedShardStore(b, h, 8, 6, s, p, torch.float32, torch.device("cpu"), workspace=workspace)
    other.append(store.keys, store.values, store.slot_shard().clamp(min=0), torch.arange(store.keys.shape[2]))
    other.gather_pages(pages[..., :2])
    assert other.workspace_nbytes() == store.workspace_nbytes() == b * h * held * per_page
