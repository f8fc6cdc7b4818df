"""``benchmarks/held_bytes.py --tiny``: every way's bytes held beyond K/V split into what the stores' metadata, the
backend's workspace and the rest hold, each part checked against what that way must keep (computed here from the
shapes, independently of the cache's own accounting)."""

from __future__ import annotations

import json

import pytest
from helpers import run_benchmark

from pikv_hf.config import ReadConfig


@pytest.fixture(scope="module")
def points(tmp_path_factory):
    out = tmp_path_factory.mktemp("held") / "held.json"
    run_benchmark("held_bytes.py", "--tiny", "--out", str(out))
    d = json.loads(out.read_text())
    assert d["complete"] and d["tiny"] and d["goal_beyond_kv_over_fp16"] == 0.05
    return d["shapes"], {(p["shape"], p["way"]): p for p in d["points"]}, d["ways"]


def test_every_shape_and_way_has_its_parts(points):
    shapes, got, _ = points
    ways = ["exact", "routed", "routed_1_8", "quest_1_8", "quant4", "quest_quant4", "h2o_offload_routed"]
    assert sorted(got) == sorted((s, w) for s in shapes for w in ways)
    for (shape, way), p in got.items():
        s = shapes[shape]
        assert p["fp16_kv_bytes"] == 4 * p["tokens"] * s["kv_heads"] * s["head_dim"] * s["layers"]
        parts = p["kv_bytes"] + p["offloaded_bytes"] + p["meta_bytes"] + p["workspace_bytes"] + p["other_bytes"]
        assert p["other_bytes"] >= 0 and parts == p["held_bytes"], (shape, way, p)
        assert p["beyond_kv_over_fp16"] == pytest.approx(p["beyond_kv_bytes"] / p["fp16_kv_bytes"], abs=1e-4)
        assert p["met"] == (p["beyond_kv_bytes"] <= 0.05 * p["fp16_kv_bytes"])


def test_each_way_holds_what_it_must(points):
    shapes, got, _ = points
    for shape, s in shapes.items():
        fp16 = got[shape, "exact"]["fp16_kv_bytes"]
        exact, quant = got[shape, "exact"], got[shape, "quant4"]
        assert fp16 <= exact["kv_bytes"] <= 1.1 * fp16  # bf16 K/V of every token, pages rounded up
        assert quant["kv_bytes"] < 0.7 * fp16  # 4-bit codes behind a 128-token bf16 window (of ~500 tokens here)
        for way in ("exact", "quant4"):  # dense reads are views of the pool: no gather scratch
            assert got[shape, way]["read_fraction"] == 1.0
        assert exact["workspace_bytes"] == 0
        # the 4-bit read converts one code field at a time to uint8 and float32 (5 bytes a code): a layer's tier
        # holds the full pages of 64 of the tokens behind the 128-token window, each token head_dim / 2 codes a head
        per_token = 5 * s["head_dim"] // 2 * s["kv_heads"]
        behind = quant["tokens"] - 128
        assert (behind - 64) * per_token < quant["workspace_bytes"] <= behind * per_token
        for way in ("routed", "routed_1_8", "quest_1_8", "quest_quant4"):  # sparse reads gather into the scratch
            p = got[shape, way]
            assert 0 < p["workspace_bytes"] < fp16 / s["layers"] and p["read_fraction"] < 1.0, (shape, way, p)
        # the key-cluster placement's float32 centroids: 256 shards x head dim per layer and KV head
        centroids = 4 * 256 * s["head_dim"] * s["kv_heads"] * s["layers"]
        for way in ("routed", "routed_1_8", "h2o_offload_routed"):
            assert centroids <= got[shape, way]["other_bytes"] <= 1.2 * centroids, (shape, way)
        # Quest's key min / max of every page of 16 tokens, in the keys' bfloat16: a sixteenth of the fp16 KV
        quest = got[shape, "quest_1_8"]
        assert 0.0625 * fp16 <= quest["page_bounds_bytes"] <= 0.07 * fp16
        # besides them, Quest's stores keep the sink / recent-window slots of each (row, KV head): int64 slot ids and
        # positions, and an int64 reach per entry (batch 1)
        ring = (16 * s["kv_heads"] + 8) * (ReadConfig().n_sink + ReadConfig().window) * s["layers"]
        assert quest["meta_bytes"] - exact["meta_bytes"] == quest["page_bounds_bytes"] + ring
        h2o = got[shape, "h2o_offload_routed"]  # half of every head's tokens moved to the offload tier
        assert h2o["offloaded_bytes"] > 0.4 * fp16 and h2o["kv_bytes"] + h2o["offloaded_bytes"] >= fp16


def test_the_summaries_are_the_tensors_each_way_selects_from(points):
    """The summary parts, measured on the tensors by the attribute holding them, against their sizes from the shapes:
    float32 sums and squares of 256 shards x head dim once per routed layer (the dense first layer keeps none; H2O's
    offload tier keeps none: the hot store's count its tokens too), the placement's float32 centroids in every layer,
    Quest's two bounds of every page of 16 tokens in the keys' bfloat16 (pages of 64 over 4-bit codes: float32)."""
    shapes, got, ways = points
    for shape, s in shapes.items():
        per_layer = 4 * 256 * s["head_dim"] * s["kv_heads"]  # one float32 [S, D] per KV head
        for way, spec in ways.items():
            p = got[shape, way]
            routed = spec["cache"].get("attention") == "routed"
            sparse_layers = s["layers"] - spec["cache"].get("dense_layers", 0)
            assert p["shard_stats_bytes"] == (2 * per_layer * sparse_layers if routed else 0), (shape, way)
            assert p["centroids_bytes"] == (per_layer * s["layers"] if routed else 0), (shape, way)
            assert p["centroids_bytes"] <= p["other_bytes"]
            assert p["shard_stats_bytes"] + p["page_bounds_bytes"] <= p["meta_bytes"]
            if spec["cache"].get("attention") != "quest":
                assert p["page_bounds_bytes"] == 0, (shape, way)
                continue
            bounds = 2 * s["head_dim"] * s["kv_heads"] * s["layers"]  # bytes per page and byte per element
            if spec["presses"] == ["QuantPress"]:  # pages of 64: the hot window's in bfloat16, the 4-bit tier's float32
                pages = -(-p["tokens"] // 64)
                assert 2 * bounds * pages < p["page_bounds_bytes"] < 4 * bounds * pages, (shape, way)
            else:
                assert p["page_bounds_bytes"] == 2 * bounds * -(-p["tokens"] // 16), (shape, way)
