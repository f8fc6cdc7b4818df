"""Routing: attention recall of routed reads, and needle scores of routed and Quest reads against exact attention
(with the README headline row of the setting that meets the quality goal)."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from .framework import (
    BENCH,
    EVAL,
    MAX_LABELS,
    Body,
    Recorder,
    Source,
    agg,
    at,
    machine_text,
    row,
    run_command,
    table,
    versions_text,
)

# Goals quoted from README.md (routing issue): recall >= 0.95 and needle score >= 98% of exact, reading <= 25% of the
# KV a dense cache would read.
RECALL_GOAL, SCORE_GOAL, READ_GOAL = 0.95, 0.98, 0.25
# Defaults of `pikv-hf eval` (EvalConfig / PiKVCache) for arguments that older metrics.json files do not record.
EVAL_DEFAULTS = {"num_shards": 8, "page_size": 16, "dense_layers": 0, "mass_target": None}


def run_arguments(m: dict) -> dict:
    """A run's ``pikv-hf eval`` arguments, the read settings that newer runs nest under ``read`` flattened in."""
    a = dict(m["arguments"])
    return {**(a.pop("read", None) or {}), **a}


def frac(x: float) -> str:
    """A share such as 0.1875 as ``3/16``."""
    return str(Fraction(x).limit_denominator(256))


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
        a = {**EVAL_DEFAULTS, **{k: v for k, v in run_arguments(m).items() if v is not None}}
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
    sinks = sorted({(run_arguments(m)["n_sink"], run_arguments(m)["window"]) for m in metrics})
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


# ---------------------------------------------------------------------------------------------------- headline


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
