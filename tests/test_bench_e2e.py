"""``benchmarks/bench_e2e.py --tiny --compile``: the end-to-end benchmark's compiled mode on a tiny random model, so
that it cannot rot. Every compiled way is compiled once (its first step), decodes the tokens of the same way eagerly
(and exact and StaticCache compiled, DynamicCache's), and carries its ratios to DynamicCache eager and to StaticCache
compiled. ``aot_eager`` stands in for inductor (a C++ build per way would take minutes on a CPU)."""

from __future__ import annotations

import json
import math

import pytest
from helpers import run_benchmark

WAYS = ["exact", "quest_1_8"]


@pytest.fixture(scope="module")
def point(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "e2e_tiny.json"
    run_benchmark(
        "bench_e2e.py", "--tiny", "--contexts", "192", "--batches", "1", "--steps", "2",
        "--rounds", "1", "--compile", "--compile-backend", "aot_eager", "--modes", "dynamic", *WAYS,
        "--compiled-modes", "static", *WAYS, "--note", "test run", "--out", str(out),
    )  # fmt: skip
    d = json.loads(out.read_text())
    assert d["note"] == "test run" and d["config"]["compile"]["backend"] == "aot_eager"
    assert len(d["points"]) == 1
    return d["points"][0]


def test_every_way_has_an_eager_and_a_compiled_row(point):
    rows = point["results"]
    assert set(rows) == {"dynamic", *WAYS, "static_compiled", *(w + "_compiled" for w in WAYS)}
    for name, row in rows.items():
        assert row["step"] == ("compiled" if name.endswith("_compiled") else "eager"), name
        assert "error" not in row, (name, row.get("error"))
        assert len(row["ms_all"]) == 2 and math.isfinite(row["ms_ratio"]) and row["ms_ratio"] > 0
        assert row["ms_ratio"] == pytest.approx(row["ms_per_token"] / rows["dynamic"]["ms_per_token"])
        if row["step"] == "compiled":
            assert len(row["warmup_s"]) == 3  # compiled at its first step, outside the timing
            static = rows["static_compiled"]["ms_per_token"]
            assert row["static_ratio"] == pytest.approx(row["ms_per_token"] / static)
        else:
            assert "static_ratio" not in row


def test_compiled_steps_decode_the_eager_tokens(point):
    rows = point["results"]
    reference = rows["dynamic"]["tokens"]
    assert len(reference[0]) == 1 + 3 + 2 and len(set(reference[0])) > 2  # prefill + warm-up + timed; tokens vary
    assert rows["static_compiled"]["tokens"] == reference
    assert rows["exact"]["tokens"] == reference and rows["exact_compiled"]["tokens"] == reference
    for way in WAYS:
        assert rows[way + "_compiled"]["tokens"] == rows[way]["tokens"], way


def test_compiled_caches_reserve_their_length(point):
    rows = point["results"]
    # max_cache_len = 192 + 3 + 2 + 8 = 205 tokens reserved; the dynamic cache holds the 192 + 5 it was fed
    assert rows["exact_compiled"]["kv_bytes"] > rows["exact"]["kv_bytes"]
    assert rows["static_compiled"]["kv_bytes"] == pytest.approx(rows["dynamic"]["kv_bytes"] * 205 / 197, rel=1e-9)
