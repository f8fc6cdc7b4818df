"""End-to-end decode on the real model (``benchmarks/bench_e2e.py``): every way of keeping the KV against
DynamicCache in one run, the goals of the end-to-end speed issue, where a routed step's time goes, and the
measurements behind the default ``sparse_from`` thresholds (with the README headline rows)."""

from __future__ import annotations

from .framework import BENCH, Body, Recorder, against, at, machine_text, table, verdict

E2E = f"{BENCH}/e2e_cpu.json"
E2E_COMPILED = f"{BENCH}/e2e_compiled_cpu.json"
COMPILED = "_compiled"  # bench_e2e's suffix of a compiled way's row
ALWAYS_SPARSE = f"{BENCH}/e2e_always_sparse_cpu.json"
QUANT_CODES = f"{BENCH}/e2e_quant_codes_cpu.json"  # the 4-bit ways after the CPU read of codes (attention/codes.py)
# every way again, eager and compiled, after the codes read and the trimmed CPU routed plan; batch 4 beside it
LATER = f"{BENCH}/e2e_later_cpu.json"
EAGER_LATEST = f"{BENCH}/e2e_eager_latest_cpu.json"  # eager ways only, after the 4-bit read's scratch
# every way eager and compiled, after the compiled CPU step read packed / Quest-over-a-tier plans through operators
COMPILED_LATEST = f"{BENCH}/e2e_compiled_latest_cpu.json"
COMPILED_LATEST_BATCH4 = f"{BENCH}/e2e_compiled_latest_batch4_cpu.json"  # dynamic and routed, eager and compiled
COMPILED_BATCH4_RUN2 = f"{BENCH}/e2e_compiled_batch4_run2_cpu.json"  # the same point again, a later session
LATER_BATCH4 = f"{BENCH}/e2e_later_batch4_cpu.json"
MODE_TEXT = {
    "dynamic": "DynamicCache (model's SDPA)",
    "exact": "PiKVCache exact",
    "routed": "routed, README setting (cap 1/4)",
    "routed_1_8": "routed, cap 1/8",
    "quest_1_8": "Quest 1/8 (pages of 16)",
    "quant4": "QuantPress 4-bit",
    "quest_quant4": "Quest 1/8 + 4-bit",
    "h2o_offload_routed": "H2O 0.5 + offload + routed",
    "routed_p4": "routed, pages of 4 (cap 1/4)",
    "routed_p4_316": "routed, pages of 4 (cap 3/16)",
}
# (model, batch, context, mode, field, bound): the goals of the end-to-end issue, ratios to DynamicCache, 1 thread
GOALS = [
    ("smollm2", 1, 2048, "exact", "ms_ratio", 1.05),
    ("smollm2", 1, 2048, "routed", "ms_ratio", 1.05),
    ("smollm2", 1, 2048, "quant4", "ms_ratio", 1.10),
    ("smollm2", 1, 8192, "routed", "ms_ratio", 0.80),
    ("smollm2", 1, 8192, "quest_1_8", "ms_ratio", 0.75),
    ("smollm2", 1, 8192, "quant4", "ms_ratio", 1.00),
    ("smollm2", 1, 8192, "quest_quant4", "ms_ratio", 0.70),
    ("smollm2", 4, 8192, "routed", "ms_ratio", 0.50),
]
PREFILL_BOUND = 1.10


def point_index(rec: Recorder, path: str, model: str, threads: int, batch: int, context: int) -> int | None:
    """Index of the point in ``path``'s ``points`` list, None when it was not measured."""
    for i, p in enumerate(rec.load(path)["points"]):
        if (p["model"], p["threads"], p["batch"], p["context"]) == (model, threads, batch, context):
            return i
    return None


def series(rec: Recorder, path: str) -> list[tuple[str, int, int]]:
    """(model, threads, batch) of the points in ``path``, sorted."""
    return sorted({(p["model"], p["threads"], p["batch"]) for p in rec.load(path)["points"]})


def series_table(rec: Recorder, path: str, model: str, threads: int, batch: int) -> str:
    """Rows: ways; columns: ms/token (ratio to DynamicCache) per context, then prefill ratio, KV and read at the
    longest context."""
    points = [(i, p) for i, p in enumerate(rec.load(path)["points"]) if (p["model"], p["threads"], p["batch"]) ==
              (model, threads, batch)]  # fmt: skip
    points.sort(key=lambda ip: ip[1]["context"])
    last_i, last = points[-1]
    modes = [m for m in MODE_TEXT if m in last["results"]]
    header = ["way", *(f"{p['context']}: ms/token (x Dynamic)" for _, p in points)]
    header += [f"{last['context']}: prefill x Dynamic", "KV MiB", "read", "sparse layer-steps"]
    rows = []
    for mode in modes:
        cells = [MODE_TEXT[mode]]
        for i, _ in points:
            r = f"points.{i}.results.{mode}."
            cells.append(f"{rec.fig('ms', at(path, r + 'ms_per_token'))} ({rec.fig('r2', at(path, r + 'ms_ratio'))})")
        r = f"points.{last_i}.results.{mode}."
        offloaded = last["results"][mode]["offloaded_bytes"]
        kv = rec.fig("mib", at(path, r + "kv_bytes"))
        if offloaded:
            kv += f" (+{rec.fig('mib', at(path, r + 'offloaded_bytes'))} offloaded)"
        res = last["results"][mode]
        new = "layer_steps" in res  # results measured before the layer-step names called them decode / sparse steps
        steps = res["layer_steps" if new else "decode_steps"]
        sparse_key = "sparse_layer_steps" if new else "sparse_steps"
        sparse = f"{rec.fig('int', at(path, r + sparse_key))} / {steps}" if steps else "-"
        read = rec.fig("r3", at(path, r + "read_fraction"))
        cells += [rec.fig("r2", at(path, r + "prefill_ratio")), kv, read, sparse]
        rows.append(cells)
    commits = ", ".join(sorted({p.get("git", "?") for _, p in points}))
    return f"{model}, {threads} thread(s), batch {batch} (git {commits}):\n\n{table(header, rows)}"


def timed_steps(rec: Recorder, *paths: str) -> str:
    """How many steps each way timed, counted from the points' rows (``ms_all``): a file's ``config`` is its last
    command's, and points appended by earlier commands (other ``--steps`` / ``--rounds``) kept theirs."""
    groups: dict[str, list[str]] = {}
    for path in paths:
        for pt in rec.load(path)["points"]:
            counts = sorted({len(r["ms_all"]) for r in pt["results"].values() if "ms_all" in r})
            groups.setdefault("/".join(map(str, counts)), []).append(f"{pt['context']} x {pt['batch']}")
    if len(groups) == 1:
        return f"{next(iter(groups))} timed steps per way"
    return "timed steps per way: " + "; ".join(f"{n} at {', '.join(points)}" for n, points in groups.items())


def goal_rows(rec: Recorder, path: str, compiled: bool = False) -> list[list[str]]:
    """The issue's goals with the measured ratio and a verdict (points not measured are listed as such);
    ``compiled``: judged on each way's compiled step (its ms/token over DynamicCache eager's), prefill apart."""
    rows = []
    for model, batch, context, mode, field, bound in GOALS:
        step = ", compiled step" if compiled else ""
        name = f"{MODE_TEXT[mode]}{step}, {context} tokens, batch {batch}: ms/token <= {bound:.2f}x Dynamic"
        i = point_index(rec, path, model, 1, batch, context)
        if i is None:
            rows.append([name, "not measured", "-"])
            continue
        key = mode + COMPILED if compiled else mode
        if key not in rec.load(path)["points"][i]["results"]:  # a run of some ways only
            continue
        src = at(path, f"points.{i}.results.{key}.{field}")
        rows.append([name, rec.fig(against(rec.value(src), bound), src), verdict(rec.value(src) <= bound)])
    i = point_index(rec, path, "smollm2", 1, 1, 8192)
    if i is not None and not compiled:
        modes = [m for m in rec.load(path)["points"][i]["results"] if m in MODE_TEXT]  # eager rows
        worst = max(modes, key=lambda m: rec.load(path)["points"][i]["results"][m]["prefill_ratio"])
        src = at(path, f"points.{i}.results.{worst}.prefill_ratio")
        rows.append(
            [
                f"prefill of every way, 8192 tokens, batch 1: <= {PREFILL_BOUND:.2f}x Dynamic "
                f"(worst: {MODE_TEXT[worst]})",
                rec.fig(against(rec.value(src), PREFILL_BOUND), src),
                verdict(rec.value(src) <= PREFILL_BOUND),
            ]
        )
    return rows


def equal_read_rows(rec: Recorder, path: str) -> list[list[str]]:
    """Routed cap 1/8 against Quest 1/8 at 8192 tokens: fraction read and ms/token, batch 1 and 4."""
    rows = []
    for batch in (1, 4):
        i = point_index(rec, path, "smollm2", 1, batch, 8192)
        if i is None:
            continue
        cells = [f"8192 tokens, batch {batch}"]
        for mode in ("routed_1_8", "quest_1_8"):
            r = f"points.{i}.results.{mode}."
            read, ms = rec.fig("r3", at(path, r + "read_fraction")), rec.fig("ms", at(path, r + "ms_per_token"))
            cells.append(f"{read} / {ms}")
        routed = rec.value(at(path, f"points.{i}.results.routed_1_8.ms_per_token"))
        quest = rec.value(at(path, f"points.{i}.results.quest_1_8.ms_per_token"))
        cells.append(verdict(routed <= quest))
        rows.append(cells)
    return rows


def profile_text(rec: Recorder, path: str) -> str:
    """Shares of a routed decode step (timers around the named methods), per model profiled."""
    parts = []
    for model, prof in rec.load(path).get("profile", {}).items():
        base = f"profile.{model}."
        rows = [
            [prof["buckets"][bucket], rec.fig("pct_frac", at(path, f"{base}share_of_step.{bucket}"))]
            for bucket in prof["share_of_step"]
        ]
        book = at(path, base + "bookkeeping_share")
        parts.append(
            f"Where a routed step's time goes ({model}, {prof['context']} tokens, batch {prof['batch']}, git "
            f"{prof.get('git', '?')}, "
            f"{prof['steps']} steps; routed {rec.fig('ms', at(path, base + 'routed_ms_per_token'))} ms/token with the "
            f"timers, exact {rec.fig('ms', at(path, base + 'exact_ms_per_token'))}; the rest of the step is the model "
            "and the cache's append):\n\n"
            + table(["part of the step", "% of the step"], rows)
            + f"\n\nBookkeeping (selection, planning, statistics, placement) {rec.fig('pct_frac', book)}% of the step: "
            f"goal <= 10%: {verdict(rec.value(book) <= 0.10)}."
        )
    return "\n\n".join(parts)


def threshold_text(rec: Recorder) -> str:
    """The always-sparse points behind ``config.SPARSE_FROM``: ms/token ratio of each way per point."""
    p = ALWAYS_SPARSE
    if not rec.exists(p):
        return ""
    rows = []
    for i, pt in enumerate(rec.load(p)["points"]):
        cells = [f"{pt['context']} x batch {pt['batch']}"]
        for mode in ("exact", "routed", "quest_1_8", "quant4", "quest_quant4"):
            src = at(p, f"points.{i}.results.{mode}.ms_ratio")
            cells.append(rec.fig("r2", src) if mode in pt["results"] else "-")
        rows.append(cells)
    header = ["context x batch", "exact", "routed", "Quest 1/8", "4-bit", "Quest 1/8 + 4-bit"]
    return (
        f"Sparse reads at every length (`{p}`: `sparse_from=0`, ms/token over DynamicCache's, 1 thread, SmolLM2). "
        "A routed read costs more than the exact one below about 8192 tokens per row, a Quest read below about 4096: "
        "these are the defaults of `sparse_from` (`pikv_hf.config.SPARSE_FROM`); below them a cache reads densely "
        "and `routing_stats()` counts no sparse step.\n\n" + table(header, rows) + f"\n\n{rec.load(p)['note']}"
    )


def quant_codes_text(rec: Recorder) -> str:
    """The 4-bit ways measured again after their CPU read went to codes (``e2e_quant_codes_cpu.json``)."""
    p = QUANT_CODES
    if not rec.exists(p):
        return ""
    d = rec.load(p)
    tables = "\n\n".join(series_table(rec, p, *key) for key in series(rec, p))
    return (
        "**4-bit pages read as codes on the CPU** (`attention/codes.py`: the scales folded into the query and the "
        "probabilities, no dequantised K/V; before it, the 4-bit tier was decoded on every read). A later run of "
        f"the 4-bit ways beside DynamicCache and the exact cache, commit {d['git']} (`{d['commands'][-1]}`; "
        f"{d.get('note', '')}):\n\n{tables}\n\n"
        + table(["goal", "measured", "verdict"], [r for r in goal_rows(rec, p) if r[1] != "not measured"])
    )


def e2e(rec: Recorder) -> Body:
    """End-to-end greedy decode on SmolLM2 (and its MoE upcycle) for every way, side by side."""
    p = E2E
    d = rec.load(p)
    tables = [series_table(rec, p, *key) for key in series(rec, p)]
    plot = p.replace(".json", ".png")
    parts = [rec.image(plot, "ms per token over DynamicCache's against context")] if rec.exists(plot) else []
    parts += tables
    parts.append(
        "Goals (1 thread, fp32, ratios to DynamicCache in the same run):\n\n"
        + table(["goal", "measured", "verdict"], goal_rows(rec, p))
    )
    equal = equal_read_rows(rec, p)
    if equal:
        parts.append(
            "At a similar fraction of the KV read, routed (cap 1/8) against Quest 1/8, read / ms per token:\n\n"
            + table(["point", "routed cap 1/8", "Quest 1/8", "routed no slower"], equal)
        )
    parts += [profile_text(rec, p), threshold_text(rec), quant_codes_text(rec)]
    return Body(
        measured=(
            "prefill of the context, then greedy decode one token per forward (the loop of `generate`), every way "
            f"taking turns in rounds, {timed_steps(rec, p)} (median "
            "ms/token); prefill seconds; KV bytes allocated at the end (offloaded bytes apart); fraction of the stored "
            "tokens a decode step attends to; a different essay passage per batch row; the commit of each table's "
            "points in its heading"
        ),
        commands=["make bench-e2e  # these runs, into one JSON:", *d["commands"]],
        machine=machine_text(rec, p),
        reads="routed and Quest reads are query-aware (each step selects with its own query); H2O's eviction is "
        "query-agnostic (prefill statistics), its offloaded half read back by routed selection",
        budget="per KV head: routed top shards up to 97% estimated mass, at most 64 (1/4) or 32 (1/8) of 256, plus 4 "
        "sinks and 64 recent tokens; Quest 1/8 of pages of 16; 4-bit: every token older than 128 positions; H2O keeps "
        "half of each (row, KV head)'s tokens resident",
        text="\n\n".join(part for part in parts if part),
    )


def compiled_rows(rec: Recorder, path: str, i: int) -> list[list[str]]:
    """Per way of point ``i``: eager and compiled ms/token with their ratios and KV bytes held (a compiled cache
    reserves ``max_cache_len``), the first (compiling) step's seconds;
    DynamicCache's row holds StaticCache compiled beside it."""
    results = rec.load(path)["points"][i]["results"]
    rows = []
    for mode in MODE_TEXT:
        compiled = "static" + COMPILED if mode == "dynamic" else mode + COMPILED
        if mode not in results and compiled not in results:
            continue
        cells = [MODE_TEXT[mode] + (" / StaticCache compiled" if mode == "dynamic" else "")]
        r = f"points.{i}.results."
        if mode in results:
            cells.append(f"{rec.fig('ms', at(path, r + mode + '.ms_per_token'))} "
                         f"({rec.fig('r2', at(path, r + mode + '.ms_ratio'))})")  # fmt: skip
            cells.append(rec.fig("mib", at(path, r + mode + ".kv_bytes")))
        else:
            cells += ["-", "-"]
        if compiled not in results:
            cells += ["not run", "-", "-", "-"]
        elif "error" in results[compiled]:
            cells += [f"does not compile: {results[compiled]['error'].splitlines()[0][:120]}", "-", "-", "-"]
        else:
            c = r + compiled + "."
            cells += [
                f"{rec.fig('ms', at(path, c + 'ms_per_token'))} ({rec.fig('r2', at(path, c + 'ms_ratio'))})",
                rec.fig("r2", at(path, c + "static_ratio")),
                rec.fig("mib", at(path, c + "kv_bytes")),
                rec.fig("s", at(path, c + "warmup_s.0")),
            ]
        rows.append(cells)
    return rows


def fastest(rec: Recorder, path: str, i: int) -> str:
    """The fastest row of point ``i``: its way, eager or compiled."""
    results = rec.load(path)["points"][i]["results"]
    timed = {name: r["ms_per_token"] for name, r in results.items() if "ms_per_token" in r}
    name = min(timed, key=timed.get)
    way = "static" if name == "static" + COMPILED else name.removesuffix(COMPILED)
    text = "StaticCache" if way == "static" else MODE_TEXT[way]
    return f"{text}, {'compiled' if name.endswith(COMPILED) else 'eager'}"


def e2e_compiled(rec: Recorder) -> Body:
    """Every way eager and with its decode step compiled (inductor on the CPU), in one run per point."""
    p = E2E_COMPILED
    d = rec.load(p)
    header = ["way", "eager ms/token (x Dynamic)", "eager KV MiB", "compiled ms/token (x Dynamic)",
              "x StaticCache compiled", "compiled KV MiB", "first step (compiles), s"]  # fmt: skip
    parts = []
    for i, pt in enumerate(d["points"]):
        parts.append(
            f"{pt['model']}, {pt['threads']} thread(s), batch {pt['batch']}, {pt['context']} tokens (git {pt['git']}); "
            f"fastest: {fastest(rec, p, i)}:\n\n" + table(header, compiled_rows(rec, p, i))
        )
    if d.get("note"):
        parts.append(d["note"])
    compile_cfg = d["config"]["compile"]
    return Body(
        measured=(
            "as the eager section above, plus each way's decode step compiled once: the model's one-token forward "
            "under "
            f"`torch.compile(backend={compile_cfg['backend']!r}, fullgraph=True, dynamic=False)` over "
            "`PiKVCache(model, max_cache_len=N)` (StaticCache for the compiled baseline); the first calls (warm-up, "
            f"{d['config']['warmup']} steps, the first compiles) are not timed; every way eager and compiled takes "
            f"turns in rounds, {timed_steps(rec, p)} (median ms/token)"
        ),
        commands=d["commands"],
        machine=machine_text(rec, p),
        reads="as the eager section above (compiled ways read the same)",
        budget="as the eager section above",
        text="\n\n".join(parts),
    )


def e2e_later(rec: Recorder) -> Body:
    """Every way again on one machine in one run per point, eager and compiled side by side, with batch 4 beside
    it; the issue's goals judged on these runs."""
    return _eager_and_compiled(rec, (LATER,), LATER_BATCH4)


def e2e_compiled_latest(rec: Recorder) -> Body:
    """Every way eager and compiled again after a change to the compiled CPU step; the issue's goals judged on this
    run, on the eager steps and on the compiled ones."""
    return _eager_and_compiled(rec, (COMPILED_LATEST, COMPILED_LATEST_BATCH4, COMPILED_BATCH4_RUN2), None)


def _eager_and_compiled(rec: Recorder, runs: tuple[str, ...], batch4: str | None) -> Body:
    """The section of runs of every way eager and compiled (``runs``, those that exist; the first gives the
    settings), with an eager batch-4 run (``batch4``) beside them."""
    d = rec.load(runs[0])
    header = ["way", "eager ms/token (x Dynamic)", "eager KV MiB", "compiled ms/token (x Dynamic)",
              "x StaticCache compiled", "compiled KV MiB", "first step (compiles), s"]  # fmt: skip
    parts, goals, commands = [], [], []
    present = [path for path in runs if rec.exists(path)]
    for p in present:
        run = rec.load(p)
        parts += [run["note"]] if run.get("note") else []
        for i, pt in enumerate(run["points"]):
            parts.append(
                f"{pt['model']}, {pt['threads']} thread(s), batch {pt['batch']}, {pt['context']} tokens (git "
                f"{pt['git']}); fastest: {fastest(rec, p, i)}:\n\n" + table(header, compiled_rows(rec, p, i))
            )
        rows = [r for compiled in (False, True) for r in goal_rows(rec, p, compiled) if r[1] != "not measured"]
        if len(present) > 1:  # the run each measurement comes from
            rows = [[goal, f"{measured} ({p.rsplit('/', 1)[-1]})", verdict] for goal, measured, verdict in rows]
        goals += rows
        commands += run["commands"]
    if batch4 is not None and rec.exists(batch4):
        b4 = rec.load(batch4)
        parts += [series_table(rec, batch4, *key) for key in series(rec, batch4)]
        parts += [b4["note"]] if b4.get("note") else []
        goals += [r for r in goal_rows(rec, batch4) if r[1] != "not measured" and "prefill" not in r[0]]
        commands += b4["commands"]
    header = ["goal", "measured", "verdict"]
    parts.append("Goals (ratios to DynamicCache eager in the same run):\n\n" + table(header, goals))
    compile_cfg = d["config"]["compile"]
    return Body(
        measured=(
            "as 'End-to-end decode on the real model' (eager) and 'compiled step' (the one-token forward under "
            f"`torch.compile(backend={compile_cfg['backend']!r}, fullgraph=True, dynamic=False)` over "
            "`PiKVCache(model, max_cache_len=N)`, StaticCache compiled as the compiled baseline), every way eager and "
            f"compiled taking turns in rounds, {timed_steps(rec, *present)} "
            "(median ms/token), nothing else running on the machine"
        ),
        commands=commands,
        machine=machine_text(rec, runs[0]),
        reads="as the eager section above",
        budget="as the eager section above",
        text="\n\n".join(parts),
    )


def e2e_eager_latest(rec: Recorder) -> Body:
    """The eager ways at batch 1 measured again after a change to the eager CPU path, judged on this run alone."""
    p = EAGER_LATEST
    d = rec.load(p)
    parts = [series_table(rec, p, *key) for key in series(rec, p)]
    parts += [d["note"]] if d.get("note") else []
    goals = [r for r in goal_rows(rec, p) if r[1] != "not measured"]
    header = ["goal", "measured", "verdict"]
    parts.append("Goals (ratios to DynamicCache eager in this run):\n\n" + table(header, goals))
    return Body(
        measured=(
            "as 'End-to-end decode on the real model': prefill, then greedy decode one token per forward, every way "
            f"taking turns in rounds, {timed_steps(rec, p)} (median "
            "ms/token), eager steps only, nothing else running on the machine"
        ),
        commands=d["commands"],
        machine=machine_text(rec, p),
        reads="as the eager section above",
        budget="as the eager section above",
        text="\n\n".join(parts),
    )


def _results_key(rec: Recorder, batch: int) -> str | None:
    """Key prefix of the SmolLM2 results at 8192 tokens, 1 thread, ``batch`` rows (None when not measured)."""
    if not rec.exists(E2E):
        return None
    i = point_index(rec, E2E, "smollm2", 1, batch, 8192)
    return None if i is None else f"points.{i}.results."


def _latest(rec: Recorder, batch: int) -> tuple[str, str, str] | None:
    """Path, key prefix and section of the SmolLM2 results at 8192 tokens, 1 thread, ``batch`` rows: the latest run of
    every way eager and compiled, else the latest eager run, where they have them, else the later run of every way,
    else the first run (None when none does)."""
    runs = [(COMPILED_LATEST, "End-to-end decode, compiled step, the latest run")] if batch == 1 else []
    runs.append((EAGER_LATEST, "End-to-end decode, eager, the latest run"))
    runs.append((LATER if batch == 1 else LATER_BATCH4, "End-to-end decode, a later run of every way"))
    for later, section in runs:
        i = point_index(rec, later, "smollm2", 1, batch, 8192) if rec.exists(later) else None
        if i is not None:
            return later, f"points.{i}.results.", section
    r = _results_key(rec, batch)
    return None if r is None else (E2E, r, "End-to-end decode on the real model")


def headline_e2e(rec: Recorder) -> tuple[str, str, str] | None:
    """End-to-end decode against DynamicCache at the longest context, batch 1 (the later run of every way when there
    is one)."""
    found = _latest(rec, 1)
    if found is None:
        return None
    p, r, section = found
    ratio = {m: rec.fig("r2", at(p, r + f"{m}.ms_ratio")) for m in ("exact", "quest_1_8", "routed", "quant4")}
    run = ""
    if p == E2E and rec.exists(QUANT_CODES):  # the 4-bit ways were measured again once their read went to codes
        i = point_index(rec, QUANT_CODES, "smollm2", 1, 1, 8192)
        if i is not None:
            ratio["quant4"] = rec.fig("r2", at(QUANT_CODES, f"points.{i}.results.quant4.ms_ratio"))
            run = " (4-bit: read as codes, a later run)"
    results = rec.load(p)["points"][point_index(rec, p, "smollm2", 1, 1, 8192)]["results"]
    ways = ("exact", "quest_1_8", "routed", "quant4")
    if all(m + COMPILED in results for m in ways):  # the same ways' compiled steps, in the same run
        compiled = {m: rec.fig("r2", at(p, r + f"{m}{COMPILED}.ms_ratio")) for m in ways}
        run += (
            f"; compiled steps: exact {compiled['exact']}x, Quest 1/8 {compiled['quest_1_8']}x, routed "
            f"{compiled['routed']}x, 4-bit {compiled['quant4']}x"
        )
    return (
        "Decode vs DynamicCache end to end, SmolLM2, 8192 tokens",
        f"ms/token: exact {ratio['exact']}x, Quest 1/8 {ratio['quest_1_8']}x, routed {ratio['routed']}x, 4-bit "
        f"{ratio['quant4']}x DynamicCache's eager{run} (1 thread, batch 1)",
        section,
    )


def headline_routing_gain(rec: Recorder) -> tuple[str, str, str] | None:
    """Routing's own gain: routed against PiKV's exact mode, batch 4 at the longest context (the later run when there
    is one)."""
    found = _latest(rec, 4)
    if found is None:
        return None
    p, r, section = found
    return (
        "Routed vs PiKV exact, SmolLM2, 8192 tokens, batch 4",
        f"{rec.fig('ms', at(p, r + 'routed.ms_per_token'))} vs {rec.fig('ms', at(p, r + 'exact.ms_per_token'))} "
        f"ms/token, reading {rec.fig('r3', at(p, r + 'routed.read_fraction'))} of the KV",
        section,
    )
