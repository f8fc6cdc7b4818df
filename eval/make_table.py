"""Combine ``pikv-hf eval`` result directories into one results table (JSON + PNG + Markdown on stdout).

Usage (what ``make eval-table`` runs after the evaluations)::

    python eval/make_table.py eval/results/ruler2k_smollm2 eval/results/ruler2k_smollm2-moe \
        --json eval/results/ruler2k_table.json --png eval/results/ruler2k_table.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load_run(directory: Path) -> dict:
    """Read ``metrics.json`` of one run directory; raises if it is missing."""
    path = directory / "metrics.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `pikv-hf eval ... --out {directory}` first")
    return json.loads(path.read_text())


def build_table(runs: dict[str, dict]) -> dict:
    """One row per (model, press, ratio) with the mean score over all samples, per task (over every length, as the
    point's score) and per task and length."""
    rows = []
    for name, metrics in runs.items():
        per_task: dict[tuple, dict] = {}
        for entry in metrics["per_task"]:  # one entry per task and length
            cell = per_task.setdefault((entry["press"], entry["ratio"]), {}).setdefault(
                entry["task"], {"score": 0.0, "n": 0, "by_length": {}}
            )
            cell["by_length"][str(entry["length"])] = {"score": round(entry["score"], 2), "n": entry["n"]}
            cell["score"] += entry["score"] * entry["n"]
            cell["n"] += entry["n"]
        for cells in per_task.values():
            for cell in cells.values():
                cell["score"] = round(cell["score"] / max(cell["n"], 1), 2)
        for point in metrics["per_point"]:
            rows.append(
                {
                    "model": name,
                    "press": point["press"],
                    "ratio": point["ratio"],
                    "score": round(point["score"], 2),
                    "n": point["n"],
                    "per_task": per_task[(point["press"], point["ratio"])],
                }
            )
    first = next(iter(runs.values()))
    return {
        "description": "RULER-style offline suite (Paul Graham haystack), query-agnostic kvpress presses; score = "
        "mean string-match over all samples of the point, in %",
        "query_aware": False,
        "suite": first["suite"],
        "tasks": sorted({task for m in runs.values() for task in m["tasks"]}),
        "lengths": sorted({n for m in runs.values() for n in m["arguments"]["lengths"]}),
        "samples_per_task": first["arguments"]["samples"],
        "complete": all(m["complete"] for m in runs.values()),
        "runs": {
            name: {
                "model": m["arguments"]["model"],
                "model_info": m["model_info"],
                "command": m["command"],
                "complete": m["complete"],
                "n_rows": m["n_rows"],
                "mean_seconds_per_answer": m["mean_seconds_per_sample"],
                "git": m["git"],
                "versions": m["versions"],
            }
            for name, m in runs.items()
        },
        "rows": rows,
    }


def plot_table(table: dict, path: Path) -> None:
    """Score vs ratio per press, one panel per model, no compression as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(table["runs"])
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.0), sharey=True, squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rows = [r for r in table["rows"] if r["model"] == model]
        for press in sorted({r["press"] for r in rows}):
            pts = sorted((r["ratio"], r["score"]) for r in rows if r["press"] == press)
            if press == "none":
                ax.axhline(pts[0][1], color="black", linestyle="--", label="no compression")
            else:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=press)
        n = min(r["n"] for r in rows)
        ax.set_title(f"{model} (>= {n} samples per point)", fontsize=9)
        ax.set_xlabel("compression ratio (fraction of context KV evicted)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("needle score (%)")
    axes[0][0].set_ylim(-2, 102)
    axes[0][-1].legend(fontsize=8, loc="center right", framealpha=0.8)
    fig.suptitle(f"RULER-style {', '.join(table['tasks'])} at {table['lengths']} tokens, query-agnostic", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(table: dict) -> str:
    """The table as Markdown: one row per (model, press), one column per ratio."""
    ratios = sorted({r["ratio"] for r in table["rows"] if r["press"] != "none"})
    lines = ["| model | press | " + " | ".join(f"{r:g}" for r in ratios) + " |", "|---|---|" + "---|" * len(ratios)]
    for model in table["runs"]:
        rows = [r for r in table["rows"] if r["model"] == model]
        for press in sorted({r["press"] for r in rows}, key=lambda p: (p != "none", p)):
            cells = {r["ratio"]: f"{r['score']:.1f} (n={r['n']})" for r in rows if r["press"] == press}
            if press == "none":
                values = [cells[0.0]] * len(ratios)
            else:
                values = [cells.get(r, "-") for r in ratios]
            lines.append(f"| {model} | {press} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def run_names(directories: list[Path]) -> list[str]:
    """A run's name: its directory's name past the first ``_`` (``ruler2k_smollm2`` -> ``smollm2``), or the whole
    directory names when that would give two runs one name (the first was silently dropped)."""
    names = [d.name.split("_", 1)[-1] for d in directories]
    if len(set(names)) < len(names):
        names = [d.name for d in directories]
    if len(set(names)) < len(names):
        raise ValueError(f"runs must be distinct directories, got {[str(d) for d in directories]}")
    return names


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="result directories written by pikv-hf eval")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--png", type=Path, required=True)
    args = parser.parse_args(argv)
    table = build_table({name: load_run(d) for name, d in zip(run_names(args.runs), args.runs, strict=True)})
    args.json.write_text(json.dumps(table, indent=2) + "\n")
    plot_table(table, args.png)
    print(markdown(table))
    print(f"wrote {args.json} and {args.png} (complete={table['complete']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
