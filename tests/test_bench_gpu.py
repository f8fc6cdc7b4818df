"""``benchmarks/bench_gpu.py --tiny``: the GPU benchmark's code path, run on the CPU with tiny shapes so that it cannot
rot before a GPU runs it. Every eager way has its numbers, PiKV exact generates DynamicCache's tokens (and compiled,
StaticCache's), ``generate`` compiles the exact step by itself, and ``make results`` renders the JSON as a section.

The compiled section runs a subset of the ways here (each costs a Dynamo trace of tens of seconds on a CPU); the
script's defaults compile every way."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pytest
from helpers import run_benchmark
from test_results_page import check_figures, rp

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "benchmarks"))

EAGER_WAYS = ["dynamic", "exact", "routed", "routed_1_8", "quest_1_8", "quant4", "quest_quant4", "h2o_offload_routed"]
COMPILED_WAYS = ["static", "exact", "routed_1_8"]  # a compiled 4-bit step: test_quant_ops, test_compile_state
NUMBERS = ["ms_per_token", "ms_ratio", "kernels_per_step", "busy_ms_per_step", "prefill_s", "read_fraction", "kv_bytes"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_root")
    out = root / "benchmarks" / "results" / "gpu_tiny.json"
    run_benchmark(
        "bench_gpu.py", "--tiny", "--out", str(out), "--compiled-ways", *COMPILED_WAYS, "--generate-ways", "exact",
        timeout=1200,
    )  # fmt: skip
    return root, out, json.loads(out.read_text())


def number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def test_every_eager_way_has_its_numbers(run):
    _, _, d = run
    assert d["complete"] and d["tiny"] is True
    assert [(p["shape"], p["batch"]) for p in d["eager"]] == [
        (s, b) for s in ("llama3.1-8b", "qwen3-30b-a3b-attn") for b in (1, 2)
    ]
    for point in d["eager"]:
        assert list(point["results"]) == EAGER_WAYS
        for way, r in point["results"].items():
            assert "error" not in r and "skipped" not in r, (point["shape"], way, r.get("error"))
            assert all(number(r[k]) and r[k] > 0 for k in NUMBERS), (way, {k: r[k] for k in NUMBERS})
            assert {"peak_prefill_bytes", "peak_decode_bytes"} <= set(r)  # measured on CUDA, None on a CPU
            assert len(r["tokens"]) == point["batch"] and len(r["tokens"][0]) == 1 + 3 + 5 + 2
        res = point["results"]
        assert res["dynamic"]["ms_ratio"] == 1.0
        assert res["exact"]["tokens"] == res["dynamic"]["tokens"] and res["exact"]["tokens_equal_baseline"]
        for way in ("routed", "routed_1_8", "quest_1_8", "quest_quant4", "h2o_offload_routed"):
            assert res[way]["read_fraction"] < 1.0, way  # the sparse ways read sparsely
        # the sink / window pages (4 + 64 tokens, read always) are a third of the tiny context: more than 1/8 read
        assert res["quest_1_8"]["read_fraction"] < 0.4
        assert res["h2o_offload_routed"]["offloaded_bytes"] > 0
        assert res["quant4"]["kv_bytes"] < res["exact"]["kv_bytes"]


def test_compiled_ways_and_generate(run):
    _, _, d = run
    (point,) = d["compiled"]
    assert list(point["results"]) == COMPILED_WAYS and point["batch"] == 2
    for way, r in point["results"].items():
        assert "error" not in r, (way, r.get("error"))
        assert all(number(r[k]) for k in NUMBERS) and r["graph_breaks"] == 0, way
    res = point["results"]
    assert res["exact"]["tokens"] == res["static"]["tokens"]  # the compiled exact step decodes StaticCache's tokens
    assert res["routed_1_8"]["read_fraction"] < 1.0
    (gen,) = d["generate"]
    g = gen["results"]["exact"]
    assert g["compiled_by_generate"] and g["graph_breaks"] == 0 and g["graphs_compiled"] == 1
    assert g["tokens_equal_eager"] and number(g["ms_per_token"])


def test_json_names_its_machine_versions_and_settings(run):
    _, out, d = run
    assert d["machine"]["device"] == "cpu" and d["git"]
    assert {"torch", "triton", "transformers", "kvpress"} <= set(d["versions"])
    cfg = d["config"]
    assert cfg["context"] == 256 and cfg["dtype"] == "float32" and cfg["compile"]["backend"] == "aot_eager"
    assert cfg["shapes"]["llama3.1-8b"]["real_layers"] == 32 and cfg["shapes"]["llama3.1-8b"]["layers"] == 2
    assert cfg["ways"]["routed"]["cache"]["num_shards"] == 256 and cfg["ways"]["routed"]["cache"]["sparse_from"] == 0
    assert out.with_suffix(".png").is_file()


def test_results_page_shows_the_gpu_json(run):
    root, _, _ = run
    built = rp.build(root)
    (section,) = [s for s in built.sections if s.title == "Decode on a GPU"]
    assert "PiKVCache exact" in section.markdown and "graph breaks" in section.markdown
    assert section.files and built.figures
    check_figures(root, built.figures, built.page)  # every figure recomputes from the source it records


def test_results_page_leaves_the_section_out_without_gpu_json():
    built = rp.build(ROOT)
    assert ("Decode on a GPU" in [s.title for s in built.sections]) == bool(list(ROOT.glob("benchmarks/results/gpu_*")))


def test_named_shapes_and_arguments():
    bench = importlib.import_module("bench_gpu")
    with pytest.raises(SystemExit):
        bench.parse_args(["--tiny", "--steps", "0"])
    qwen, llama = bench.SHAPES["qwen3-30b-a3b-attn"], bench.SHAPES["llama3.1-8b"]
    assert (qwen.heads, qwen.kv_heads, qwen.head_dim, qwen.hidden) == (32, 4, 128, 2048) and "dense" in qwen.note
    assert (llama.heads, llama.kv_heads, llama.head_dim, llama.hidden, llama.real_layers) == (32, 8, 128, 4096, 32)
    args = bench.parse_args(["--tiny"])
    assert (args.device, args.context, args.layers, args.compile_backend) == ("cpu", 256, 2, "aot_eager")
