"""Compression: bytes per token of every compression setting, decode speed of quantised pages, and needle scores
and perplexity against the full cache (with the README headline row)."""

from __future__ import annotations

import re
from pathlib import Path

from .framework import (
    BENCH,
    EVAL,
    NA_READS,
    Body,
    Recorder,
    Source,
    at,
    machine_text,
    makefile_command,
    row,
    run_command,
    table,
    verdict,
    versions_text,
)

# ---------------------------------------------------------------------------------------------- compression memory

COMPRESSION_MEMORY = f"{BENCH}/compression_memory.json"
# Targets of issue 17 at 4k tokens: KV bytes of B-bit quantisation, groups of 64, 128-token residual, <= bound x fp16's.
MEMORY_TOKENS = 4096
MEMORY_TARGETS = {4: 0.3, 2: 0.2}
TARGET_SETTING = "quant@bits={bits},group_size=64,window=128"


def quant_bits(setting: str) -> int | None:
    """The bits of a ``quant@bits=B...`` setting (pikv_hf's QuantPress); None for any other press."""
    m = re.match(r"quant@bits=(\d+)", setting)
    return int(m.group(1)) if m else None


def shards_label(n: int | None) -> str:
    """``1 shard``, ``8 shards`` or ``not sharded`` (transformers' QuantizedCache)."""
    return "not sharded" if n is None else f"{n} shard{'' if n == 1 else 's'}"


def memory_cells(rec: Recorder, p: str, setting: str, tokens: int) -> str:
    """``B/token/layer (x fp16)`` of each shard count of one setting at one length, joined by ``/``."""
    shards = [r["num_shards"] for r in rec.load(p)["rows"] if r["setting"] == setting and r["tokens"] == tokens]
    where = {"setting": setting, "tokens": tokens}
    return " / ".join(
        f"{rec.fig('r1', row(p, 'rows', 'bytes_per_token_per_layer', **where, num_shards=n))} "
        f"({rec.fig('r3', row(p, 'rows', 'vs_fp16', **where, num_shards=n))})"
        for n in shards
    )


def memory_checks(rec: Recorder, p: str, setting: str, bound: float) -> str:
    """``x fp16 (shards) met / not met`` for each row of one setting at ``MEMORY_TOKENS``."""
    out = []
    for r in rec.load(p)["rows"]:
        if r["setting"] == setting and r["tokens"] == MEMORY_TOKENS:
            src = row(p, "rows", "vs_fp16", setting=setting, tokens=MEMORY_TOKENS, num_shards=r["num_shards"])
            out.append(f"{rec.fig('r3', src)} ({shards_label(r['num_shards'])}) {verdict(rec.value(src) <= bound)}")
    return f"`{setting}` " + ", ".join(out)


def memory_targets(rec: Recorder, p: str) -> str:
    """Issue 17's byte targets at ``MEMORY_TOKENS``, judged on its settings, then on the other quantisation settings."""
    settings = list(dict.fromkeys(r["setting"] for r in rec.load(p)["rows"]))
    main, other = [], []
    for bits, bound in MEMORY_TARGETS.items():
        target = TARGET_SETTING.format(bits=bits)
        main.append(f"{bits}-bit <= {bound}x fp16: {memory_checks(rec, p, target, bound)}")
        other += [memory_checks(rec, p, s, bound) for s in settings if quant_bits(s) == bits and s != target]
    return (
        f"Targets (issue 17) at {MEMORY_TOKENS} tokens, groups of 64 and a 128-token residual: "
        + "; ".join(main)
        + ". Other quantisation settings against the bound of their bits: "
        + "; ".join(other)
        + "."
    )


def compression_memory(rec: Recorder) -> Body:
    """Bytes per token and layer of every compression setting against a dense fp16 cache."""
    p = COMPRESSION_MEMORY
    d = rec.load(p)
    tokens = sorted({r["tokens"] for r in d["rows"]})
    shards = " / ".join(str(n) for n in sorted({r["num_shards"] for r in d["rows"]} - {None}))
    rows = [
        [f"`{s}`", *(memory_cells(rec, p, s, t) for t in tokens)]
        for s in dict.fromkeys(r["setting"] for r in d["rows"])
    ]
    header = ["setting", *(f"{t} tokens: B per token and layer (x fp16), {shards} shards" for t in tokens)]
    return Body(
        measured=(
            f"KV bytes per sequence token and layer each compression setting holds, against a dense cache's "
            f"{rec.fig('int', at(p, 'dense_bytes_per_token_per_layer.fp16'))} B (fp16) / "
            f"{rec.fig('int', at(p, 'dense_bytes_per_token_per_layer.fp32'))} B (fp32); hot window {d['window']} "
            f"tokens in pages of {d['page_size_hot']}; model {d['model']}; KV: {d['kv']}; {d['notes']}"
        ),
        commands=[makefile_command(rec, p)],
        machine=machine_text(rec, p),
        reads=NA_READS,
        budget=(
            "the codecs keep every token (stored compressed beyond the hot window); pyramid evicts a share "
            "compression_ratio of them"
        ),
        text=table(header, rows)
        + "\n\nQuantizedCache is not sharded (one figure per length).\n\n"
        + memory_targets(rec, p),
    )


# ---------------------------------------------------------------------------------------- compression decode speed

COMPRESSION_SPEED = f"{BENCH}/compression_speed_cpu.json"
CACHE_NAMES = {
    "dynamic": "DynamicCache",
    "quantized_cache": "QuantizedCache (quanto)",
    "pikv_exact": "PiKVCache exact",
    "pikv_quant": "PiKVCache, quantised pages",
}


def compression_speed(rec: Recorder) -> Body:
    """Decode step time of the quantised PiKVCache against QuantizedCache and DynamicCache."""
    p = COMPRESSION_SPEED
    d = rec.load(p)
    rows = []
    for i, r in enumerate(d["rows"]):
        k = f"rows.{i}."
        rows.append(
            [
                str(r["context"]),
                CACHE_NAMES.get(r["cache"], r["cache"]),
                rec.fig("s_as_ms", at(p, k + "median_step_s")),
                rec.fig("mib", at(p, k + "kv_bytes")),
                rec.fig("r2", at(p, k + "vs_dynamic")),
                rec.fig("r2", at(p, k + "vs_quantized_cache")),
            ]
        )
    header = ["context", "cache", "median decode step ms", "KV MiB", "step / DynamicCache's", "step / QuantizedCache's"]
    parts = []
    for context in dict.fromkeys(r["context"] for r in d["rows"]):
        ours, theirs = (row(p, "rows", "kv_bytes", context=context, cache=c) for c in ("pikv_quant", "quantized_cache"))
        step = rec.fig("r2", row(p, "rows", "vs_quantized_cache", context=context, cache="pikv_quant"))
        parts.append(f"{context} tokens: step {step}x, KV bytes {rec.fig('r2', ours, theirs, combine='ratio')}x")
    summary = "Quantised PiKVCache against QuantizedCache: " + "; ".join(parts) + "."
    return Body(
        measured=(
            f"{d['model']}: median step time and KV bytes held, each cache filled with the same random context KV; "
            f"{d['settings']}"
        ),
        commands=[makefile_command(rec, p)],
        machine=machine_text(rec, p),
        reads=NA_READS,
        budget="none (every token kept; the quantised caches store all but the most recent tokens in 4 bits)",
        text=table(header, rows) + "\n\n" + summary,
    )


# --------------------------------------------------------------------------------------------- compression quality

COMPRESSION_QUALITY_GLOB = f"{EVAL}/compression_smollm2_pikv_*/metrics.json"
# Goals of issue 17: B-bit quantisation keeps at least this share of the full cache's needle score.
QUALITY_GOALS = {4: 0.99, 2: 0.95}


def length_points(rec: Recorder, metrics: str, length: int) -> list[dict]:
    """The run's ``per_length`` points at one length, in the order of its ``--press`` arguments."""
    m = rec.load(metrics)
    presses = m["arguments"]["presses"]
    return sorted((q for q in m["per_length"] if q["length"] == length), key=lambda q: presses.index(q["press"]))


def point_at(metrics: str, key: str, field: str, q: dict) -> Source:
    """``field`` of the row of list ``key`` with the press, ratio and length of ``q``."""
    return row(metrics, key, field, press=q["press"], ratio=q["ratio"], length=q["length"])


def of_full(rec: Recorder, metrics: str, q: dict) -> tuple[str, float | None]:
    """The point's needle score as a share of the ``none`` point's at its length (text, value; n/a when that is 0)."""
    full = row(metrics, "per_length", "score", press="none", ratio=0.0, length=q["length"])
    if not rec.value(full):
        return "n/a", None
    score = point_at(metrics, "per_length", "score", q)
    return rec.fig("pct_of", score, full, combine="ratio"), rec.value(score, full, combine="ratio")


def compression_row(rec: Recorder, metrics: str, q: dict) -> list[str]:
    """One table row: needle score, samples, share of full, KV, reconstruction error, perplexity."""
    m = rec.load(metrics)
    comp = next((c for c in m["compression"] if all(c[k] == q[k] for k in ("press", "ratio", "length"))), None)
    kv = rec.fig("mib", point_at(metrics, "compression", "kv_bytes", q)) if comp else "-"
    err = "-"
    if comp and comp["reconstruction_error"]:
        err = " / ".join(
            rec.fig("r3", point_at(metrics, "compression", f"reconstruction_error.{side}", q))
            for side in ("keys", "values")
        )
    ppl = "-"
    if any(r["press"] == q["press"] and r["ratio"] == q["ratio"] for r in m["perplexity"]):
        ppl = rec.fig("r2", row(metrics, "perplexity", "perplexity", press=q["press"], ratio=q["ratio"]))
    return [
        f"`{q['press']}`",
        rec.fig("pct", point_at(metrics, "per_length", "score", q)),
        rec.fig("int", point_at(metrics, "per_length", "n", q)),
        of_full(rec, metrics, q)[0],
        kv,
        err,
        ppl,
    ]


def quality_goals(rec: Recorder, metrics: str, length: int) -> str:
    """Issue 17's score goals, judged on the run's pikv_hf quantisation points at one length."""
    out = []
    for q in length_points(rec, metrics, length):
        goal = QUALITY_GOALS.get(quant_bits(q["press"]))
        if goal is not None:
            text, share = of_full(rec, metrics, q)
            judged = "n/a (the full cache found no needle)" if share is None else verdict(share >= goal)
            out.append(f"`{q['press']}` {text} (>= {goal:.0%}): {judged}")
    return "Goals: " + ("; ".join(out) or "no quantisation point") + "."


def compression_quality(rec: Recorder) -> Body:
    """Needle scores and perplexity of the compression presses against the full cache, per run and length."""
    files = rec.glob(COMPRESSION_QUALITY_GLOB)
    parts = []
    for metrics in files:
        m = rec.load(metrics)
        a = m["arguments"]
        state = "complete" if m["complete"] else "**incomplete** (interim: not every sample of every point ran)"
        header = ["press", "score %", "n", "of full", "KV MiB", "reconstruction error K / V"]
        header.append(f"perplexity after {a['perplexity_context']} tokens" if m["perplexity"] else "perplexity")
        for length in a["lengths"]:
            rows = [compression_row(rec, metrics, q) for q in length_points(rec, metrics, length)]
            parts.append(
                f"`{Path(metrics).parent.name}`, {length} tokens, {a['samples']} per task; run {state}, "
                f"{rec.fig('int', at(metrics, 'n_rows'))} rows:\n\n{table(header, rows)}\n\n"
                f"{quality_goals(rec, metrics, length)}"
            )
    ms = [rec.load(f) for f in files]
    aware = {m["query_aware"] for m in ms}
    goals = " and ".join(f"{b}-bit >= {g:.0%}" for b, g in QUALITY_GOALS.items())
    note = (
        f"Goals (issue 17): {goals} of the full cache's needle score, judged on pikv_hf's QuantPress "
        "(`quant@bits=B`); `quantized_cache@nbits=B` is transformers' QuantizedCache at the same bits, for "
        "comparison. Bytes per token against fp16: see Compression memory."
    )
    return Body(
        measured=(
            f"RULER-style single needles ({', '.join(ms[0]['tasks'])}) on {ms[0]['model_info']['name']}, the context "
            "compressed by each press into the run's cache, against the uncompressed cache (`none`); score = % of "
            "needles found (n samples), of full = share of the `none` score, KV = mean bytes held after the prefill, "
            "reconstruction error = mean ||x - D(E(x))|| / ||x|| of keys / values over the layers (first sample per "
            f"task), perplexity of {ms[0]['arguments']['perplexity_tokens']} held-out essay tokens after a compressed "
            f"held-out context. Protocol: {ms[0]['protocol']}"
        ),
        commands=[run_command(str(Path(f).parent), m) for f, m in zip(files, ms, strict=True)],
        machine="; ".join(sorted({versions_text(m["versions"]) for m in ms}))
        + f"; platform {ms[0]['versions']['platform']}",
        reads=(
            "query-agnostic (the context is compressed before the question is seen; compression keeps every token, "
            "pyramid evicts)"
            if aware == {False}
            else "mixed"
        ),
        budget="per press setting (bits, rank, channels; pyramid: compression_ratio = share of tokens evicted)",
        text="\n\n".join([note, *parts]),
    )


# ---------------------------------------------------------------------------------------------------- headline


def headline_compression(rec: Recorder) -> tuple[str, str, str] | None:
    """4-bit QuantPress: KV bytes against fp16's at ``MEMORY_TOKENS`` (memory benchmark) and needle score against the
    full cache's at the largest length a compression run measured it."""
    p = COMPRESSION_MEMORY
    if not rec.exists(p):
        return None
    target = TARGET_SETTING.format(bits=4)
    rows = [r for r in rec.load(p)["rows"] if r["setting"] == target and r["tokens"] == MEMORY_TOKENS]
    ratios = " / ".join(
        rec.fig("r3", row(p, "rows", "vs_fp16", setting=target, tokens=MEMORY_TOKENS, num_shards=r["num_shards"]))
        for r in rows
    )
    shards = " / ".join(shards_label(r["num_shards"]) for r in rows)
    result, title = f"KV bytes {ratios}x fp16's at {MEMORY_TOKENS} tokens ({shards})", "Compression memory"
    points = [
        (q["length"], metrics, q)
        for metrics in rec.glob(COMPRESSION_QUALITY_GLOB)
        for q in rec.load(metrics)["per_length"]
        if q["press"] == "quant@bits=4"
    ]
    if points:
        length, metrics, q = max(points, key=lambda x: x[0])
        interim = "" if rec.load(metrics)["complete"] else ", interim"
        result += f"; needle score {of_full(rec, metrics, q)[0]} of the full cache's at {length} tokens{interim}"
        title = "Compression quality"
    return "4-bit quantised KV (QuantPress, groups of 64, 128-token residual)", result, title
