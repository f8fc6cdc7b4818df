"""What every section of ``docs/RESULTS.md`` is built with: reading the committed JSON, recording each figure's
provenance, and the Markdown pieces (tables, verdicts, machine lines, images).

Every figure on the page goes through :meth:`Recorder.fig`, which reads it from a JSON file (a key path, one row
picked by its fields, or an aggregate over rows), formats it with a named formatter and records where it came
from, so ``tests/test_results_page.py`` can recompute each one. A section is a :class:`Section`: a title, the files
it needs, and a builder ``def my_section(rec: Recorder) -> Body``; ``benchmarks/results_page.py`` lists them in page
order.
"""

from __future__ import annotations

import json
import posixpath
import re
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAGE = "docs/RESULTS.md"
BENCH = "benchmarks/results"
EVAL = "eval/results"
MIB = 2**20
MAX_LABELS = 5  # longer lists of needles are shown as a count
NUMERIC = re.compile(r"^[-0-9.,/ ()x%e+]*$")  # cells of right-aligned columns
NEUTRAL = {"", "-", "all", "n/a", "not recorded"}  # cells that do not decide a column's alignment
NA_READS = "not applicable (no answer quality measured)"


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
    "gib": lambda v: f"{v / 2**30:.1f}",
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
    "sum_ratio": lambda v: sum(v[:-1]) / v[-1],  # parts over a whole
    "rest_ratio": lambda v: (v[0] - sum(v[1:-1])) / v[-1],  # a part less the parts counted apart, over a whole
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

    def image(self, path: str, alt: str) -> str:
        """Markdown embedding the committed image ``path`` (relative to the root, e.g. a plot beside its JSON) with
        a link relative to the page; the file is recorded with those the section reads."""
        if not self.exists(path):
            raise FileNotFoundError(self.root / path)
        self.files.add(path)
        return f"![{alt}]({posixpath.relpath(path, posixpath.dirname(PAGE))})"


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


# ----------------------------------------------------------------------------------------------------------- helpers


def table(header: list[str], rows: Iterable[list[str]]) -> str:
    """A Markdown table; columns whose cells are all numeric are right-aligned."""
    rows = list(rows)
    numeric = [i > 0 and all(r[i] in NEUTRAL or NUMERIC.match(r[i]) for r in rows) for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "".join(" ---: |" if n else " --- |" for n in numeric)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def against(value: float, bound: float) -> str:
    """The format of a ratio shown beside its upper ``bound``: two decimals, three where two would hide which side of
    the bound it lies on (0.754 read "0.75" beside "not met" for a bound of 0.75)."""
    return "r2" if (round(value, 2) <= bound) == (value <= bound) else "r3"


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


def out_dir(command: str) -> str:
    """The ``--out`` directory of an eval command."""
    return re.search(r"--out (\S+)", command).group(1)


def run_command(run: str, metrics: dict) -> str:
    """An eval run's command after a comment with its directory, git commit and where its output was written."""
    git = f"git {metrics['git']['commit'][:7]}{' (dirty)' if metrics['git']['dirty'] else ''}"
    out = out_dir(metrics["command"])
    moved = f", written to {out} and copied here" if out != run else ""
    return f"# {Path(run).name}: {git}{moved}\n{metrics['command']}"
