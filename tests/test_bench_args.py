"""Benchmark scripts answer bad sizes with argparse's error line before any work, and compare_revisions runs a base
revision whose decode benchmark has no ``--page-size`` option."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "benchmarks"))


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("bench_memory.py", ["--context", "0"], "argument --context: must be an integer >= 1, got '0'"),
        ("bench_memory.py", ["--batch", "0"], "argument --batch: must be an integer >= 1, got '0'"),
        ("routing_recall.py", ["--length", "0"], "argument --length: must be an integer >= 1, got '0'"),
        ("routing_recall.py", ["--n-sink", "-1"], "argument --n-sink: must be an integer >= 0, got '-1'"),
    ],
)
def test_zero_sizes_are_refused_before_any_work(script, args, message):
    """They loaded the model and failed with "cannot reshape tensor of 0 elements" (bench_memory: inside its child)."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 2 and message in out.stderr.splitlines()[-1]


def test_a_base_revision_without_the_page_size_option_runs_at_pages_of_16(tmp_path):
    """compare_revisions passed --page-size to every tree: a base from before the option failed with "unrecognized
    arguments" even at the default size; another size is refused before anything runs."""
    compare = importlib.import_module("compare_revisions")
    (tmp_path / "old" / "benchmarks").mkdir(parents=True)
    (tmp_path / "old" / "benchmarks" / "bench_decode.py").write_text("parser.add_argument('--steps')\n")
    assert compare.page_size_option(tmp_path / "old", 16) == []
    assert compare.page_size_option(ROOT, 4) == ["--page-size", "4"]
    with pytest.raises(SystemExit, match="--page-size 4: old reads pages of 16 only"):
        compare.page_size_option(tmp_path / "old", 4)
