"""``benchmarks/gpu_check.sh`` (``make gpu-check``), the one command a lent GPU machine runs: its stages called as
documented, with ``python3`` and ``pkill`` replaced by stubs that record their arguments (no GPU, nothing run)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUB = """#!/bin/sh
echo "$(basename "$0") $*" >> "$STUB_LOG"
if [ "$1" = "-c" ]; then echo stub_gpu; fi
exit 0
"""


def test_stages_write_their_json_and_logs_where_told(tmp_path):
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name in ("python3", "pkill", "nvidia-smi"):
        (stubs / name).write_text(STUB)
        (stubs / name).chmod(0o755)
    log = tmp_path / "calls.txt"
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "STUB_LOG": str(log),
           "GPU_TESTS": "tests/test_kernels.py", "LOGS": str(tmp_path / "logs"), "RESULTS": str(tmp_path / "res"),
           "TESTS_S": "20", "KERNELS_S": "20", "BENCH_S": "20"}  # fmt: skip
    env.pop("BENCH_GPU_ARGS", None)
    env.pop("KERNELS_ARGS", None)
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    res = tmp_path / "res"
    assert any(c.startswith("python3 -m pytest") and "tests/test_kernels.py" in c and "-n 8" in c for c in calls)
    assert f"python3 benchmarks/kernels.py --out {res}/kernels_stub_gpu.json" in calls
    bench = f"python3 benchmarks/bench_gpu.py --out {res}/gpu_stub_gpu.json --budget-s 320 --reserve-compiled 135"
    assert any(c.startswith(bench) for c in calls), calls
    assert any(c.startswith("pkill") for c in calls)  # the stub, not the real one: xdist workers here live on
    logs = {p.name for p in (tmp_path / "logs").iterdir()}
    assert {"nvidia_smi_stub_gpu.txt", "pytest_cuda_stub_gpu_" + _git() + ".txt"} <= logs
    assert any(n.startswith("kernels_stub_gpu_") for n in logs)
    assert any(n.startswith("bench_gpu_stub_gpu_") for n in logs)


def _git() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"
