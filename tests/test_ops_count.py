"""Operators an eager decode step dispatches (``benchmarks/count_ops.py``): every way of keeping the KV against
DynamicCache's count in the same run. A count, not a timing: the shapes of a step do not depend on the data, so the
numbers are the same on every run and machine, and do not depend on the model's sizes (a tiny model of 4 layers
gives the ratios of SmolLM2's shape at 4 layers)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))
import count_ops  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            vocab_size=256)  # fmt: skip
# Ratio to DynamicCache's count that each way must stay under at 4 layers: what this commit reaches, rounded up
# (count_ops.GOALS, issue 31: every way but Quest + 4-bit is under its goal). Quest + 4-bit counts 3 CPU-only
# operators per store and layer that size its plans for the CPU read (read.quest._used; 2.0 without them).
# H2O + offload + routed selects over its two tiers in one operator (StoreGroup.key_stats; the tiers' combined
# summary took 3.16x at 30 layers).
CEILINGS = {"exact": 1.03, "routed": 1.32, "quest_1_8": 1.48, "quant4": 1.18, "quest_quant4": 2.07,
            "h2o_offload_routed": 1.74}  # fmt: skip


def test_counter_counts_kernels_and_host_reads_apart():
    a, b = torch.ones(4), torch.ones(4)
    with count_ops.OpCounter() as c:
        s = a + b
        s.view(2, 2).reshape(4)
        torch.empty(3)
        int(s.sum())
    assert dict(c.counts) == {"add": 1, "sum": 1}
    assert c.host_reads == 1
    assert c.dispatched >= 5  # the views and the allocation were dispatched, not counted as kernels


@pytest.fixture(scope="module")
def counts():
    model = count_ops.llama(4, **TINY)
    ids = torch.randint(0, TINY["vocab_size"], (1, 512), generator=torch.Generator().manual_seed(0))
    return {way: sum(c.counts.values()) for way, c in count_ops.count_all(model, ids, list(count_ops.WAYS)).items()}


@pytest.mark.parametrize("way", list(CEILINGS))
def test_decode_step_operators_against_dynamic_cache(counts, way):
    ratio = counts[way] / counts["dynamic"]
    assert ratio <= CEILINGS[way], (way, counts[way], counts["dynamic"], ratio)


def test_count_is_deterministic(counts):
    model = count_ops.llama(4, **TINY)
    ids = torch.randint(0, TINY["vocab_size"], (1, 512), generator=torch.Generator().manual_seed(0))
    again = count_ops.count_way(model, "routed", ids)
    assert sum(again.counts.values()) == counts["routed"]
