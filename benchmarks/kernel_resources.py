"""What the decode kernels cost a Hopper SM, without a GPU: each kernel compiled for sm_90 by triton's CUDA front end
(``tests/sm90.py``: pointers 16-byte aligned, as a launch specialises torch's tensors) at Llama-3.1-8B's decode shape
(4 query rows per KV head, head dim 128, bfloat16), then read from its cubin with the ``cuobjdump`` triton ships:

* ``registers`` and ``spill_bytes`` (stack) per thread, ``shared_bytes`` per program;
* ``programs_per_sm``: how many programs an H100 / H200 SM holds (65,536 registers in units of 256 per warp, 228 KiB of
  shared memory, 64 warps);
* for the split decode kernels, ``loop_instructions``: SASS instructions of one pass of the tile loop (``BLOCK_N``
  slots of one (row, KV head) for the GQA group; ``loop_mma`` / ``kernel_mma``: its tensor-core instructions and the
  kernel's, equal when the loop found is the tile loop), ``warp_instructions_per_slot`` = that x warps / ``BLOCK_N``,
  and ``bytes_per_slot`` (K/V fields, ``pos`` and ``valid``, per-page fields and the table entry shared by the page's
  slots, as ``benchmarks/kernels.py`` counts them). Their ratio, bytes per warp instruction, says whether a kernel can
  reach the bandwidth limit: an H100 SM issues at most 4 warp instructions a cycle (about 7.9 per ns at 1.98 GHz) and
  its share of 3.35 TB/s is 25.4 B/ns, so a read below about 3.2 B per warp instruction is bound by issuing
  instructions before it is bound by memory (``issue_bound_pct_of_peak``: the share of peak bandwidth at which the SM
  would issue every cycle);
* ``conversions_per_slot``: the loop's type conversions (``I2F``, ``I2FP``, ``F2F``, ``F2FP``, ``F2I``, each counted as
  one warp instruction) per slot; an SM converts 16 values a clock, against 128 float adds (CUDA C++ Programming
  Guide, arithmetic instruction throughput, compute capability 8.x and 9.0), so a warp conversion takes 2 clocks of
  the SM's converters: ``conversion_bound_pct_of_peak`` is the share of peak bandwidth at which they would be busy
  every cycle, and ``bound_pct_of_peak`` the lower of the two bounds.

Static numbers, not timings: they explain the GPU timings of ``benchmarks/kernels.py`` and rank designs before a GPU is
at hand. ~1 minute on a CPU.

    python benchmarks/kernel_resources.py       # writes benchmarks/results/kernel_resources_sm90.json
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "benchmarks")]
os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels (the interpreter's cannot be compiled)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from bench_cache import run_metadata, write_result  # noqa: E402
from sm90 import CODES, compile_sm90, cuobjdump, registers  # noqa: E402

from pikv_hf.kernels import decode, decode_quant, place_key, quest, route_select, routed_plan  # noqa: E402

REGS_PER_SM, SHARED_PER_SM, WARPS_PER_SM = 65536, 228 * 1024, 64
SM_ISSUE_PER_NS, SM_BYTES_PER_NS = 4 * 1.98, 3350 / 132  # H100 SXM: warp instructions and HBM bytes per SM per ns
SM_CONVERT_PER_NS = 16 / 32 * 1.98  # warp instructions of type conversion per SM per ns (16 values a clock)
CONVERSIONS = ("I2F", "I2FP", "F2F", "F2FP", "F2I")  # SASS opcodes of the conversion unit
D, G, GROUP = 128, 4, 64  # head dim, query rows per KV head, 4-bit value group


def loop_instructions(sass: str) -> tuple[int, int, int, int]:
    """``(instructions, tensor-core instructions, tensor-core instructions of the whole kernel, type conversions)`` of
    the longest loop: the span of the backward branch that covers the most addresses (the tile loop of a split kernel,
    which holds every dot)."""
    code = [(int(a, 16), text) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    spans = [(int(m.group(1), 16), a) for a, text in code if (m := re.search(r"BRA (0x[0-9a-f]+)", text))]
    spans = [(lo, hi) for lo, hi in spans if lo < hi]
    mma = sum("MMA" in text for _, text in code)
    if not spans:
        return 0, 0, mma, 0
    lo, hi = max(spans, key=lambda s: s[1] - s[0])
    body = [text for a, text in code if lo <= a <= hi]
    opcodes = [re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0] for text in body]
    return len(body), sum("MMA" in text for text in body), mma, sum(op in CONVERSIONS for op in opcodes)


def occupancy(regs: int, shared: int, warps: int) -> int:
    """Programs of ``warps`` warps an SM holds (registers allocated per warp in units of 256)."""
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = REGS_PER_SM // (per_warp * warps)
    by_shared = SHARED_PER_SM // shared if shared else WARPS_PER_SM
    return min(by_regs, by_shared, WARPS_PER_SM // warps)


def resources(compiled, warps: int) -> dict:
    regs, stack = registers(compiled)
    shared = compiled.metadata.shared
    return {"registers": regs, "spill_bytes": stack, "shared_bytes": shared, "warps": warps,
            "programs_per_sm": occupancy(regs, shared, warps)}  # fmt: skip


def split_row(
    name: str, bits: int, kernel, types: dict | None, const: dict, block_n: int, warps: int, stages: int, maxnreg,
    per_slot,
):  # fmt: skip
    """One configuration of a split decode kernel, with its loop's instructions against the bytes it reads."""
    options = {"num_warps": warps, "num_stages": stages} | ({"maxnreg": maxnreg} if maxnreg else {})
    compiled = compile_sm90(kernel, const | {"BLOCK_N": block_n}, types, **options)
    row = {
        "kernel": name,
        "bits": bits,
        "block_n": block_n,
        "stages": stages,
        "maxnreg": maxnreg,
        **resources(compiled, warps),
    }
    loop, loop_mma, mma, conversions = loop_instructions(cuobjdump(compiled, "-sass"))
    per_slot_instr = loop * warps / block_n
    per_slot_conv = conversions * warps / block_n
    issue = 100 * min(1.0, per_slot / per_slot_instr * SM_ISSUE_PER_NS / SM_BYTES_PER_NS)
    convert = 100 * min(1.0, per_slot / per_slot_conv * SM_CONVERT_PER_NS / SM_BYTES_PER_NS) if conversions else 100.0
    row.update(
        loop_instructions=loop,
        loop_mma=loop_mma,
        kernel_mma=mma,
        warp_instructions_per_slot=per_slot_instr,
        bytes_per_slot=per_slot,
        bytes_per_warp_instruction=per_slot / per_slot_instr,
        issue_bound_pct_of_peak=issue,
        conversions_per_slot=per_slot_conv,
        conversion_bound_pct_of_peak=convert,
        bound_pct_of_peak=min(issue, convert),
    )
    print(f"{name:28s} BLOCK_N {block_n:3d} warps {warps} stages {stages} cap {maxnreg or '-':>3}: "
          f"{row['registers']:3d} regs, {row['spill_bytes']:4d} B spilled, {row['programs_per_sm']} per SM, "
          f"{per_slot_instr:5.1f} warp instr / slot, {row['bytes_per_warp_instruction']:5.2f} B / warp instr, "
          f"{per_slot_conv:5.2f} conversions / slot: bound at {row['bound_pct_of_peak']:5.1f}% of peak",
          flush=True)  # fmt: skip
    return row


def split_kernels(tiles: list[int]) -> list[dict]:
    """The dense (pages of 16 and of 1), generic 4-bit and 4-bit codes split kernels over every autotune
    configuration whose tile is in ``tiles``."""
    common = dict(G=G, Q=1, DK=D, DV=D, BLOCK_R=16, HAS_LEN=True, HAS_FULL=False, HAS_SLIDING=False,
                  DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32", GROUP=GROUP, SPAN=4096)  # fmt: skip
    dense_slot = 2 * D * 2 + 5  # K and V, pos (4 B) and valid (1 B)
    quant_slot = D + 2 * 2 + 5 + (2 * 2 * D + 8) / 64  # codes, value scale / zero, pos / valid; per page of 64
    cases = [
        ("dense, pages of 16", decode._split_kernel, None, common | dict(PAGE=16, BITS=0, TABLE=1), decode._CONFIGS,
         decode._CAPPED, dense_slot + 8 / 16),
        ("dense, pages of 1", decode._split_kernel, None, common | dict(PAGE=1, BITS=0, TABLE=1), decode._CONFIGS,
         decode._CAPPED, dense_slot + 8),
        ("4-bit, dequantised", decode._split_kernel, CODES, common | dict(PAGE=64, BITS=4, TABLE=1),
         decode._CONFIGS, decode._CAPPED, quant_slot),
        ("4-bit, codes dotted", decode_quant._split_q4_kernel, None, common | dict(PAGE=64, TABLE=1),
         decode_quant._Q4_CONFIGS, decode_quant._Q4_CAPPED, quant_slot),
    ]  # fmt: skip
    rows = []
    for name, kernel, types, const, configs, capped, per_slot in cases:
        if "BLOCK_DK" in kernel.arg_names:
            const = const | dict(BLOCK_DK=D, BLOCK_DV=D)
        runs = [(*c, None) for c in configs] + [(*c, decode._REG_CAP) for c in capped]
        for n, w, st, cap in runs:
            if n in tiles:
                rows.append(
                    split_row(name, 4 if "4-bit" in name else 16, kernel, types, const, n, w, st, cap, per_slot)
                )
    return rows


def selection_kernels() -> list[dict]:
    """The routed step's selection, plan and placement kernels and Quest's page scores as the sm_90 compile tests
    build them, each with the warps it launches with."""
    cases = [
        ("route_select (top-p)", route_select._route_select_kernel,
         dict(G=G, D=D, BLOCK_G=G, BLOCK_S=64, BLOCK_D=32, HAS_MASS=True), 4),
        ("routed_plan", routed_plan._routed_plan_kernel,
         dict(BLOCK=routed_plan._BLOCK, TILE=routed_plan._TILE, BLOCK_NS=128, ENTRIES=routed_plan._ENTRIES), 4),
        ("place_key", place_key._place_key_kernel, dict(D=D, BLOCK_S=64, BLOCK_D=D), 4),
        ("quest_scores (pages of 16)", quest._scores_kernel,
         dict(G=G, D=D, P=16, BLOCK_W=quest._BLOCK_W, BLOCK_D=D, BLOCK_P=16, BLOCK_S=128), quest._SCORES_WARPS),
    ]  # fmt: skip
    rows = []
    for name, kernel, const, warps in cases:
        row = {"kernel": name, **resources(compile_sm90(kernel, const, num_warps=warps, num_stages=2), warps)}
        print(f"{name:28s} {row['registers']:3d} regs, {row['spill_bytes']:4d} B spilled, {row['programs_per_sm']} "
              "per SM", flush=True)  # fmt: skip
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiles", type=int, nargs="+", default=[32, 64, 128], help="BLOCK_N of the configs kept")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/kernel_resources_sm90.json")
    args = parser.parse_args()
    result = {
        "benchmark": "kernel_resources",
        "command": " ".join(["python", *sys.argv]),
        **run_metadata(1),
        "target": "sm_90 (H100 / H200), compiled without a GPU",
        "triton": triton.__version__,
        "shape": {"query_rows_per_kv_head": G, "head_dim": D, "dtype": "bfloat16", "value_group": GROUP},
        "sm": {"registers": REGS_PER_SM, "shared_bytes": SHARED_PER_SM, "warps": WARPS_PER_SM,
               "issue_warp_instructions_per_ns": SM_ISSUE_PER_NS, "hbm_bytes_per_ns": SM_BYTES_PER_NS,
               "conversion_warp_instructions_per_ns": SM_CONVERT_PER_NS},
        "split_kernels": split_kernels(args.tiles),
        "selection_kernels": selection_kernels(),
    }  # fmt: skip
    write_result(args.out, result)


if __name__ == "__main__":
    main()
