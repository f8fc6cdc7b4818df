"""A row of a left-padded batch keeps what it keeps alone and decodes the same logits, under every pikv_hf press.

Three rows of different lengths go through the model as one left-padded batch into a real ``PiKVCache`` (the pads
reach the cache as the model's padding mask, never as hand-made positions), and each row goes through alone into a
cache of its own. Compared per layer, (row, KV head) and store: the positions kept, counted from the row's first real
token, and the logits of a few decode steps (same tokens for every row). Reference: the row alone, a DynamicCache
has no notion of per-row budgets to compare with.
"""

import contextlib

import kvpress
import pytest
import torch
from helpers import model_pair

from pikv_hf import PiKVCache
from pikv_hf.presses import (
    AdaKVPress,
    ChunkPCAPress,
    DecodingBudgetPress,
    DuoAttentionPress,
    FlexGenPress,
    H2OPress,
    LRUPlusPress,
    LRUPress,
    PyramidPress,
    QuantPress,
    QuestPress,
    StreamingLLMPress,
    calibrate_heads,
)

LENGTHS = (30, 22, 15)
STEPS = 5
TOKENS = torch.tensor([7, 19, 33, 41, 58])


def _heads(model):
    ids = torch.randint(3, 256, (1, 48), generator=torch.Generator().manual_seed(9))
    return calibrate_heads(model, ids, n_sink=2, window=8)  # 48 tokens: more than sinks and window


PREFILL = {  # presses acting at prefill: name -> factory(model)
    "h2o": lambda m: H2OPress(0.5),
    "streaming_llm": lambda m: StreamingLLMPress(0.5, n_sink=2),
    "lru": lambda m: LRUPress(0.5),
    "lru_plus": lambda m: LRUPlusPress(0.5),
    "flexgen": lambda m: FlexGenPress(0.5),
    "adakv_h2o": lambda m: AdaKVPress(H2OPress(0.5)),
    "adakv_knorm": lambda m: AdaKVPress(kvpress.KnormPress(0.5)),
    "duo_attention": lambda m: DuoAttentionPress(0.5, heads=_heads(m), n_sink=2),
    "pyramid": lambda m: PyramidPress(0.5, scorer=kvpress.KnormPress()),
    "knorm": lambda m: kvpress.KnormPress(0.5),  # kvpress's own scorer: its top-k on each row's own budget
    # kvpress scorers that index keys against the hidden states (a window of the last queries, sinks, recent tokens):
    # each row is scored on its own tokens (they read a short row's packed keys against the batch's padded hidden
    # states: SnapKV, TOVA and kvpress's StreamingLLM kept other tokens in a batch)
    "snapkv": lambda m: kvpress.SnapKVPress(0.5, window_size=4),
    "tova": lambda m: kvpress.TOVAPress(0.5),
    "kvpress_streaming_llm": lambda m: kvpress.StreamingLLMPress(0.5, n_sink=2),
    "adakv_snapkv": lambda m: AdaKVPress(kvpress.SnapKVPress(0.5, window_size=4)),
    "pyramid_snapkv": lambda m: PyramidPress(0.5, scorer=kvpress.SnapKVPress(window_size=4)),
    # a kvpress scorer second in a ComposedPress: the first left the rows fewer tokens than the forward's queries,
    # and different numbers of them (the batch was scored at once, a short row's zero fill read as its newest keys)
    "composed_snapkv": lambda m: kvpress.ComposedPress(
        [kvpress.SnapKVPress(0.25, window_size=4), kvpress.SnapKVPress(0.25, window_size=4)]
    ),
    "composed_streaming_tova": lambda m: kvpress.ComposedPress(
        [kvpress.StreamingLLMPress(0.25, n_sink=2), kvpress.TOVAPress(0.25)]
    ),
}
DECODE = {  # DecodingBudgetPress over each base press that ranks decoding tokens from the cache's statistics
    "budget_h2o": lambda m: H2OPress(),
    "budget_streaming_llm": lambda m: StreamingLLMPress(n_sink=2),
    "budget_lru": lambda m: LRUPress(),
    "budget_lru_plus": lambda m: LRUPlusPress(),
    "budget_flexgen": lambda m: FlexGenPress(),
    "budget_adakv_h2o": lambda m: AdaKVPress(H2OPress()),
}


def _rows(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g) for n in LENGTHS]


def _run(model, cache, rows: list[torch.Tensor], press) -> torch.Tensor:
    """Prefill ``rows`` left-padded as one batch (RoPE positions from each row's first real token, as ``generate``
    gives them), then ``STEPS`` decode steps; returns ``[STEPS, B, V]`` logits."""
    longest = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, longest - len(r) :], mask[i, longest - len(r) :] = r, 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = []
    with torch.no_grad(), press(model) if press is not None else contextlib.nullcontext():
        model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
        for step in range(STEPS):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], -1)
            pos = pos[:, -1:] + 1
            token = TOKENS[step].expand(len(rows), 1)
            out = model(token, attention_mask=mask, position_ids=pos, past_key_values=cache)
            logits.append(out.logits[:, -1])
    return torch.stack(logits)


def _kept(cache: PiKVCache, row: int) -> list[list[tuple[str, list[int]]]]:
    """Per layer and KV head: (store, sorted positions of ``row`` counted from its first real token) per store that
    holds any (a tier the batch's other rows filled is empty for this row, as absent when it runs alone)."""
    out = []
    for layer in cache.layers:
        start = int(layer.row_start[row])
        heads = []
        for h in range(layer.store.heads):
            stores = []
            for name, st in layer.stores.named():
                pos, valid = st.frame("pos")[row, h], st.frame("valid")[row, h]
                if valid.any():
                    stores.append((name, sorted((pos[valid].long() - start).tolist())))
            heads.append(stores)
        out.append(heads)
    return out


def _compare(build_press, seed: int, target_size: int | None = None, **cache_kwargs):
    _, model = model_pair("llama")
    rows = _rows(seed)

    def press():
        p = build_press(model)
        return p if target_size is None else DecodingBudgetPress(base_press=p, target_size=target_size)

    batch = PiKVCache(model, page_size=4, **cache_kwargs)
    batch_logits = _run(model, batch, rows, press())
    for i, row in enumerate(rows):
        alone = PiKVCache(model, page_size=4, **cache_kwargs)
        alone_logits = _run(model, alone, [row], press())
        assert _kept(batch, i) == _kept(alone, 0), f"row {i} (length {len(row)}) keeps other positions in a batch"
        assert (batch_logits[:, i] - alone_logits[:, 0]).abs().max() < 1e-4, f"row {i}: logits differ"
    return batch


@pytest.mark.parametrize("name", sorted(PREFILL))
def test_prefill_press_keeps_each_rows_own_budget(name):
    batch = _compare(PREFILL[name], seed=1)
    held = batch.layers[0].tokens_per_shard().sum(-1)  # [B, H] over every store
    for i, n in enumerate(LENGTHS):  # padding takes no slot: a row holds at most its own tokens
        assert int(held[i].max()) <= n + STEPS


@pytest.mark.parametrize("name", sorted(DECODE))
def test_decode_budget_keeps_each_rows_own_budget(name):
    batch = _compare(DECODE[name], seed=2, target_size=12)
    per_head = batch.layers[1].store.stats.count.sum(-1)
    if name == "budget_adakv_h2o":
        assert bool((per_head.sum(-1) <= 2 * 12 + 1).all())
    else:
        assert bool((per_head <= 12 + 1).all())


def test_streaming_llm_sinks_are_each_rows_first_tokens():
    # the review's reproduction: 30 real tokens + 10 pads at ratio 0.5 kept positions 12..29 and no sinks
    batch = _compare(PREFILL["streaming_llm"], seed=3)
    kept = [p for p in _kept(batch, 1)[0][0][0][1] if p < 22]  # row 1: 22 real tokens after 8 pads
    assert kept == [0, 1, *range(22 - (11 - 2), 22)]


@pytest.mark.parametrize("router", ["round_robin", "key_cluster"])
def test_quest_page_reads_are_each_rows_own(router):
    # pages group a row's own tokens (padding takes no slot, placement numbers tokens from the row's first)
    _compare(lambda m: QuestPress(0.5, page_size=4, n_sink=2, window=4), seed=4, router=router)


@pytest.mark.parametrize(
    "build",
    [lambda m: QuantPress(bits=8, group_size=4, window=18), lambda m: ChunkPCAPress(rank=2, chunk_size=4, window=18)],
    ids=["quant", "chunk_pca"],
)
def test_compressor_moves_each_rows_pages_when_it_would_alone(build):
    """While decoding, a row moves its tokens that left the window once a page of them has gathered in that row: the
    rows of 30 and 22 tokens have 4 pending at the 4th step, the row of 15 (shorter than the window) one. The batch
    once moved every row's old tokens when any row had a page pending (logits of a short row off by 0.12)."""
    _compare(build, seed=5)
