"""Decode speed of the working tree against an earlier revision, measured side by side in one run.

Checks out ``--base`` into a temporary git worktree, then runs ``benchmarks/bench_decode.py`` of each tree (each
importing its own ``src/``) alternately for ``--rounds`` rounds, so both see the same machine state, and reports
per context and mode the median over rounds of the single-layer attention time and of the whole decode step, with
the ratio new / base. A tree whose benchmark has no ``--page-size`` option reads pages of 16: it is run without the
option at that size and refused at any other (before anything runs).

    python benchmarks/compare_revisions.py --base 1044216 --contexts 8192 16384 32768 --rounds 3 \
        --out benchmarks/results/decode_regression_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_cache import positive, run_metadata, write_result

ROOT = Path(__file__).resolve().parents[1]
MODES = ("dynamic", "exact", "routed")


def page_size_option(tree: Path, page_size: int) -> list[str]:
    """``--page-size`` for the tree's ``bench_decode.py``: nothing where it has no such option (pages of 16: it failed
    with "unrecognized arguments" even at that size), an error for another size."""
    if "--page-size" in (tree / "benchmarks" / "bench_decode.py").read_text():
        return ["--page-size", str(page_size)]
    if page_size != 16:
        raise SystemExit(f"compare_revisions.py: error: --page-size {page_size}: {tree.name} reads pages of 16 only")
    return []


def run_tree(tree: Path, args: argparse.Namespace, out: Path) -> dict:
    cmd = [
        sys.executable,
        str(tree / "benchmarks" / "bench_decode.py"),
        "--contexts",
        *map(str, args.contexts),
        "--steps",
        str(args.steps),
        "--repeats",
        str(args.repeats),
        "--threads",
        str(args.threads),
        *page_size_option(tree, args.page_size),
        "--out",
        str(out),
    ]
    env = {"PYTHONPATH": str(tree / "src"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": str(args.threads)}
    subprocess.run(cmd, check=True, cwd=tree, env=env, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--contexts", type=positive, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--rounds", type=positive, default=3)
    parser.add_argument("--steps", type=positive, default=5)
    parser.add_argument("--repeats", type=positive, default=15)
    parser.add_argument("--threads", type=positive, default=1)
    parser.add_argument("--page-size", type=positive, default=16)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_regression_cpu.json"))
    args = parser.parse_args()
    base_rev = subprocess.run(
        ["git", "rev-parse", "--short", args.base], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    runs: dict[str, list[dict]] = {"base": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(base_tree), base_rev], cwd=ROOT, check=True)
        try:
            page_size_option(base_tree, args.page_size)  # a size the base cannot run: refused before any run
            for r in range(args.rounds):
                for name, tree in (("base", base_tree), ("new", ROOT)):
                    runs[name].append(run_tree(tree, args, Path(tmp) / f"{name}{r}.json"))
                    print(f"round {r + 1}/{args.rounds}: {name} done", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=True)
    rows = []
    for i, context in enumerate(args.contexts):
        row: dict = {"context": context}
        for mode in MODES:
            for metric in ("attn_ms", "step_ms"):
                base = statistics.median(run["results"][i][mode][metric] for run in runs["base"])
                new = statistics.median(run["results"][i][mode][metric] for run in runs["new"])
                row[f"{mode}_{metric}"] = {"base": base, "new": new, "new_over_base": new / base}
        rows.append(row)
        print(
            f"ctx {context}: "
            + " | ".join(
                f"{m} attn {row[f'{m}_attn_ms']['base']:.2f} -> {row[f'{m}_attn_ms']['new']:.2f} ms "
                f"(x{row[f'{m}_attn_ms']['new_over_base']:.2f})"
                for m in MODES
            )
        )
    result = {
        "benchmark": "compare_revisions",
        "command": f"python benchmarks/compare_revisions.py --base {args.base} --contexts "
        f"{' '.join(map(str, args.contexts))} --rounds {args.rounds} --steps {args.steps} --repeats {args.repeats} "
        f"--threads {args.threads} --page-size {args.page_size} --out {args.out}",
        "base_revision": base_rev,
        **run_metadata(args.threads),
        "note": "medians over rounds of bench_decode's medians; the two trees ran alternately in one run",
        "target": "exact and routed attn_ms new_over_base <= 1.05",
        "results": rows,
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
