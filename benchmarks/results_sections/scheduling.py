"""Scheduling presses: kvpress and pikv_hf presses on needles, the KV bytes they leave, and a decode-time budget
(with the README headline rows)."""

from __future__ import annotations

import re
from pathlib import Path

from .framework import (
    BENCH,
    EVAL,
    NA_READS,
    Body,
    Recorder,
    agg,
    at,
    machine_text,
    makefile_command,
    out_dir,
    row,
    table,
    verdict,
    versions_text,
)

# ------------------------------------------------------------------------------------------------ kvpress baseline

RULER_TABLE = f"{EVAL}/ruler2k_table.json"


def ruler_baseline(rec: Recorder) -> Body:
    """kvpress presses on the RULER needles, dense and upcycled MoE SmolLM2."""
    p = RULER_TABLE
    d = rec.load(p)
    ratios = sorted({r["ratio"] for r in d["rows"] if r["press"] != "none"})
    rows = []
    for model in d["runs"]:
        for press in sorted({r["press"] for r in d["rows"] if r["model"] == model}, key=lambda x: (x != "none", x)):
            cells = [
                rec.fig("pct", row(p, "rows", "score", model=model, press=press, ratio=ratio))
                if any(r["model"] == model and r["press"] == press and r["ratio"] == ratio for r in d["rows"])
                else ""
                for ratio in [0.0, *ratios]
            ]
            rows.append([model, press, *cells])
    header = ["model", "press", "no compression", *(f"ratio {r}" for r in ratios)]
    dirs = [out_dir(run["command"]) for run in d["runs"].values()]
    parts = [table(header, rows)]
    if len(dirs) == 2:
        a, b = (f"{x}/predictions.jsonl" for x in dirs)
        parts.append(
            f"`{dirs[1]}` gives the same prediction as `{dirs[0]}` on "
            f"{rec.fig('int', agg('rows', b), agg('rows', a), combine='same')} of "
            f"{rec.fig('int', agg('count', b))} samples."
        )
    none_tasks = " / ".join(
        f"{t.removeprefix('niah_single_')} {rec.fig('pct', at(p, f'rows.{i}.per_task.{t}.score'))}"
        for i, r in enumerate(d["rows"])
        if r["press"] == "none" and r["model"] == next(iter(d["runs"]))
        for t in r["per_task"]
    )
    parts.append(f"No compression per task ({next(iter(d['runs']))}): {none_tasks}.")
    run0 = rec.load(f"{dirs[0]}/metrics.json")
    return Body(
        measured=(
            f"{d['description']}; tasks {', '.join(d['tasks'])} at {', '.join(map(str, d['lengths']))} tokens, "
            f"{d['samples_per_task']} samples per task; models: "
            + "; ".join(f"{k}: {run['model_info']['name']}" for k, run in d["runs"].items())
        ),
        commands=[run["command"] for run in d["runs"].values()] + ["python eval/make_table.py " + " ".join(dirs)],
        machine="; ".join(sorted({versions_text(run["versions"]) for run in d["runs"].values()})),
        reads="query-aware" if d["query_aware"] else "query-agnostic (the context is compressed before the question)",
        budget=run0["budget_note"],
        text="\n\n".join(parts),
    )


# ------------------------------------------------------------------------------------------ scheduling quality

SCHEDULING_QUALITY_GLOB = f"{EVAL}/scheduling_*/metrics.json"


def press_quality_table(rec: Recorder, metrics: str, length: int) -> str:
    """Score per press (rows) and ratio (columns) of one eval run at one length."""
    preds = str(Path(metrics).parent / "predictions.jsonl")
    rows_all = [r for r in rec.load(metrics)["per_task"] if r["length"] == length]
    ratios = sorted({r["ratio"] for r in rows_all if r["press"] != "none"})
    rows = []
    for press in dict.fromkeys(r["press"] for r in rows_all):
        cells = [
            rec.fig("pct_frac", agg("mean", preds, "", "score", press=press, ratio=ratio, length=length))
            if any(r["press"] == press and r["ratio"] == ratio for r in rows_all)
            else ""
            for ratio in [0.0, *ratios]
        ]
        rows.append([press, *cells])
    return table(["press", "no compression", *(f"ratio {r}" for r in ratios)], rows)


def scheduling_quality(rec: Recorder) -> Body:
    """Needle scores of the scheduling presses, one table per run and length."""
    files = rec.glob(SCHEDULING_QUALITY_GLOB)
    parts = []
    for metrics in files:
        m = rec.load(metrics)
        for length in m["arguments"]["lengths"]:
            scores = press_quality_table(rec, metrics, length)
            parts.append(f"`{Path(metrics).parent.name}`, {length} tokens, score %:\n\n{scores}")
    ms = [rec.load(f) for f in files]
    aware = {m["query_aware"] for m in ms}
    caches = sorted({m["arguments"]["cache"] for m in ms})
    return Body(
        measured=f"needle score of each press and ratio ({', '.join(caches)} cache); protocol: {ms[0]['protocol']}",
        commands=[m["command"] for m in ms],
        machine="; ".join(sorted({versions_text(m["versions"]) for m in ms})),
        reads="query-aware" if aware == {True} else ("query-agnostic" if aware == {False} else "mixed"),
        budget=ms[0]["budget_note"],
        text="\n\n".join(parts),
    )


# ---------------------------------------------------------------------------------------------- kvpress KV bytes

KVPRESS_BYTES = f"{BENCH}/kvpress_bytes_cpu.json"


def kvpress_bytes(rec: Recorder) -> Body:
    """KV bytes held after kvpress presses: DynamicCache against PiKVCache."""
    p = KVPRESS_BYTES
    d = rec.load(p)
    rows = []
    for i, r in enumerate(d["results"]):
        k = f"results.{i}."
        rows.append(
            [
                r["press"],
                rec.fig("mib", at(p, k + "dynamic.kv_bytes")),
                rec.fig("r3", at(p, k + "dynamic.over_no_press")),
                rec.fig("mib", at(p, k + "pikv.kv_bytes")),
                rec.fig("mib", at(p, k + "pikv.meta_bytes")),
                rec.fig("r3", at(p, k + "pikv.over_no_press")),
                f"{rec.fig('int', at(p, k + 'pikv.tokens_per_kv_head_min_max.0'))} - "
                f"{rec.fig('int', at(p, k + 'pikv.tokens_per_kv_head_min_max.1'))}",
            ]
        )
    header = ["press", "DynamicCache KV MiB", "over no press", "PiKVCache KV MiB", "metadata MiB", "over no press"]
    header += ["PiKV tokens per KV head min - max"]
    c = d["config"]
    note = (
        "A head-wise press (AdaKV) only masks keys on a DynamicCache, so nothing is freed there; a PiKVCache evicts "
        "them per (row, KV head) (`benchmarks/kvpress_bytes.py`)."
    )
    return Body(
        measured=(
            f"K/V bytes each cache holds after a kvpress press compressed a {c['context_tokens']}-token prefill of "
            f"{c['model']} at ratio {c['ratio']}: DynamicCache against {c['pikv']} (bytes measured on the tensors)"
        ),
        commands=[d["command"]],
        machine=machine_text(rec, p),
        reads=NA_READS,
        budget=c["budget_note"],
        text=table(header, rows) + "\n\n" + note,
    )


# ----------------------------------------------------------------------------------------- kvpress's own tests

KVPRESS_SUITE = f"{BENCH}/kvpress_suite_cpu.json"
SUITE_CAUSES = {
    "answer_trimmed_by_position": "the pipeline's trim crops positions on a PiKVCache: after a decode-time press no "
    "answer token is left where a DynamicCache slice keeps some (intended)",
    "seq_length_counts_positions": "`get_seq_length` counts positions seen, not tokens held, so asserted compressed "
    "lengths differ (intended)",
    "headwise_mask_coordinates:DMSPress": "DMS-masked tokens are evicted, so the ratio the test measures over the "
    "layer's keys is taken on a view already shorter (intended)",
    "batch_changed:KVComposePress": "structured KVCompose writes one row back for a batch of two: a PiKVCache raises "
    "a ValueError (a DynamicCache loses row 1 silently)",
}


def kvpress_suite(rec: Recorder) -> Body:
    """kvpress's own test suite on DynamicCache and with a PiKVCache substituted: counts and differences by cause."""
    p = KVPRESS_SUITE
    d = rec.load(p)
    outcomes = ("passed", "failed", "error", "skipped")
    rows = [[cache, *(rec.fig("int", at(p, f"counts.{cache}.{o}")) for o in outcomes)] for cache in ("dynamic", "pikv")]
    causes = [
        [cause, rec.fig("int", at(p, f"regressions_by_cause.{cause}")), SUITE_CAUSES.get(cause, "**unexplained**")]
        for cause in d["regressions_by_cause"]
    ]
    total = rec.fig("int", at(p, "pass_on_dynamic_not_on_pikv"))
    return Body(
        measured=(
            f"{d['what']}: kvpress {d['kvpress']}, pikv_hf at `{d['pikv_hf']['commit'][:7]}`; tests that pass "
            "on DynamicCache and not on PiKVCache, by cause (`benchmarks/kvpress_suite.py` `CAUSES`)"
        ),
        commands=[makefile_command(rec, p)],
        machine=d["machine"],
        reads=NA_READS,
        budget="each test's own",
        text=table(["cache", *outcomes], rows)
        + f"\n\n{total} tests pass on DynamicCache and not on PiKVCache:\n\n"
        + table(["cause", "tests", "why"], causes),
    )


# ------------------------------------------------------------------------------------------ scheduling press bytes

SCHEDULING_BYTES = f"{BENCH}/scheduling_bytes_cpu.json"


def scheduling_bytes(rec: Recorder) -> Body:
    """KV bytes after every scheduling press and ratio against (1 - r) x DynamicCache."""
    p = SCHEDULING_BYTES
    d = rec.load(p)
    ratios = sorted({r["ratio"] for r in d["results"]})
    rows = []
    for press in dict.fromkeys(r["press"] for r in d["results"]):
        over = [rec.fig("r3", row(p, "results", "over_target", press=press, ratio=r)) for r in ratios]
        kv = [rec.fig("mib", row(p, "results", "pikv_kv_bytes", press=press, ratio=r)) for r in ratios]
        off = [rec.fig("mib", row(p, "results", "pikv_offloaded_bytes", press=press, ratio=r)) for r in ratios]
        rows.append([press, " / ".join(kv), " / ".join(over), " / ".join(off)])
    shares = " / ".join(str(r) for r in ratios)
    header = [
        "press",
        f"PiKV KV MiB at r = {shares}",
        "over (1 - r) x DynamicCache",
        "offloaded MiB (not resident)",
    ]
    within = rec.fig("int", agg("count", p, "results", within_3_percent=True))
    total = rec.fig("int", agg("count", p, "results"))
    c = d["config"]
    check = (
        f"Target recorded in the JSON: {d['target']}: {within} of {total} points, "
        f"{verdict(within == total)}; DynamicCache holding the whole context: "
        f"{rec.fig('mib', at(p, 'config.dynamic_cache_bytes'))} MiB."
    )
    return Body(
        measured=(
            f"KV bytes a PiKVCache allocates for its resident tokens after each scheduling press (one "
            f"{c['context_tokens']}-token prefill of {c['model']} replayed on forks), against (1 - r) x a DynamicCache "
            f"holding the uncompressed context; {c['pikv']}"
        ),
        commands=[d["command"]],
        machine=machine_text(rec, p),
        reads=NA_READS,
        budget=c["budget_note"],
        text=table(header, rows) + "\n\n" + check,
    )


# ---------------------------------------------------------------------------------------------------- decode budget

DECODE_BUDGET = f"{BENCH}/decode_budget_cpu.json"


def budget_of(command: str) -> int:
    """The ``--budget`` of a recorded ``decode_budget.py`` command."""
    return int(re.search(r"--budget (\d+)", command).group(1))


def decode_budget(rec: Recorder) -> Body:
    """Resident KV bytes and step time under a decode-time token budget."""
    p = DECODE_BUDGET
    d = rec.load(p)
    rows = [
        [
            str(r["step"]),
            rec.fig("mib", at(p, f"log.{i}.kv_bytes")),
            rec.fig("mib", at(p, f"log.{i}.bound_bytes")),
            rec.fig("int", at(p, f"log.{i}.max_tokens_per_head")),
            rec.fig("ms", at(p, f"log.{i}.median_step_ms_last")),
        ]
        for i, r in enumerate(d["log"])
    ]
    header = ["decode step", "KV MiB", "bound MiB", "max tokens per KV head", "median step ms (last interval)"]
    log, budget = d["log"], budget_of(d["command"])
    held = next(i for i in range(1, len(log)) if log[i - 1]["max_tokens_per_head"] >= budget)
    step = f"log.{len(log) - 1}.median_step_ms_last"
    check = (
        f"KV bytes within the bound at every logged step: {verdict(d['all_within_bound'])}; step time of the last "
        f"interval over the first interval held at the budget (steps {log[held - 1]['step'] + 1}-{log[held]['step']}): "
        f"{rec.fig('r2', at(p, step), at(p, f'log.{held}.median_step_ms_last'), combine='ratio')}; over the first "
        f"interval, before the cache reached the budget (no eviction yet): "
        f"{rec.fig('r2', at(p, 'step_ms_last_over_first'))}."
    )
    c = d["config"]
    return Body(
        measured=(
            f"`model.generate` on {c['model']} after a {c['prompt_tokens']}-token prompt into {c['cache']} held to a "
            f"token budget by {c['press']}: allocated KV bytes against the bound (budget + one page per row, KV "
            "head and shard) and the median decode step time"
        ),
        commands=[d["command"]],
        machine=machine_text(rec, p),
        reads=NA_READS,
        budget=f"per (row, KV head): {c['press']}",
        text=table(header, rows) + "\n\n" + check,
    )


# ---------------------------------------------------------------------------------------------------- headline


def headline_scheduling(rec: Recorder) -> tuple[str, str, str] | None:
    """Scheduling presses at ratio 0.5 on 2048-token needles: the uncompressed score, the best query-agnostic
    eviction press of each library, and Quest's query-aware page reads."""
    p = f"{EVAL}/scheduling_smollm2/metrics.json"
    if not rec.exists(p):
        return None
    points = rec.load(p)["per_point"]
    evicting = [q for q in points if q["ratio"] == 0.5 and q["press"] not in ("pikv_quest", "pikv_flexgen")]
    ours = max((q for q in evicting if q["press"].startswith("pikv_")), key=lambda q: q["score"])["press"]
    theirs = max((q for q in evicting if not q["press"].startswith("pikv_")), key=lambda q: q["score"])["press"]

    def score(press: str, ratio: float) -> str:
        return rec.fig("pct", row(p, "per_point", "score", press=press, ratio=ratio))

    return (
        "Needle score at ratio 0.5 (2048 tokens), eviction at prefill (query-agnostic) vs Quest reads",
        f"full {score('none', 0.0)}; best pikv_hf eviction {ours} {score(ours, 0.5)}, best kvpress {theirs} "
        f"{score(theirs, 0.5)}; Quest (query-aware) {score('pikv_quest', 0.5)}",
        "Scheduling quality",
    )


def headline_kvpress(rec: Recorder) -> tuple[str, str, str] | None:
    """AdaKV's KV bytes on DynamicCache and PiKVCache."""
    p = KVPRESS_BYTES
    if not rec.exists(p):
        return None
    press = "AdaKVPress(SnapKVPress)"
    ratio = rec.load(p)["config"]["ratio"]
    return (
        f"kvpress AdaKV(SnapKV) at ratio {ratio}: KV held",
        f"DynamicCache {rec.fig('mib', row(p, 'results', 'dynamic.kv_bytes', press=press))} MiB, PiKVCache "
        f"{rec.fig('mib', row(p, 'results', 'pikv.kv_bytes', press=press))} MiB",
        "KV bytes inside kvpress",
    )
