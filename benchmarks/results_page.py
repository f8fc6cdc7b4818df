"""Generate ``docs/RESULTS.md`` (and README.md's headline table) from the committed result JSON files.

Every figure on the page goes through :meth:`Recorder.fig`, which reads it from a JSON file (a key path, one row
picked by its fields, or an aggregate over rows), formats it with a named formatter and records where it came
from, so ``tests/test_results_page.py`` can recompute each one. A section is skipped when none of the files it
needs exists; re-running the script adds it once its JSON is committed.

    python benchmarks/results_page.py            # writes docs/RESULTS.md, and README.md between the results markers
    python benchmarks/results_page.py --check    # exits 1 when either differs from what would be generated

Adding a section: write ``def my_section(rec: Recorder) -> Body`` that reads its numbers with ``rec.fig`` (and
settings with ``rec.load``), then append ``Section("Title", ("path/or/glob.json",), my_section)`` to ``SECTIONS``;
a headline row is a function of ``rec`` appended to ``HEADLINE``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGE = "docs/RESULTS.md"
README = "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
BENCH = "benchmarks/results"
EVAL = "eval/results"
MIB = 2**20
MAX_LABELS = 5  # longer lists of needles are shown as a count
NUMERIC = re.compile(r"^[-0-9.,/ ()x%e+]*$")  # cells of right-aligned columns
NEUTRAL = {"", "-", "all", "n/a", "not recorded"}  # cells that do not decide a column's alignment

# Goals quoted from README.md (routing issue): recall >= 0.95 and needle score >= 98% of exact, reading <= 25% of the
# KV a dense cache would read.
RECALL_GOAL, SCORE_GOAL, READ_GOAL = 0.95, 0.98, 0.25
# Defaults of `pikv-hf eval` (EvalConfig / PiKVCache) for arguments that older metrics.json files do not record.
EVAL_DEFAULTS = {"num_shards": 8, "page_size": 16, "dense_layers": 0, "mass_target": None}

FORMATS: dict[str, Callable[[Any], str]] = {
    "ms": lambda v: f"{v:.2f}" if v < 10 else f"{v:.1f}",
    "s": lambda v: f"{v:.1f}",
    "s_as_ms": lambda v: f"{1000 * v:.1f}",
    "r1": lambda v: f"{v:.1f}",
    "r2": lambda v: f"{v:.2f}",
    "r3": lambda v: f"{v:.3f}",
    "x": lambda v: f"{v:.1f}x",
    "pct": lambda v: f"{v:.1f}",
    "pct_frac": lambda v: f"{100 * v:.1f}",
    "pct_of": lambda v: f"{100 * v:.0f}%",
    "mib": lambda v: f"{v / MIB:.1f}",
    "kib": lambda v: f"{v / 2**10:.1f}",
    "int": lambda v: f"{int(v):,}",
    "gbs": lambda v: f"{v:.1f}",
    "sci": lambda v: f"{v:.1e}",
    "labels": lambda v: f"{len(v)} needles" if len(v) > MAX_LABELS else ", ".join(v) or "-",
}


@dataclass(frozen=True)
class Source:
    """Where a value comes from: ``key`` (dotted path) into ``path``; with ``op`` other than ``value`` the key leads
    to a list of rows, filtered by ``where`` (field, value) pairs, and ``op`` picks ``field`` of the only row
    (``one``), aggregates it (``mean``, ``min``, ``max``), counts the rows (``count``) or returns them (``rows``)."""

    path: str
    key: str = ""
    op: str = "value"
    field: str = ""
    where: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Figure:
    """A formatted figure on the page and its provenance: ``combine`` joins the sources' values (``first``: the
    only source; ``ratio``: first / second; ``lost`` / ``won``: needles whose score fell / rose from the second
    rows to the first; ``same``: rows of both with the same prediction)."""

    text: str
    fmt: str
    sources: tuple[Source, ...]
    combine: str = "first"


def at(path: str, key: str) -> Source:
    """The value at dotted ``key`` of ``path``."""
    return Source(path, key)


def row(path: str, key: str, field: str, **where: Any) -> Source:
    """``field`` of the one row of list ``key`` whose fields equal ``where``."""
    return Source(path, key, "one", field, tuple(where.items()))


def agg(op: str, path: str, key: str = "", field: str = "", **where: Any) -> Source:
    """``op`` (mean, min, max, count, rows) over the rows of list ``key`` whose fields equal ``where``."""
    return Source(path, key, op, field, tuple(where.items()))


def walk(data: Any, key: str) -> Any:
    """Follow a dotted key path (list indices as integers)."""
    for part in filter(None, key.split(".")):
        data = data[int(part)] if isinstance(data, list) else data[part]
    return data


def needle_flips(rows: list[dict], ref: list[dict], direction: int) -> list[str]:
    """Labels (``task index``) of needles whose score is lower (``direction=-1``) or higher (``+1``) in ``rows``
    than in the reference rows."""
    ref_score = {(r["task"], r["index"]): r["score"] for r in ref}
    flips = [r for r in rows if (r["score"] - ref_score[r["task"], r["index"]]) * direction > 0]
    flips.sort(key=lambda r: (r["task"], r["index"]))
    return [f"{r['task'].removeprefix('niah_single_')} {r['index']}" for r in flips]


def same_predictions(rows: list[dict], ref: list[dict]) -> int:
    """Rows whose prediction equals the reference row of the same key."""
    ref_pred = {r["key"]: r["prediction"] for r in ref}
    return sum(r["prediction"] == ref_pred.get(r["key"]) for r in rows)


COMBINE: dict[str, Callable[[list[Any]], Any]] = {
    "first": lambda v: v[0],
    "ratio": lambda v: v[0] / v[1],
    "lost": lambda v: needle_flips(v[0], v[1], -1),
    "won": lambda v: needle_flips(v[0], v[1], 1),
    "same": lambda v: same_predictions(v[0], v[1]),
}


class Recorder:
    """Reads JSON files under ``root`` and records every figure placed on the page."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.figures: list[Figure] = []
        self.files: set[str] = set()
        self._cache: dict[str, Any] = {}

    def exists(self, path: str) -> bool:
        """Whether ``path`` (relative to the root) is a file."""
        return (self.root / path).is_file()

    def glob(self, pattern: str) -> list[str]:
        """Paths relative to the root matching ``pattern``, sorted."""
        return sorted(p.relative_to(self.root).as_posix() for p in self.root.glob(pattern) if p.is_file())

    def load(self, path: str) -> Any:
        """A JSON file, or a JSONL file as a list of rows."""
        self.files.add(path)
        if path not in self._cache:
            text = (self.root / path).read_text()
            lines = text.splitlines() if path.endswith(".jsonl") else [text]
            parsed = [json.loads(line) for line in lines if line.strip()]
            self._cache[path] = parsed if path.endswith(".jsonl") else parsed[0]
        return self._cache[path]

    def resolve(self, src: Source) -> Any:
        """The value a source names."""
        data = walk(self.load(src.path), src.key)
        if src.op == "value":
            return data
        rows = [r for r in data if all(r.get(k) == v for k, v in src.where)]
        if src.op == "rows":
            return rows
        if src.op == "count":
            return len(rows)
        values = [walk(r, src.field) for r in rows]
        if src.op == "one":
            if len(values) != 1:
                raise ValueError(f"{src}: {len(values)} rows match, expected one")
            return values[0]
        return {"mean": statistics.fmean, "min": min, "max": max}[src.op](values)

    def value(self, *sources: Source, combine: str = "first") -> Any:
        """The combined value of ``sources`` (not recorded: for decisions, not for the page)."""
        return COMBINE[combine]([self.resolve(s) for s in sources])

    def fig(self, fmt: str, *sources: Source, combine: str = "first") -> str:
        """Format the combined value of ``sources`` with ``FORMATS[fmt]`` and record it."""
        text = FORMATS[fmt](self.value(*sources, combine=combine))
        self.figures.append(Figure(text, fmt, sources, combine))
        return text


@dataclass
class Body:
    """What a section builder returns: the metadata lines every section states and its tables and verdicts."""

    measured: str
    commands: list[str]
    machine: str
    reads: str
    budget: str
    text: str


@dataclass(frozen=True)
class Section:
    """A page section: skipped when no file matches any of ``needs`` (globs relative to the repository root)."""

    title: str
    needs: tuple[str, ...]
    build: Callable[[Recorder], Body]


@dataclass
class Rendered:
    """A section as placed on the page, with the files it read."""

    title: str
    markdown: str
    commands: list[str]
    files: list[str]


@dataclass
class Results:
    """The generated page, the README headline table and every recorded figure."""

    page: str
    headline: str
    sections: list[Rendered]
    figures: list[Figure]
    headline_figures: list[Figure]


# ----------------------------------------------------------------------------------------------------------- helpers


def table(header: list[str], rows: Iterable[list[str]]) -> str:
    """A Markdown table; columns whose cells are all numeric are right-aligned."""
    rows = list(rows)
    numeric = [i > 0 and all(r[i] in NEUTRAL or NUMERIC.match(r[i]) for r in rows) for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "".join(" ---: |" if n else " --- |" for n in numeric)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def slug(title: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")


def frac(x: float) -> str:
    """A share such as 0.1875 as ``3/16``."""
    return str(Fraction(x).limit_denominator(256))


def verdict(ok: bool) -> str:
    """``met`` or a bold ``not met``."""
    return "met" if ok else "**not met**"


def versions_text(versions: dict) -> str:
    """The library versions a JSON file records, in a fixed order."""
    keys = ("python", "torch", "transformers", "kvpress", "pikv_hf")
    return ", ".join(f"{k} {versions[k]}" for k in keys if k in versions)


def machine_text(rec: Recorder, path: str) -> str:
    """Device, threads, measured bandwidth / FLOP rate and versions recorded in a benchmark JSON."""
    data = rec.load(path)
    m = data.get("machine", {})
    parts = [f"{m['device']} ({m['processor']}), {m['threads']} thread(s)" if m else "machine not recorded"]
    if "read_bandwidth_gbs" in m:
        parts.append(f"read bandwidth {rec.fig('gbs', at(path, 'machine.read_bandwidth_gbs'))} GB/s")
    if "matmul_gflops" in m:
        parts.append(f"fp32 matmul {rec.fig('gbs', at(path, 'machine.matmul_gflops'))} GFLOP/s")
    return "; ".join([*parts, versions_text(data.get("versions", {}))])


def target_bound(text: str) -> float:
    """The number after ``<=`` in a target sentence recorded in a JSON file."""
    return float(re.search(r"<=\s*([0-9.]+)", text).group(1))


def makefile_command(rec: Recorder, path: str) -> str:
    """``make TARGET`` and the recipe line of the Makefile that writes ``path`` (for JSON without a command)."""
    text = (rec.root / "Makefile").read_text().replace("\\\n", " ")
    rec.files.add("Makefile")
    target = ""
    for line in text.splitlines():
        if m := re.match(r"^([A-Za-z0-9_.-]+):", line):
            target = m.group(1)
        elif line.startswith("\t") and path in line:
            recipe = re.sub(r"\s+", " ", line.strip()).replace("$(PY) ", "python ")
            return f"make {target}  # {recipe}"
    raise ValueError(f"no Makefile recipe writes {path}")


NA_READS = "not applicable (no answer quality measured)"

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


# ------------------------------------------------------------------------------------------------- routing recall

RECALL_GLOB = f"{BENCH}/routing_recall_*.json"


def selection_label(r: dict) -> str:
    """How a recall row selected what it read."""
    k = frac(r["k_over_E"])
    if r["selector"] == "quest":
        return f"Quest pages, f = {k}"
    if r.get("mass_target") is not None:
        return f"top-p {r['mass_target']}, cap k/E = {k} (k = {r['k']})"
    return f"{r['selector']} k/E = {k} (k = {r['k']})"


def recall_current(rec: Recorder, files: list[str]) -> str:
    """Every row of the files that record a dense-layer setting, with the goal marked."""
    entries = []
    for p in files:
        s = rec.load(p)["setting"]
        for i, r in enumerate(rec.load(p)["results"]):
            entries.append(((s["length"], s["shards"], s["page_size"], r["kv_read_vs_dense"]), p, i, s, r))
    rows = []
    for _, p, i, s, r in sorted(entries, key=lambda e: e[0]):
        key = f"results.{i}."
        ok = r["recall"] >= RECALL_GOAL and r["kv_read_vs_dense"] <= READ_GOAL
        rows.append(
            [
                str(s["length"]),
                f"{s['shards']} ({s['page_size']})",
                f"{r['placement']}, {s['dense_layers']} dense",
                selection_label(r),
                rec.fig("r3", at(p, key + "recall")),
                rec.fig("r3", at(p, key + "fraction_tokens_attended")),
                rec.fig("r3", at(p, key + "kv_read_vs_dense")),
                "met" if ok else "-",
                f"`{Path(p).name}`",
            ]
        )
    header = ["length", "shards (page)", "placement, dense layers", "selection", "recall", "tokens attended"]
    header += ["KV read vs dense", f"goal (recall >= {RECALL_GOAL}, read <= {READ_GOAL})", "file"]
    return table(header, rows)


def recall_placements(rec: Recorder, files: list[str]) -> str:
    """Top-k and Quest rows of the files without a dense-layer setting, one row per configuration, k/E in columns."""
    groups: dict[tuple, tuple[str, dict]] = {}
    shares: set[float] = set()
    for p in files:
        shards = rec.load(p)["setting"]["shards"]
        for r in rec.load(p)["results"]:
            if r["selector"] in ("topk", "quest"):
                ident = (shards, r["model"], r["placement"], r["selector"], r.get("score", "centroid"))
                groups.setdefault(ident, (p, r))
                shares.add(r["k_over_E"])
    rows = []
    for (shards, model, placement, selector, score), (p, r) in sorted(groups.items()):
        where = {k: r[k] for k in ("model", "placement", "selector", "score") if k in r}
        cells = [
            f"{rec.fig('r3', row(p, 'results', 'recall', **where, k_over_E=s))} "
            f"({rec.fig('r3', row(p, 'results', 'fraction_tokens_attended', **where, k_over_E=s))})"
            for s in sorted(shares)
        ]
        rows.append([str(shards), model, placement, f"{selector} ({score})", *cells, f"`{Path(p).name}`"])
    header = [
        "shards",
        "model",
        "placement",
        "selector (shard score)",
        *(f"k/E = {frac(s)}" for s in sorted(shares)),
        "file",
    ]
    return table(header, rows)


def routing_recall(rec: Recorder) -> Body:
    """Attention recall of routed reads: current settings and the placement comparison."""
    files = rec.glob(RECALL_GLOB)
    current = [p for p in files if "dense_layers" in rec.load(p)["setting"]]
    earlier = [p for p in files if p not in current]
    s = rec.load(files[0])["setting"]
    parts = []
    if current:
        parts.append(
            "Files that record page size and dense layers (key-cluster placement; the first layer(s) read in full):"
            f"\n\n{recall_current(rec, current)}"
        )
    if earlier:
        parts.append(
            "Placement comparison, files without a dense-layer setting (no dense layer; page size not recorded), "
            "top-k and Quest selection; cells: recall (fraction of tokens attended):\n\n"
            + recall_placements(rec, earlier)
        )
    aware = {rec.load(p)["setting"]["query_aware"] for p in files}
    machines: dict[str, int] = {}
    for text in (machine_text(rec, p) for p in files):
        machines[text] = machines.get(text, 0) + 1
    return Body(
        measured=(
            f"attention recall of routed decode reads (fraction of exact attention's probability mass on the tokens "
            f"read), every layer and KV head, {s['steps']} teacher-forced decode steps after a prefill of "
            f"{', '.join(sorted({str(rec.load(p)['setting']['length']) for p in files}))} tokens of "
            f"{s['text']}; {s['n_sink']} sinks and {s['window']} recent tokens always read and counted"
        ),
        commands=[rec.load(p)["command"] for p in files],
        machine=" / ".join(f"{text} ({n} files)" for text, n in machines.items()),
        reads="query-aware (each decode step selects with its own query)" if aware == {True} else "mixed",
        budget=f"{s['budget']}; KV read vs dense = page slots gathered per step over the tokens a dense cache holds",
        text="\n\n".join(parts),
    )


# ----------------------------------------------------------------------------------------------- routing quality

QUALITY_GLOB = f"{EVAL}/routing_quality_*/metrics.json"


@dataclass(frozen=True)
class Point:
    """One (run directory, press, ratio, length) of a routing-quality run; ``args`` are the run's cache settings."""

    run: str
    press: str
    ratio: float
    length: int
    args: tuple[tuple[str, Any], ...]

    @property
    def preds(self) -> str:
        """The run's ``predictions.jsonl``."""
        return f"{self.run}/predictions.jsonl"

    @property
    def metrics(self) -> str:
        """The run's ``metrics.json``."""
        return f"{self.run}/metrics.json"

    def setting(self) -> tuple:
        """What identifies the read across lengths and directories (also the table order)."""
        a = dict(self.args)
        return (self.press, a["num_shards"], a["page_size"], a["dense_layers"], a["mass_target"] or 0, -self.ratio)

    def label(self) -> str:
        """The read in words (exact, routed or Quest, with the cache settings)."""
        a = dict(self.args)
        keep = frac(1 - self.ratio)
        base = f"{a['num_shards']} shards, pages of {a['page_size']}, {a['dense_layers']} dense"
        if self.press == "none":
            return "exact"
        if self.press == "pikv_quest":
            return f"Quest pages f = {keep} ({base})"
        read = f"top-p {a['mass_target']}, cap k/E = {keep}" if a["mass_target"] is not None else f"top-k k/E = {keep}"
        return f"routed {read} ({base})"


def quality_points(rec: Recorder) -> list[Point]:
    """Every (run, press, ratio, length) of the routing-quality runs."""
    points = []
    for metrics in rec.glob(QUALITY_GLOB):
        m = rec.load(metrics)
        a = {**EVAL_DEFAULTS, **{k: v for k, v in m["arguments"].items() if v is not None}}
        args = tuple((k, a[k]) for k in EVAL_DEFAULTS)
        run = str(Path(metrics).parent)
        for pt in sorted({(r["press"], r["ratio"], r["length"]) for r in m["per_task"]}):
            points.append(Point(run, *pt, args=args))
    return points


def exact_refs(points: list[Point]) -> dict[int, Point]:
    """Per length, the first run (sorted) with an exact (``none``) point: the reference of lost / won needles."""
    refs: dict[int, Point] = {}
    for p in points:
        if p.press == "none":
            refs.setdefault(p.length, p)
    return refs


def point_rows(p: Point) -> Source:
    """The prediction rows of one point."""
    return agg("rows", p.preds, press=p.press, ratio=p.ratio, length=p.length)


def point_mean(p: Point, name: str) -> Source:
    """Mean of ``name`` over the prediction rows of one point."""
    return agg("mean", p.preds, "", name, press=p.press, ratio=p.ratio, length=p.length)


def has_read(rec: Recorder, p: Point) -> bool:
    """Whether the point's predictions record the KV read (older runs do not)."""
    return "kv_read_vs_dense" in rec.resolve(point_rows(p))[0]


def meets_goal(rec: Recorder, p: Point, ref: Point) -> bool:
    """Score >= SCORE_GOAL x exact's while reading <= READ_GOAL of the dense KV (needs the recorded read)."""
    share = rec.value(point_mean(p, "score"), point_mean(ref, "score"), combine="ratio")
    return share >= SCORE_GOAL and rec.value(point_mean(p, "kv_read_vs_dense")) <= READ_GOAL


def of_exact(rec: Recorder, p: Point, ref: Point) -> str:
    """The point's score as a share of exact's at the same length."""
    return rec.fig("pct_of", point_mean(p, "score"), point_mean(ref, "score"), combine="ratio")


def quality_row(rec: Recorder, p: Point, ref: Point, tasks: list[str]) -> list[str]:
    """One table row: score, per-task scores, reads, lost / won needles, goal."""
    per_task = " / ".join(
        rec.fig("pct", row(p.metrics, "per_task", "score", press=p.press, ratio=p.ratio, length=p.length, task=t))
        for t in tasks
    )
    if p.press == "none":
        reads, goal = ["all", "all"], ""
    else:
        kv = rec.fig("r3", point_mean(p, "kv_read_vs_dense")) if has_read(rec, p) else "not recorded"
        reads = [rec.fig("r3", point_mean(p, "fraction_tokens_attended")), kv]
        goal = ("met" if meets_goal(rec, p, ref) else "-") if has_read(rec, p) else "n/a"
    lost = rec.fig("labels", point_rows(p), point_rows(ref), combine="lost")
    won = rec.fig("labels", point_rows(p), point_rows(ref), combine="won")
    score = rec.fig("pct_frac", point_mean(p, "score"))
    return [p.label(), score, of_exact(rec, p, ref), per_task, *reads, f"{lost} / {won}", goal, f"`{Path(p.run).name}`"]


def quality_table(rec: Recorder, points: list[Point], ref: Point) -> str:
    """The routing-quality table of one length, exact first."""
    tasks = rec.load(ref.metrics)["tasks"]
    ordered = [ref] + sorted((p for p in points if p.length == ref.length and p.press != "none"), key=Point.setting)
    header = ["read", "score %", "of exact", " / ".join(t.removeprefix("niah_single_") for t in tasks)]
    header += ["tokens attended", "KV read vs dense", "lost / won vs exact", "goal", "directory"]
    return table(header, (quality_row(rec, p, ref, tasks) for p in ordered))


def goal_settings(rec: Recorder, points: list[Point], refs: dict[int, Point]) -> list[list[Point]]:
    """The points of each setting that was run at every reference length and meets the goal at each."""
    by_setting: dict[tuple, list[Point]] = {}
    for p in points:
        if p.press != "none" and p.length in refs:
            by_setting.setdefault(p.setting(), []).append(p)
    return [
        sorted(pts, key=lambda q: q.length)
        for pts in by_setting.values()
        if {p.length for p in pts} == set(refs)
        and all(has_read(rec, p) and meets_goal(rec, p, refs[p.length]) for p in pts)
    ]


def setting_figures(rec: Recorder, pts: list[Point], refs: dict[int, Point]) -> str:
    """``length: share of exact's score at KV read r`` for each point of one setting."""
    return ", ".join(
        f"{p.length}: {of_exact(rec, p, refs[p.length])} of exact at KV read "
        f"{rec.fig('r3', point_mean(p, 'kv_read_vs_dense'))}"
        for p in pts
    )


def run_command(run: str, metrics: dict) -> str:
    """An eval run's command after a comment with its directory, git commit and where its output was written."""
    git = f"git {metrics['git']['commit'][:7]}{' (dirty)' if metrics['git']['dirty'] else ''}"
    out = out_dir(metrics["command"])
    moved = f", written to {out} and copied here" if out != run else ""
    return f"# {Path(run).name}: {git}{moved}\n{metrics['command']}"


def routing_quality(rec: Recorder) -> Body:
    """Needle scores of routed and Quest reads against exact, per length."""
    points = quality_points(rec)
    refs = exact_refs(points)
    runs = sorted({p.run for p in points})
    metrics = [rec.load(f"{r}/metrics.json") for r in runs]
    tables = [
        f"{n} tokens, {rec.fig('int', agg('count', ref.preds, press='none', length=n))} needles per point; "
        f"exact reference: `{Path(ref.run).name}`\n\n{quality_table(rec, points, ref)}"
        for n, ref in sorted(refs.items())
    ]
    goal = (
        f"Goal (README, routing issue): score >= {SCORE_GOAL:.0%} of exact's while reading <= {READ_GOAL} of the "
        "dense KV; `n/a` where the run did not record the KV read. Lost / won: needles (task index) the point "
        f"fails / passes where exact passes / fails, from the runs' `predictions.jsonl` (a count above {MAX_LABELS})."
    )
    settings = [f"- {pts[0].label()}: {setting_figures(rec, pts, refs)}" for pts in goal_settings(rec, points, refs)]
    lengths = ", ".join(str(n) for n in sorted(refs))
    one = f"Settings that meet the goal at every length ({lengths}):\n" + ("\n".join(settings) or "none")
    commands = [run_command(r, m) for r, m in zip(runs, metrics, strict=True)]
    sinks = sorted({(m["arguments"]["n_sink"], m["arguments"]["window"]) for m in metrics})
    aware = {m["query_aware"] for m in metrics}
    return Body(
        measured=(
            f"RULER-style single needles ({', '.join(metrics[0]['tasks'])}) on {metrics[0]['model_info']['name']}, "
            "exact attention against routed (key-cluster shards) and Quest page reads of the same uncompressed "
            f"cache; score = % of needles found. Protocol: {metrics[0]['protocol']}"
        ),
        commands=commands,
        machine="; ".join(sorted({versions_text(m["versions"]) for m in metrics}))
        + f"; platform {metrics[0]['versions']['platform']}",
        reads="query-aware" if aware == {True} else "mixed",
        budget=(
            "per KV head and layer at each decode step: routed reads at most k/E = 1 - ratio of the shards (fewer "
            "when a mass target is set), Quest f = 1 - ratio of the pages; (sinks, window) = "
            + ", ".join(f"({a}, {b})" for a, b in sinks)
            + " tokens, inside the budget"
        ),
        text="\n\n".join([*tables, goal, one]),
    )


# ------------------------------------------------------------------------------------------------ kvpress baseline

RULER_TABLE = f"{EVAL}/ruler2k_table.json"


def out_dir(command: str) -> str:
    """The ``--out`` directory of an eval command."""
    return re.search(r"--out (\S+)", command).group(1)


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


# ---------------------------------------------------------------------------------------------- page store, budget

STORE_RAGGED = f"{BENCH}/store_ragged_cpu.json"


def store_ragged(rec: Recorder) -> Body:
    """Ragged per-head budgets of the page store and the cost of an eviction."""
    p = STORE_RAGGED
    d = rec.load(p)
    mib = {
        "KV before the ragged eviction": "ragged.kv_bytes_before",
        "KV after": "ragged.kv_bytes_after",
        "kept tokens' K/V": "ragged.kept_token_bytes",
        "bound: kept + one partial page per (row, KV head, shard)": "ragged.bound_bytes",
        "DynamicCache with the same budgets (largest head's tokens)": "ragged.dynamic_cache_bytes_same_budgets",
    }
    rows = [[name, rec.fig("mib", at(p, key)) + " MiB"] for name, key in mib.items()]
    rows.append(["after over kept tokens' bytes", rec.fig("r3", at(p, "ragged.after_over_kept"))])
    rows.append(["evict half of every head: ms", rec.fig("ms", at(p, "evict_half.evict_half_ms"))])
    rows.append(["one exact decode attention: ms", rec.fig("ms", at(p, "evict_half.exact_decode_attention_ms"))])
    rows.append(["evict half over one attention", rec.fig("r2", at(p, "evict_half.evict_over_attention"))])
    t, ev = d["targets"], d["evict_half"]
    fast = ev["evict_over_attention"] <= t["evict_over_attention_max"]
    check = (
        f"Targets recorded in the JSON: KV after within the bound: {verdict(d['ragged']['after_within_bound'])}; "
        f"evict half <= {rec.fig('r2', at(p, 'targets.evict_over_attention_max'))}x one decode attention: "
        f"{verdict(fast)}."
    )
    c = d["config"]
    return Body(
        measured=(
            f"one layer holding {d['ragged']['context']} tokens keeps shares "
            f"{', '.join(map(str, d['ragged']['kept_share_per_head']))} of the tokens of its KV heads (random tokens "
            f"per head); allocated bytes against the kept tokens' bytes; and evicting half of every head's tokens "
            f"against one exact decode attention; {c['num_attention_heads']} query / {c['num_key_value_heads']} KV "
            f"heads, head_dim {c['head_dim']}, {c['shards']} shards, pages of {c['page_size']}, random keys"
        ),
        commands=[d["command"]],
        machine=machine_text(rec, p),
        reads=NA_READS,
        budget="ragged: per KV head (the shares above)",
        text=table(["measure", "value"], rows) + "\n\n" + check,
    )


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


# ------------------------------------------------------------------------------------------------- prefill memory

PREFILL_MEMORY = f"{BENCH}/prefill_memory_cpu.json"


def prefill_memory(rec: Recorder) -> Body:
    """Peak resident memory of a long prefill, PiKVCache against DynamicCache."""
    p = PREFILL_MEMORY
    d = rec.load(p)
    keys = ("peak_rss_bytes", "baseline_rss_bytes", "model_bytes", "kv_bytes", "meta_bytes")
    rows = []
    for i, r in enumerate(d["results"]):
        k = f"results.{i}."
        rows.append(
            [r["malloc"], r["cache"]]
            + [rec.fig("mib", at(p, k + name)) for name in keys]
            + [rec.fig("r3", at(p, k + n)) for n in ("peak_over_kv_plus_model", "peak_over_kv_meta_plus_model")]
        )
    header = ["malloc", "cache", "peak RSS MiB", "baseline MiB", "model MiB", "KV MiB", "metadata MiB"]
    header += ["(peak - baseline) / (KV + model)", "/ (KV + metadata + model)"]
    bound = target_bound(d["target"])
    judged = row(p, "results", "peak_over_kv_plus_model", cache="pikv", malloc="mmap_threshold_1MiB")
    with_meta = row(p, "results", "peak_over_kv_meta_plus_model", cache="pikv", malloc="mmap_threshold_1MiB")
    check = (
        f"Target recorded in the JSON: {d['target']}: {rec.fig('r3', judged)}, {verdict(rec.value(judged) <= bound)} "
        f"(counting the metadata with the KV: {rec.fig('r3', with_meta)}, {verdict(rec.value(with_meta) <= bound)})."
    )
    c = d["config"]
    return Body(
        measured=(
            f"peak resident memory of a {c['context']}-token prefill of {c['model']} into a PiKVCache ({c['shards']} "
            f"{c['router']} shards, pages of {c['page_size']}) and into a DynamicCache, each in a fresh process, with "
            "glibc's default allocator settings and with MALLOC_MMAP_THRESHOLD_ = 1 MiB (live memory)"
        ),
        commands=[d["command"]],
        machine=machine_text(rec, p),
        reads=NA_READS,
        budget="none (exact prefill)",
        text=table(header, rows) + "\n\n" + check,
    )


# -------------------------------------------------------------------------------------------------------- kernels

KERNELS_GLOB = f"{BENCH}/kernels_*.json"


def kernel_table(rec: Recorder, p: str) -> str:
    """One kernels JSON: the cases and the backend they ran on."""
    rows = []
    for i, case in enumerate(rec.load(p)["cases"]):
        k = f"cases.{i}."
        rows.append(
            [
                str(case["tokens"]),
                str(case["selection_fraction"]),
                rec.fig("ms", at(p, k + "ms")),
                rec.fig("gbs", at(p, k + "gb_s")),
                rec.fig("pct", at(p, k + "pct_peak")),
                f"{rec.fig('ms', at(p, k + 'sdpa_full_ms'))} ({rec.fig('x', at(p, k + 'speedup_vs_sdpa_full'))})",
                f"{rec.fig('ms', at(p, k + 'gather_sdpa_ms'))} ({rec.fig('x', at(p, k + 'speedup_vs_gather_sdpa'))})",
                rec.fig("sci", at(p, k + "max_abs_diff_vs_gather_sdpa")),
            ]
        )
    header = ["tokens", "share of pages read", "ms", "GB/s", "% of peak", "SDPA full ms (speedup)"]
    header += ["gather + SDPA ms (speedup)", "max abs diff vs gather + SDPA"]
    d = rec.load(p)
    return (
        f"`{p}`: backend {d['backend']}; peak {rec.fig('gbs', at(p, 'peak_gbs'))} GB/s ({d['peak_source']}).\n\n"
        f"{table(header, rows)}\n\nTargets: {d['targets']}."
    )


def kernels(rec: Recorder) -> Body:
    """Decode attention kernels against SDPA and gather + SDPA."""
    files = rec.glob(KERNELS_GLOB)
    c = rec.load(files[0])["config"]
    return Body(
        measured=(
            f"decode attention through the backend seam, dense and sparse reads of one layer's pages ({c['heads']} "
            f"query / {c['kv_heads']} KV heads, head_dim {c['head_dim']}, pages of {c['page_size']}, {c['dtype']}; "
            f"selection: {c['selection']}; bytes read: {c['bytes_read']}), against SDPA over the whole cache and "
            "gather + SDPA over the same pages; random keys (speed only)"
        ),
        commands=[rec.load(p)["command"] for p in files],
        machine="; ".join(machine_text(rec, p) for p in files),
        reads=NA_READS,
        budget="share of each (row, KV head)'s pages read, per case",
        text="\n\n".join(kernel_table(rec, p) for p in files),
    )


# ---------------------------------------------------------------------------------------------------- distributed

DISTRIBUTED = f"{BENCH}/distributed_gloo_cpu.json"


def distributed(rec: Recorder) -> Body:
    """Expert-sharded KV over gloo ranks: bytes per step and per-rank KV."""
    p = DISTRIBUTED
    d = rec.load(p)
    rows = []
    for router, runs in d["runs"].items():
        for i, r in enumerate(runs):
            k = f"runs.{router}.{i}."
            rows.append(
                [
                    router,
                    str(r["world_size"]),
                    rec.fig("kib", at(p, k + "max_rank_kv_bytes")),
                    rec.fig("r3", at(p, k + "max_rank_kv_over_o_l_over_g")),
                    rec.fig("int", at(p, k + "partial_bytes_per_step")),
                    rec.fig("int", at(p, k + "partial_sent_bytes_per_step")),
                    rec.fig("mib", at(p, k + "allgather_kv_sent_bytes_per_step")),
                    rec.fig("sci", at(p, k + "max_abs_logit_diff_vs_first")),
                ]
            )
    header = ["router", "ranks G", "max rank KV KiB", "max rank KV / (KV of G = 1 / G)", "partial B per rank and step"]
    header += ["partials sent B per step", "all-gather of the KV instead, MiB per step", "max abs logit diff vs G = 1"]
    md, m = d["multi_device"], d["model"]
    return Body(
        measured=(
            f"expert-sharded KV over G gloo ranks on one machine: a {m['arch']} with {m['num_local_experts']} experts, "
            f"{m['num_hidden_layers']} layers, {m['num_attention_heads']} query / {m['num_key_value_heads']} KV heads "
            f"of dim {m['head_dim']}, {m['dtype']}, {d['num_shards']} shards, {d['context']}-token prompt then "
            f"{d['decode_steps']} decode steps; bytes handed to collectives per step and per-rank KV. Multi-device "
            f"path exercised: {md['exercised']} ({md['why']})"
        ),
        commands=[makefile_command(rec, p)],
        machine=machine_text(rec, p),
        reads=NA_READS,
        budget="none (exact attention, partials merged by log-sum-exp)",
        text=table(header, rows),
    )


SECTIONS = [
    Section("Exact cache vs DynamicCache", (CACHE_EXACT,), cache_exact),
    Section("Decode speed", DECODE_SPEED, decode_speed),
    Section("Decode regression", DECODE_REGRESSION, decode_regression),
    Section("Routing recall", (RECALL_GLOB,), routing_recall),
    Section("Routing quality on RULER needles", (QUALITY_GLOB,), routing_quality),
    Section("kvpress presses on RULER needles", (RULER_TABLE,), ruler_baseline),
    Section("Scheduling quality", (SCHEDULING_QUALITY_GLOB,), scheduling_quality),
    Section("KV bytes inside kvpress", (KVPRESS_BYTES,), kvpress_bytes),
    Section("Scheduling press bytes", (SCHEDULING_BYTES,), scheduling_bytes),
    Section("Compression memory", (COMPRESSION_MEMORY,), compression_memory),
    Section("Compression decode speed", (COMPRESSION_SPEED,), compression_speed),
    Section("Compression quality", (COMPRESSION_QUALITY_GLOB,), compression_quality),
    Section("Decode budget", (DECODE_BUDGET,), decode_budget),
    Section("Page store ragged budgets", (STORE_RAGGED,), store_ragged),
    Section("Prefill memory", (PREFILL_MEMORY,), prefill_memory),
    Section("Kernels", (KERNELS_GLOB,), kernels),
    Section("Distributed", (DISTRIBUTED,), distributed),
]

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


def headline_decode(rec: Recorder) -> tuple[str, str, str] | None:
    """Routed decode at the largest context (pages of 16)."""
    p = DECODE_SPEED[0]
    if not rec.exists(p):
        return None
    i = largest_context(rec, p)
    r = f"results.{i}."
    return (
        f"Routed decode vs Dynamic+SDPA, {rec.load(p)['results'][i]['context']} tokens",
        f"attention {rec.fig('x', at(p, r + 'ratios.attn_dynamic_over_routed'))}, decode step "
        f"{rec.fig('x', at(p, r + 'ratios.step_dynamic_over_routed'))} faster, reading "
        f"{rec.fig('r3', at(p, r + 'routed.routing.kv_read_vs_dense'))} of the KV",
        "Decode speed",
    )


def headline_quality(rec: Recorder) -> tuple[str, str, str] | None:
    """The setting that meets the quality goal at every length with the smallest read."""
    if not rec.glob(QUALITY_GLOB):
        return None
    points = quality_points(rec)
    refs = exact_refs(points)
    settings = goal_settings(rec, points, refs)
    if not settings:
        return None
    pts = min(settings, key=lambda q: max(rec.value(point_mean(p, "kv_read_vs_dense")) for p in q))
    return (
        f"Needle score of routed reads, {pts[0].label()}",
        setting_figures(rec, pts, refs),
        "Routing quality on RULER needles",
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


HEADLINE = [
    headline_exact,
    headline_decode,
    headline_quality,
    headline_scheduling,
    headline_kvpress,
    headline_compression,
]

# ------------------------------------------------------------------------------------------------------ assembly

HEADER = """# Results

<!-- generated by benchmarks/results_page.py; do not edit by hand -->

Generated by `benchmarks/results_page.py` from the JSON files under `benchmarks/results/` and `eval/results/`:
regenerate with `make results` (`python benchmarks/results_page.py`); `python benchmarks/results_page.py --check`
fails when this page is stale. Every figure is read from the JSON file its section names, and
`tests/test_results_page.py` recomputes each one from it. Sections whose JSON is not committed are left out.
"""


def render(section: Section, rec: Recorder) -> Rendered | None:
    """One section's Markdown, or None when none of its files exists."""
    if not any(rec.glob(pattern) for pattern in section.needs):
        return None
    rec.files = set()
    body = section.build(rec)
    commands = "\n".join(body.commands)
    markdown = (
        f"## {section.title}\n\n"
        f"- **Measured:** {body.measured}.\n"
        f"- **Machine and versions:** {body.machine}.\n"
        f"- **Quality reads:** {body.reads}.\n"
        f"- **Budget:** {body.budget}.\n"
        f"- **Command:**\n\n```\n{commands}\n```\n\n{body.text}\n"
    )
    return Rendered(section.title, markdown, body.commands, sorted(rec.files))


def headline_table(rec: Recorder) -> str:
    """README's headline table, each row linking to its section."""
    rows = [r for r in (h(rec) for h in HEADLINE) if r is not None]
    body = [[what, result, f"[{title}](docs/RESULTS.md#{slug(title)})"] for what, result, title in rows]
    return table(["result", "measured", "details"], body)


def build(root: Path = ROOT) -> Results:
    """Generate the page and the headline table from the JSON files under ``root``."""
    rec = Recorder(root)
    sections = [r for r in (render(s, rec) for s in SECTIONS) if r is not None]
    contents = "\n".join(f"- [{s.title}](#{slug(s.title)})" for s in sections)
    page = HEADER + "\n" + contents + "\n\n" + "\n".join(s.markdown for s in sections)
    page_figures = list(rec.figures)
    headline = headline_table(rec)
    return Results(page, headline, sections, page_figures, rec.figures[len(page_figures) :])


def with_headline(readme: str, headline: str) -> str:
    """README text with the headline table between the markers (unchanged when they are absent)."""
    if BEGIN not in readme or END not in readme:
        return readme
    head, rest = readme.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{headline}\n{END}{rest.split(END, 1)[1]}"


def main() -> None:
    """Write the page and README's table, or check them with ``--check``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/RESULTS.md or README.md is stale")
    args = parser.parse_args()
    results = build(ROOT)
    readme = (ROOT / README).read_text()
    targets = {ROOT / PAGE: results.page, ROOT / README: with_headline(readme, results.headline)}
    stale = [p for p, text in targets.items() if not p.is_file() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"{p.relative_to(ROOT)} is stale: run `make results`", file=sys.stderr)
        sys.exit(1 if stale else 0)
    for p in stale:
        p.write_text(targets[p])
        print(f"wrote {p.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
