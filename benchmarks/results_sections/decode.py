"""Decode speed: the exact cache against DynamicCache, routed decode at long context, the working tree against an
earlier revision, and the decode attention kernels (with their README headline rows)."""

from __future__ import annotations

import re

from .framework import BENCH, NA_READS, Body, Recorder, agg, at, machine_text, row, table, target_bound, verdict

# ------------------------------------------------------------------------------------------------ exact vs Dynamic

CACHE_EXACT = f"{BENCH}/cache_exact_cpu.json"


def cache_exact(rec: Recorder) -> Body:
    """Exact-mode PiKVCache against DynamicCache: decode time and KV bytes per context."""
    p = CACHE_EXACT
    d = rec.load(p)
    c, t = d["config"], d["targets"]
    rows = []
    for i, res in enumerate(d["results"]):
        r = f"results.{i}."
        rows.append(
            [
                str(res["context"]),
                rec.fig("ms", at(p, r + "dynamic.decode_ms_median")),
                rec.fig("ms", at(p, r + "pikv.decode_ms_median")),
                rec.fig("r2", at(p, r + "decode_ratio_pikv_over_dynamic")),
                rec.fig("mib", at(p, r + "dynamic.kv_bytes")),
                rec.fig("r3", at(p, r + "kv_bytes_ratio_pikv_over_dynamic")),
                rec.fig("r3", at(p, r + "total_bytes_ratio_pikv_over_dynamic")),
                rec.fig("x", at(p, r + "pikv_decode_over_bound")),
                rec.fig("s", at(p, r + "dynamic.prefill_s")) + " / " + rec.fig("s", at(p, r + "pikv.prefill_s")),
            ]
        )
    header = ["context", "decode ms/token Dynamic", "PiKV", "PiKV / Dynamic", "KV MiB Dynamic"]
    header += ["KV bytes PiKV / Dynamic", "with metadata", "PiKV decode vs K/V read bound", "prefill s Dynamic / PiKV"]
    time = agg("max", p, "results", "decode_ratio_pikv_over_dynamic")
    size = agg("max", p, "results", "kv_bytes_ratio_pikv_over_dynamic")
    goals = (
        f"Targets recorded in the JSON: decode step <= {rec.fig('r2', at(p, 'targets.decode_ratio_max'))}x "
        f"DynamicCache's (worst {rec.fig('r2', time)}): {verdict(rec.value(time) <= t['decode_ratio_max'])}; KV bytes "
        f"<= {rec.fig('r2', at(p, 'targets.kv_bytes_ratio_max'))}x (worst {rec.fig('r3', size)}): "
        f"{verdict(rec.value(size) <= t['kv_bytes_ratio_max'])}."
    )
    return Body(
        measured=(
            "prefill time, per-token decode time (median) and allocated KV bytes of PiKVCache in exact mode against "
            f"DynamicCache + SDPA, side by side in one process; random weights, {c['num_hidden_layers']} layers, "
            f"{c['num_attention_heads']} query / {c['num_key_value_heads']} KV heads, head_dim {c['head_dim']}, "
            f"{c['dtype']}, batch {c['batch']}, router {c['router']}, pages of {c['page_size']}"
        ),
        commands=[d["command"]],
        machine=machine_text(rec, p),
        reads=NA_READS,
        budget="none (exact: every token stored and read)",
        text=table(header, rows) + "\n\n" + goals,
    )


# --------------------------------------------------------------------------------------------------- decode speed

DECODE_SPEED = (f"{BENCH}/decode_speed_cpu.json", f"{BENCH}/decode_speed_page1_cpu.json")


def decode_rows(rec: Recorder, p: str) -> list[list[str]]:
    """One table row per context of a ``bench_decode`` JSON."""
    rows = []
    for i, res in enumerate(rec.load(p)["results"]):
        r = f"results.{i}."
        ms = [rec.fig("ms", at(p, r + f"{mode}.attn_ms")) for mode in ("dynamic", "exact", "routed")]
        step = [rec.fig("ms", at(p, r + f"{mode}.step_ms")) for mode in ("dynamic", "exact", "routed")]
        floor = [
            f"{rec.fig('ms', at(p, r + f'routed.matmul_floor_{t}.ms'))} "
            f"({rec.fig('x', at(p, r + f'routed.matmul_floor_{t}.over_bound'))})"
            for t in ("fp32", "bf16")
        ]
        rows.append(
            [
                str(res["context"]),
                " / ".join(ms),
                rec.fig("x", at(p, r + "routed.attn_over_bound"))
                + " / "
                + rec.fig("x", at(p, r + "routed.attn_over_roofline")),
                " / ".join(floor),
                " / ".join(step),
                rec.fig("r3", at(p, r + "routed.routing.kv_read_vs_dense")),
                rec.fig("x", at(p, r + "ratios.attn_dynamic_over_routed"))
                + " / "
                + rec.fig("x", at(p, r + "ratios.step_dynamic_over_routed")),
            ]
        )
    return rows


def decode_goals(rec: Recorder, p: str) -> str:
    """Each target the JSON records, with the measured value and met / not met."""
    d = rec.load(p)
    t = d["targets"]
    out = []
    for name, ratio_key in (("attn", "attn_dynamic_over_routed"), ("step", "step_dynamic_over_routed")):
        key = next(k for k in t if k.startswith(f"{name}_dynamic_over_routed_min_at_"))
        context = int(re.search(r"_at_(\d+)k$", key).group(1)) * 1024
        if any(r["context"] == context for r in d["results"]):
            src = row(p, "results", f"ratios.{ratio_key}", context=context)
            ok = rec.value(src) >= t[key]
            out.append(
                f"{'attention' if name == 'attn' else 'decode step'} >= {rec.fig('x', at(p, f'targets.{key}'))} "
                f"faster than Dynamic+SDPA at {context}: {rec.fig('x', src)}, {verdict(ok)}"
            )
    worst = agg("max", p, "results", "routed.attn_over_bound")
    out.append(
        f"routed attention within {rec.fig('x', at(p, 'targets.attn_routed_over_bound_max'))} of its bytes bound: "
        f"worst {rec.fig('x', worst)}, {verdict(rec.value(worst) <= t['attn_routed_over_bound_max'])}"
    )
    slowest = agg("min", p, "results", "ratios.attn_dynamic_over_exact")
    out.append(
        f"exact attention no slower than Dynamic+SDPA: slowest Dynamic / exact {rec.fig('r2', slowest)}, "
        f"{verdict(rec.value(slowest) >= 1)}"
    )
    return "Targets recorded in the JSON: " + "; ".join(out) + "."


def page_size_comparison(rec: Recorder) -> str:
    """Routed attention with pages of 1 over pages of 16, per context both files share."""
    p16, p1 = DECODE_SPEED
    c16 = {r["context"] for r in rec.load(p16)["results"]}
    parts = []
    for context in (r["context"] for r in rec.load(p1)["results"] if r["context"] in c16):
        pair = [row(p, "results", "routed.attn_ms", context=context) for p in (p1, p16)]
        parts.append(f"{context}: {rec.fig('r2', *pair, combine='ratio')}")
    return "Routed attention time, pages of 1 over pages of 16 (separate runs): " + ", ".join(parts) + "."


def decode_speed(rec: Recorder) -> Body:
    """Decode attention and step times at long context, pages of 16 and of 1."""
    present = [p for p in DECODE_SPEED if rec.exists(p)]
    header = ["context", "attention ms Dynamic / exact / routed", "routed vs bytes bound / roofline"]
    header += ["matmul floor ms fp32 / bf16 (vs bound)", "decode step ms Dynamic / exact / routed"]
    header += ["routed KV read vs dense", "Dynamic / routed: attention / step"]
    parts = []
    for p in present:
        c = rec.load(p)["config"]
        parts.append(
            f"`{p}`: pages of {c['page_size']}\n\n{table(header, decode_rows(rec, p))}\n\n{decode_goals(rec, p)}"
        )
    if len(present) == len(DECODE_SPEED):
        parts.append(page_size_comparison(rec))
    c = rec.load(present[0])["config"]
    return Body(
        measured=(
            "one layer's decode attention and the whole decode step of DynamicCache + SDPA, PiKVCache exact and "
            f"PiKVCache routed (top {c['top_k_shards']} of {c['shards']} shards, {c['n_sink']} sinks, window "
            f"{c['window']}), caches filled with random K/V, router {c['router']}; {c['num_hidden_layers']} layers, "
            f"{c['num_attention_heads']} query / {c['num_key_value_heads']} KV heads, head_dim {c['head_dim']}, "
            f"{c['dtype']}. Bytes bound = K/V bytes read / measured read bandwidth; roofline = max(bytes bound, FLOPs "
            "/ measured matmul rate); matmul floor = the two attention matmuls alone on contiguous tensors"
        ),
        commands=[rec.load(p)["command"] for p in present],
        machine="; ".join(f"`{p}`: {machine_text(rec, p)}" for p in present),
        reads=NA_READS + "; routed reads are query-aware (each step selects with its own query)",
        budget=f"routed: top {c['top_k_shards']} of {c['shards']} shards per KV head plus sinks and window",
        text="\n\n".join(parts),
    )


# ---------------------------------------------------------------------------------------------- decode regression

DECODE_REGRESSION = (f"{BENCH}/decode_regression_cpu.json", f"{BENCH}/decode_regression_page1_cpu.json")
REGRESSION_KEYS = ("exact_attn_ms", "routed_attn_ms", "exact_step_ms", "routed_step_ms", "dynamic_attn_ms")


def regression_table(rec: Recorder, p: str) -> str:
    """New over base times per context of one ``compare_revisions`` JSON, with its target."""
    rows = []
    for i, res in enumerate(rec.load(p)["results"]):
        cells = [str(res["context"])]
        for key in REGRESSION_KEYS:
            r = f"results.{i}.{key}."
            base, new = rec.fig("ms", at(p, r + "base")), rec.fig("ms", at(p, r + "new"))
            cells.append(f"{base} / {new} ({rec.fig('r2', at(p, r + 'new_over_base'))})")
        rows.append(cells)
    header = ["context", *(f"{k.replace('_ms', '')} ms base / new (ratio)" for k in REGRESSION_KEYS)]
    d = rec.load(p)
    bound = target_bound(d["target"])
    checks = []
    for key in ("exact_attn_ms", "routed_attn_ms"):
        worst = agg("max", p, "results", f"{key}.new_over_base")
        checks.append(f"{key} worst {rec.fig('r2', worst)}: {verdict(rec.value(worst) <= bound)}")
    return (
        f"`{p}`: base revision `{d['base_revision']}`; {d['note']}.\n\n{table(header, rows)}\n\n"
        f"Target recorded in the JSON: {d['target']}. " + "; ".join(checks) + "."
    )


def decode_regression(rec: Recorder) -> Body:
    """The working tree's decode speed against the base revision."""
    present = [p for p in DECODE_REGRESSION if rec.exists(p)]
    return Body(
        measured=(
            "decode speed of the working tree against an earlier revision, both trees' `bench_decode.py` run "
            "alternately in one process tree (dynamic attention is the control: its code did not change)"
        ),
        commands=[rec.load(p)["command"] for p in present],
        machine="; ".join(f"`{p}`: {machine_text(rec, p)}" for p in present),
        reads=NA_READS,
        budget="as in Decode speed",
        text="\n\n".join(regression_table(rec, p) for p in present),
    )


# -------------------------------------------------------------------------------------------------------- kernels

KERNELS_GLOB = f"{BENCH}/kernels_*.json"


def kernel_table(rec: Recorder, p: str) -> str:
    """One kernels JSON: the cases and the backend they ran on (columns a run did not measure show ``-``)."""
    d = rec.load(p)
    rows = []
    for i, case in enumerate(d["cases"]):
        k = f"cases.{i}."

        def cell(fmt: str, field: str, k: str = k, case: dict = case) -> str:
            return rec.fig(fmt, at(p, k + field)) if case.get(field) is not None else "-"

        def paired(ms: str, ratio: str, k: str = k, case: dict = case) -> str:
            if case.get(ms) is None:
                return "-"
            return f"{rec.fig('ms', at(p, k + ms))} ({rec.fig('x', at(p, k + ratio))})"

        rows.append(
            [
                str(case["tokens"]),
                str(case.get("page_size", d["config"].get("page_size"))),
                str(case.get("bits", 16)),
                str(case["selection_fraction"]),
                rec.fig("ms", at(p, k + "ms")),
                rec.fig("gbs", at(p, k + "gb_s")),
                rec.fig("pct", at(p, k + "pct_peak")),
                cell("ms", "graph_ms"),
                paired("sdpa_full_ms", "speedup_vs_sdpa_full"),
                paired("gather_sdpa_ms", "speedup_vs_gather_sdpa"),
                cell("sci", "max_abs_diff_vs_gather_sdpa"),
            ]
        )
    header = ["tokens", "page", "bits", "share of pages read", "ms", "GB/s", "% of peak", "ms in a CUDA graph"]
    header += ["SDPA full ms (speedup)", "gather + SDPA ms (speedup)", "max abs diff vs gather + SDPA"]
    text = f"`{p}`: backend {d['backend']}; peak {rec.fig('gbs', at(p, 'peak_gbs'))} GB/s ({d['peak_source']})"
    early = d.get("complete") is False
    text += "; **the run stopped early** (the rows below are those it wrote).\n\n" if early else ".\n\n"
    text += table(header, rows)
    g = d.get("graph_step")
    if g:
        text += (
            f"\n\nA captured attention step of {g['layers']} layers ({g['tokens']} tokens x batch {g['batch']}, "
            f"{g['selection_fraction']} of the pages read): {rec.fig('ms', at(p, 'graph_step.ms'))} ms against a bytes "
            f"bound of {rec.fig('ms', at(p, 'graph_step.bound_ms'))} ms "
            f"({rec.fig('x', at(p, 'graph_step.over_bound'))})."
        )
    sel = d.get("routed_selection")
    if sel:

        def graph(name: str) -> str:
            return f" ({rec.fig('ms', at(p, 'routed_selection.' + name))} in a CUDA graph)" if name in sel else ""

        text += (
            f"\n\nRouted selection of one layer ({sel['tokens']} tokens x batch {sel['batch']}, {sel['shards']} "
            "shards of one-token pages, top-p 0.97 capped at a quarter of the shards, 4 sinks and 64 recent tokens): "
            f"route_select {rec.fig('ms', at(p, 'routed_selection.select_ms'))} ms{graph('select_graph_ms')}, "
            f"routed_plan {rec.fig('ms', at(p, 'routed_selection.plan_ms'))} ms{graph('plan_graph_ms')}, planning "
            f"a read of {rec.fig('r3', at(p, 'routed_selection.read_fraction'))} of the tokens."
        )
    qs = d.get("quest_selection")
    if qs:
        k = "quest_selection.scores."

        def scored(dtype: str) -> str:
            graph = f", {rec.fig('ms', at(p, k + dtype + '.graph_ms'))} ms in a CUDA graph" if "graph_ms" in qs[
                "scores"][dtype] else ""  # fmt: skip
            return (f"{rec.fig('ms', at(p, k + dtype + '.ms'))} ms over {dtype} bounds "
                    f"({rec.fig('pct', at(p, k + dtype + '.pct_peak'))}% of peak{graph})")  # fmt: skip

        text += (
            f"\n\nQuest selection of one layer ({qs['tokens']} tokens x batch {qs['batch']}, pages of "
            f"{qs['page_size']}, {qs['fraction']} of them read): quest_scores {scored('bfloat16')} and "
            f"{scored('float32')}; quest_select {rec.fig('ms', at(p, 'quest_selection.select_ms'))} ms."
        )
    targets = d["targets"]
    if isinstance(targets, dict):
        measured = targets.get("measured", {})

        def state(name: str, ok: bool | None) -> str:  # nothing measured (older JSON: met False) is not "not met"
            if ok is None or measured.get(name, True) in (None, []):
                return "not measured"
            return "met" if ok else "not met"

        met = ", ".join(f"{name} {state(name, ok)}" for name, ok in targets["met"].items())
        text += f"\n\nTargets of issue 32 (from the eager `ms` column, host overhead included): {met}."
    else:
        text += f"\n\nTargets: {targets}."
    return text


def kernels(rec: Recorder) -> Body:
    """Decode attention kernels against SDPA and gather + SDPA."""
    files = rec.glob(KERNELS_GLOB)
    c = rec.load(files[0])["config"]
    return Body(
        measured=(
            f"decode attention through the backend seam, dense and sparse reads of one layer's pages ({c['heads']} "
            f"query / {c['kv_heads']} KV heads, head_dim {c['head_dim']}, pages as each row says, {c['dtype']}; "
            f"selection: {c['selection']}; bytes read: {c['bytes_read']}), against SDPA over the whole cache and "
            "gather + SDPA over the same pages; random keys (speed only)"
        ),
        commands=[rec.load(p)["command"] for p in files],
        machine="; ".join(machine_text(rec, p) for p in files),
        reads=NA_READS,
        budget="share of each (row, KV head)'s pages read, per case",
        text="\n\n".join(kernel_table(rec, p) for p in files),
    )


# ------------------------------------------------------------------------------------------------ kernel resources

KERNEL_RESOURCES = f"{BENCH}/kernel_resources_sm90.json"
KERNEL_RESOURCES_BEFORE = f"{BENCH}/kernel_resources_sm90_26a5023.json"  # codes converted by I2F, one per code
KERNEL_RESOURCES_BYTES = f"{BENCH}/kernel_resources_sm90_bbdcaf6.json"  # 4-bit keys as bytes, a dot pair per group


def kernel_resources(rec: Recorder) -> Body:
    """Registers, spills, occupancy and instructions per slot of the decode kernels compiled for sm_90."""
    p = KERNEL_RESOURCES
    d = rec.load(p)
    rows = []
    for i, r in enumerate(d["split_kernels"]):
        k = f"split_kernels.{i}."
        rows.append(
            [r["kernel"], str(r["block_n"]), str(r["warps"]), str(r["stages"]), str(r["maxnreg"] or "-")]
            + [rec.fig("int", at(p, k + f)) for f in ("registers", "spill_bytes", "programs_per_sm")]
            + [rec.fig("r1", at(p, k + f)) for f in ("warp_instructions_per_slot", "bytes_per_slot")]
            + [
                rec.fig("r2", at(p, k + "bytes_per_warp_instruction")),
                rec.fig("pct", at(p, k + "issue_bound_pct_of_peak")),
                rec.fig("r2", at(p, k + "conversions_per_slot")),
                rec.fig("pct", at(p, k + "conversion_bound_pct_of_peak")),
            ]
        )
    header = ["kernel", "BLOCK_N", "warps", "stages", "register cap", "registers / thread", "spilled B / thread",
              "programs / SM", "warp instructions / slot", "bytes / slot", "bytes / warp instruction",
              "issue-bound % of HBM peak", "conversions / slot", "conversion-bound % of HBM peak"]  # fmt: skip
    text = table(header, rows)
    small = [
        [r["kernel"]]
        + [
            rec.fig("int", at(p, f"selection_kernels.{i}.{f}"))
            for f in ("warps", "registers", "spill_bytes", "programs_per_sm")
        ]
        for i, r in enumerate(d["selection_kernels"])
    ]
    text += "\n\n" + table(
        ["selection kernel", "warps", "registers / thread", "spilled B / thread", "programs / SM"], small
    )

    def span(field: str, bits: int, fmt: str = "r1") -> str:
        lo = rec.fig(fmt, agg("min", p, "split_kernels", field, bits=bits))
        return f"{lo}-{rec.fig(fmt, agg('max', p, 'split_kernels', field, bits=bits))}"

    def best(path: str, kernel: str) -> str:
        return rec.fig("pct", agg("max", path, "split_kernels", "bound_pct_of_peak", kernel=kernel))

    before = KERNEL_RESOURCES_BEFORE
    text += (
        f"\n\nThe split kernels of 16-bit pages carry {span('bytes_per_warp_instruction', 16)} bytes per warp "
        "instruction, so memory bounds them long before instruction issue does; the 4-bit kernels carry "
        f"{span('bytes_per_warp_instruction', 4)}, so an SM issuing every cycle would read 4-bit pages at "
        f"{span('issue_bound_pct_of_peak', 4, 'pct')}% of HBM peak at most: they are bound by instructions "
        "(unpacking, per-tile reductions)."
    )
    if rec.exists(before):  # the earlier kernels' files: each paragraph only with its file (one missing: no page)
        text += (
            " Their codes become floats from bits (`decode._exact_float`, `decode_quant._dot_codes`: the code as the "
            "mantissa of a float whose ulp is 1, less that float) instead of one integer-to-float conversion each, "
            "which an SM runs at 16 a clock: in the kernels of 26a5023 "
            f"(`{before.rsplit('/', 1)[-1]}`) the conversions bounded the 4-bit kernels before instruction issue did, "
            f"{rec.fig('r2', agg('min', before, 'split_kernels', 'conversions_per_slot', bits=4))}-"
            f"{rec.fig('r2', agg('max', before, 'split_kernels', 'conversions_per_slot', bits=4))} per slot. The best "
            "configuration of each, bound at the lower of the two bounds: codes dotted "
            f"{best(before, '4-bit, codes dotted')}% of peak then, {best(p, '4-bit, codes dotted')}% now; dequantised "
            f"{best(before, '4-bit, dequantised')}% then, {best(p, '4-bit, dequantised')}% now. On the H100 and H200 "
            "(before these changes) the 4-bit kernels read 4-bit pages no faster than the 16-bit kernel reads 16-bit "
            "ones; the next GPU run measures them."
        )
    words = KERNEL_RESOURCES_BYTES
    q4 = "4-bit, codes dotted"

    def fewest(path: str) -> str:
        return rec.fig("r1", agg("min", path, "split_kernels", "warp_instructions_per_slot", kernel=q4))

    if rec.exists(words):
        text += (
            " Then the 4-bit kernel read its key codes as bytes, whose dot operand the compiled code loaded from "
            "shared memory a byte at a time (SASS `LDS.U8`), and took a pair of dots per value group over the whole "
            "head, masking off the other groups' columns. It now reads key codes as 16-bit words (four code fields, "
            "channels `4i + j`, against the same channels of the query) and the value groups as the batch of one "
            f"pair of batched dots (`{words.rsplit('/', 1)[-1]}` holds the kernels before): best configuration "
            f"{fewest(words)} -> {fewest(p)} warp instructions per slot, bound at {best(words, q4)}% -> "
            f"{best(p, q4)}% of peak. Its dims must now be >= 64 (keys) with value groups of >= 32 channels; "
            "smaller ones take the dequantising kernel."
        )
    return Body(
        measured=(
            f"each decode kernel compiled for {d['target']} by triton {d['triton']} (pointers 16-byte aligned, as a "
            f"launch specialises them), Llama-3.1-8B's decode shape ({d['shape']['query_rows_per_kv_head']} query rows "
            f"per KV head, head dim {d['shape']['head_dim']}, {d['shape']['dtype']}, 4-bit value groups of "
            f"{d['shape']['value_group']}), every autotune configuration; registers and spills read from the cubin, "
            "SASS instructions of one pass of the tile loop, programs per SM from registers, shared memory and warps; "
            "issue-bound share of peak: bytes per warp instruction x 4 issues per cycle at 1.98 GHz over an H100 SM's "
            "share of 3.35 TB/s; conversion-bound share: the same with the loop's type conversions (I2F, F2F, F2FP, "
            "F2I, each one warp instruction) at 16 values a clock per SM (CUDA C++ Programming Guide, arithmetic "
            "instruction throughput, compute capability 9.0) (static numbers, not timings)"
        ),
        commands=[d["command"], *(rec.load(f)["command"] for f in (before, words) if rec.exists(f))],
        machine=machine_text(rec, p),
        reads=NA_READS,
        budget="not applicable",
        text=text,
    )


# ---------------------------------------------------------------------------------------------------- headline


def largest_context(rec: Recorder, path: str) -> int:
    """Index of the result row with the largest context."""
    results = rec.load(path)["results"]
    return max(range(len(results)), key=lambda i: results[i]["context"])


def headline_exact(rec: Recorder) -> tuple[str, str, str] | None:
    """Exact mode at the largest context."""
    p = CACHE_EXACT
    if not rec.exists(p):
        return None
    i = largest_context(rec, p)
    r = f"results.{i}."
    return (
        f"Exact mode vs DynamicCache, {rec.load(p)['results'][i]['context']} tokens",
        f"decode {rec.fig('ms', at(p, r + 'pikv.decode_ms_median'))} vs "
        f"{rec.fig('ms', at(p, r + 'dynamic.decode_ms_median'))} ms/token "
        f"({rec.fig('r2', at(p, r + 'decode_ratio_pikv_over_dynamic'))}), KV bytes "
        f"{rec.fig('r3', at(p, r + 'kv_bytes_ratio_pikv_over_dynamic'))}x DynamicCache's",
        "Exact cache vs DynamicCache",
    )


# ------------------------------------------------------------------------------------------ operators per decode step

OPS = f"{BENCH}/ops_per_step_cpu.json"


def ops_per_step(rec: Recorder) -> Body:
    """Operators one eager decode step dispatches, every way against DynamicCache, on the CPU's torch path and on the
    Triton path of a CUDA step (a GPU launches a kernel for each)."""
    p = OPS
    d = rec.load(p)
    paths = d["paths"]
    rows = []
    for way in paths["cpu"]["ways"]:
        row, met = [way], []
        for path in paths:
            k = f"paths.{path}.ways.{way}."
            row += [rec.fig("int", at(p, k + "ops_per_step")), rec.fig("r2", at(p, k + "ratio_to_dynamic"))]
            if path == "cpu":
                row.append(rec.fig("int", at(p, k + "host_reads_per_step")))
            if paths[path]["ways"][way]["goal"] is not None:
                met.append(f"{path.upper()} {verdict(paths[path]['ways'][way]['met'])}")
        goal = paths["cpu"]["ways"][way]["goal"]
        rows.append([*row, "" if goal is None else f"<= {goal}: " + ", ".join(met)])
    m = d["model"]
    return Body(
        measured=(
            f"aten operators of one eager decode step after a {d['context']}-token prefill (batch {d['batch']}, "
            f"{d['warmup_steps']} warm-up steps, sparse reads forced) on a {m['dtype']} model of {m['shape']}'s shape "
            f"({m['layers']} layers, {m['weights']} weights); views and bare allocations are not counted, values "
            "read back to the host are counted apart. Two paths: the CPU's (torch attention backend), and a CUDA "
            "step's (Triton backend selected: every custom operator, counted as one, is one kernel launch there; "
            "its CPU implementation runs under the counter)"
        ),
        commands=["make bench-ops"],
        machine=machine_text(rec, p),
        reads="routed: 64 of 256 key-cluster shards (mass target 0.97); Quest 1/8: 1/8 of the pages per KV head",
        budget="per KV head (the reads above); 4-bit: the prefill's tokens kept in 4-bit pages",
        text=table(["way", "CPU path", "x DynamicCache", "host reads", "CUDA path", "x DynamicCache",
                    "goal (issue 31)"], rows)  # fmt: skip
        + "\n\nThe CPU path's host reads are one per sparse store and layer (a plan as wide as the frame is trimmed "
        "to its longest row before the gather; a count on the CPU, where nothing waits for a device); the CUDA path "
        "makes none. Its counts match the H100's profile: at 7c04f95 this count gave routed 1.29x and Quest 1.37x "
        "DynamicCache's where the H100 launched 1.28x and 1.33x its kernels (8 layers). H2O + "
        "offload + routed (no goal in issue 31) selects in one operator from the hot store's key sums, which count "
        "the offload tier's tokens too (`StoreGroup.key_stats`).",
    )
