"""``eval/make_table.py`` (``make eval-table``): per-task cells of runs over several lengths, and run names."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("make_table", Path(__file__).parents[1] / "eval" / "make_table.py")
make_table = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(make_table)


def _metrics(scores: dict[int, list[float]]) -> dict:
    """A ``metrics.json`` of one point (``none``, ratio 0) and one task, per length the samples' scores."""
    per_task = [
        {"press": "none", "ratio": 0.0, "length": n, "task": "niah", "n": len(s), "score": sum(s) / len(s)}
        for n, s in scores.items()
    ]
    every = [x for s in scores.values() for x in s]
    return {
        "suite": "ruler", "tasks": ["niah"], "arguments": {"lengths": sorted(scores), "samples": 4, "model": "m"},
        "complete": True, "per_task": per_task,
        "per_point": [{"press": "none", "ratio": 0.0, "n": len(every), "score": sum(every) / len(every)}],
        "model_info": {}, "command": "", "n_rows": len(every), "mean_seconds_per_sample": 0.0, "git": "",
        "versions": {},
    }  # fmt: skip


def test_a_task_cell_pools_every_length_as_its_point_does():
    """Each length's entry overwrote the previous one: the cell showed the last length's score and n (25.0, n=4)
    beside a point of 62.5 over 8 samples."""
    table = make_table.build_table({"m": _metrics({2048: [100.0] * 4, 4096: [100.0, 0.0, 0.0, 0.0]})})
    (row,) = table["rows"]
    cell = row["per_task"]["niah"]
    assert (row["score"], row["n"]) == (cell["score"], cell["n"]) == (62.5, 8)
    assert cell["by_length"] == {"2048": {"score": 100.0, "n": 4}, "4096": {"score": 25.0, "n": 4}}


def test_runs_whose_short_names_collide_keep_their_directory_names(tmp_path):
    """``ruler2k_smollm2`` and ``ruler4k_smollm2`` were both named ``smollm2``: the first run was dropped."""
    dirs = []
    for name, length in (("ruler2k_smollm2", 2048), ("ruler4k_smollm2", 4096)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(json.dumps(_metrics({length: [100.0]})))
        dirs.append(tmp_path / name)
    assert make_table.run_names([dirs[0]]) == ["smollm2"]
    out = tmp_path / "t.json"
    make_table.main([*map(str, dirs), "--json", str(out), "--png", str(tmp_path / "t.png")])
    table = json.loads(out.read_text())
    assert list(table["runs"]) == ["ruler2k_smollm2", "ruler4k_smollm2"] and table["lengths"] == [2048, 4096]
    with pytest.raises(ValueError, match="runs must be distinct directories"):
        make_table.run_names([dirs[0], dirs[0]])
