"""``benchmarks/kernels.py`` at tiny sizes on the CPU (the torch references timed), so that the script the GPU
sessions run cannot rot: every case's read equals gather + SDPA over the same pages, sparse cases read their share of
the pages, the kernel run with 2 splits (``--split-sweep``, interpreted) equals the backend's dense
read, the routed selection reads about the quarter of the tokens its cap allows, Quest's page scores read half the
bytes over bfloat16 bounds, and ``make results`` renders it all."""

from __future__ import annotations

import json

from helpers import run_benchmark
from test_results_page import check_figures, rp


def test_kernels_benchmark_runs_tiny_and_its_reads_equal_gather_and_sdpa(tmp_path):
    out = tmp_path / "benchmarks" / "results" / "kernels_tiny.json"
    run_benchmark("kernels.py", "--tokens", "512", "--batch", "1", "--page-sizes", "16", "1", "--repeats", "1",
                  "--split-sweep", "2", "--out", str(out))  # fmt: skip
    d = json.loads(out.read_text())
    assert d["complete"] and d["graph_step"] is None  # no CUDA graph on the CPU
    cases = d["cases"]
    assert {(c["page_size"], c["bits"]) for c in cases} == {(16, 32), (1, 32), (64, 4)}
    for c in cases:
        pages = 512 // c["page_size"]  # per (row, KV head); the case counts them over all
        assert c["pages_read"] == c["batch"] * c["kv_heads"] * max(1, round(c["selection_fraction"] * pages)), c
        if c["bits"] != 4:  # the fused read against gather + SDPA over the same pages (float32)
            assert c["max_abs_diff_vs_gather_sdpa"] < 1e-5, c
    for c in cases:  # the kernel itself (interpreted) with 2 splits equals the backend's dense read
        if c["selection_fraction"] == 1:
            sweep = c["split_sweep"]
            assert [r["splits"] for r in sweep["runs"]] == [2] and sweep["auto_splits"] == 1  # 1 off CUDA
            assert all(r["ms"] > 0 and r["max_abs_diff"] < 1e-5 for r in sweep["runs"]), sweep
        else:
            assert "split_sweep" not in c
    sel = d["routed_selection"]
    assert (sel["tokens"], sel["batch"], sel["shards"]) == (512, 1, 256)
    # at most a quarter of the shards (random keys: about a quarter of the tokens) plus 4 sinks and 64 recent tokens
    assert 0.2 < sel["read_fraction"] <= 0.25 * 1.25 + 68 / 512
    assert sel["select_ms"] > 0 and sel["plan_ms"] > 0
    quest = d["quest_selection"]
    assert (quest["tokens"], quest["batch"], quest["page_size"], quest["fraction"]) == (512, 1, 16, 0.125)
    kv_heads, head_dim = d["config"]["kv_heads"], d["config"]["head_dim"]
    for dtype, size in (("bfloat16", 2), ("float32", 4)):  # key min and max of 32 pages per KV head
        row = quest["scores"][dtype]
        assert row["bytes_read"] > 2 * kv_heads * 32 * head_dim * size and row["ms"] > 0 and row["pct_peak"] > 0
    half = quest["scores"]["float32"]["bytes_read"] - quest["scores"]["bfloat16"]["bytes_read"]
    assert half == 2 * kv_heads * 32 * head_dim * 2 and quest["select_ms"] > 0
    built = rp.build(tmp_path)  # the page's Kernels section from this JSON alone
    (section,) = [s for s in built.sections if s.title == "Kernels"]
    assert "Routed selection of one layer" in section.markdown and "Quest selection of one layer" in section.markdown
    check_figures(tmp_path, built.figures, built.page)  # every figure recomputes from the source it records
