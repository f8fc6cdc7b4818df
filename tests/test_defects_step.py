"""Decode-step defects of issue 33: ``sparse_from`` per row (not counting left padding), a failed forward leaves the
cache in step, compiled steps past ``max_cache_len`` corrupt no other row, compiled sparse steps never recompile."""

import gc
import logging
import weakref

import pytest
import torch
import torch._dynamo as dynamo
from helpers import DynamicCache, prompt

from pikv_hf import PiKVCache
from pikv_hf.tiny import tiny_model

logging.getLogger("torch._dynamo").setLevel(logging.ERROR)

ROW_LENGTHS = (30, 22, 15)
DECODE_TOKENS = (7, 19, 33, 41, 58, 77)


def _left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, longest - len(r) :], mask[i, longest - len(r) :] = r, 1
    return ids, mask


def _decode(model, cache, rows: list[torch.Tensor]) -> torch.Tensor:
    """``[steps, B, V]`` logits of the fixed decode tokens after a left-padded prefill of ``rows``."""
    ids, mask = _left_padded(rows)
    pos, out = (mask.cumsum(-1) - 1).clamp(min=0), []
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
        for t in DECODE_TOKENS:
            mask, pos = torch.cat([mask, torch.ones_like(mask[:, :1])], -1), pos[:, -1:] + 1
            step = torch.full((len(rows), 1), t)
            out.append(model(step, attention_mask=mask, position_ids=pos, past_key_values=cache).logits[:, -1])
    return torch.stack(out)


SPARSE_FROM_READS = {
    "routed": dict(attention="routed", top_k_shards=2, n_sink=2, window=4),
    "quest": dict(attention="quest", read_fraction=0.25, n_sink=2, window=4),
}


@pytest.mark.parametrize("mode", sorted(SPARSE_FROM_READS))
def test_sparse_from_counts_each_rows_real_tokens(mode):
    # rows of 30, 22 and 15 real tokens, left-padded into one batch, sparse_from=25: each row reads as it does alone
    threshold = 25
    model, ref = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, 256, (n,), generator=g) for n in ROW_LENGTHS]
    read = dict(router="round_robin", page_size=4, sparse_from=threshold, **SPARSE_FROM_READS[mode])
    batch = PiKVCache(model, **read)
    in_batch = _decode(model, batch, rows)
    for i, row in enumerate(rows):
        alone = _decode(model, PiKVCache(model, **read), [row])[:, 0]
        assert (in_batch[:, i] - alone).abs().max() < 1e-5, f"row {i}"
        dense = _decode(ref, DynamicCache(), [row])[:, 0]
        # a row reads densely (equal to DynamicCache) until it has seen `threshold` positions of its own
        below = [s for s in range(len(DECODE_TOKENS)) if len(row) + s + 1 < threshold]
        if below:
            assert (in_batch[below, i] - dense[below]).abs().max() < 1e-4, f"row {i}"
        if len(below) < len(DECODE_TOKENS):  # the sparse read is a real approximation here, not the dense one
            assert (in_batch[len(below) :, i] - dense[len(below) :]).abs().max() > 1e-3, f"row {i}"
    assert len(below) == len(DECODE_TOKENS)  # the shortest row never reached the threshold
    stats = batch.routing_stats()["overall"]
    assert stats["sparse_steps"] == len(DECODE_TOKENS) * len(batch.layers)  # row 0 reads sparsely at every step
