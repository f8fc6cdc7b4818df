"""``benchmarks/kernel_resources.py`` at one tile size (the kernels compiled for sm_90 without a GPU): the loop it
counts is each split kernel's tile loop (it holds every tensor-core instruction of the kernel), the 4-bit kernels carry
fewer bytes per instruction than every 16-bit one (what RESULTS says of them), and the routed plan kernel keeps the
occupancy its sm_90 compile test holds it to."""

from __future__ import annotations

import json

import pytest
from helpers import run_benchmark


@pytest.mark.slow  # ~17 s of compiles (make test-slow); the sm_90 compile tests of the default suite hold the registers
def test_kernel_resources_benchmark_counts_the_tile_loop(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "resources.json"
    run_benchmark("kernel_resources.py", "--tiles", "32", "--out", str(out))
    d = json.loads(out.read_text())
    rows = d["split_kernels"]
    assert {r["kernel"] for r in rows} == {"dense, pages of 16", "dense, pages of 1", "4-bit, dequantised",
                                           "4-bit, codes dotted"}  # fmt: skip
    for r in rows:
        assert r["block_n"] == 32 and 0 < r["registers"] <= 255 and r["programs_per_sm"] >= 1, r
        assert 0 < r["loop_mma"] == r["kernel_mma"] and r["loop_instructions"] > r["loop_mma"], r
        assert r["warp_instructions_per_slot"] == pytest.approx(r["loop_instructions"] * r["warps"] / 32)
        assert r["bound_pct_of_peak"] == min(r["issue_bound_pct_of_peak"], r["conversion_bound_pct_of_peak"]), r
    # codes become floats from bits: the 4-bit loops keep only the softmax's packing conversions (10.5-12.5 per slot
    # with one integer-to-float conversion per code)
    assert max(r["conversions_per_slot"] for r in rows if r["bits"] == 4) < 5
    per_instr = {bits: [r["bytes_per_warp_instruction"] for r in rows if r["bits"] == bits] for bits in (4, 16)}
    assert max(per_instr[4]) < min(per_instr[16])
    plan = next(r for r in d["selection_kernels"] if r["kernel"] == "routed_plan")
    assert plan["registers"] <= 64 and plan["spill_bytes"] == 0 and plan["programs_per_sm"] == 8
