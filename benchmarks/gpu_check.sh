#!/usr/bin/env bash
# One GPU session in one command (make gpu-check): the kernel tests on CUDA, benchmarks/kernels.py and
# benchmarks/bench_gpu.py, each under its own time limit so that a slow stage cannot starve the next: about 10 minutes
# (the sm_90 compile tests need no GPU and are left to make test). Uses the machine's own torch and triton; WHEELS
# names a folder holding the other pins (pip install --no-deps --target DIR <wheels>, as the README's GPU section
# says). Logs go to LOGS (default benchmarks/results/gpu_logs), JSON to RESULTS (default benchmarks/results; on a lent
# machine both may name the folder that comes back, e.g. LOGS=$OUT RESULTS=$OUT). The stages fit one
# 600 s device command with the wheels installed: bench_gpu gives the eager section ~155 s (on an H100 the
# Llama shape at batch 1 took ~85 s for its 8 ways, batch 8 ~10 s a way), the compiled one ~135 s, generate 30 s.
set -u
: "${GPU_TESTS:?the kernel test files: run this through make gpu-check}"
LOGS=${LOGS:-benchmarks/results/gpu_logs}
RESULTS=${RESULTS:-benchmarks/results}
TESTS_S=${TESTS_S:-90}
KERNELS_S=${KERNELS_S:-130}
BENCH_S=${BENCH_S:-360}
export PYTHONPATH=src${WHEELS:+:$WHEELS}${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$LOGS" "$RESULTS"
GIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
export PIKV_GIT=${PIKV_GIT:-$GIT}
GPU=$(python3 -c "import torch; print(torch.cuda.get_device_name().lower().replace(' ', '_'))")
nvidia-smi >"$LOGS/nvidia_smi_${GPU}.txt" 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"

XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
echo "== kernel tests on CUDA (${TESTS_S} s)"
# SIGINT at the limit: pytest stops its xdist workers and prints its summary (a SIGTERM left the workers loading the
# host while the benchmarks below ran: an H100 run's eager timings were spoiled so)
timeout -s INT -k 15 "$TESTS_S" python3 -m pytest -v -p no:cacheprovider $XDIST -k "not sm90" $GPU_TESTS >"$LOGS/pytest_cuda_${GPU}_${GIT}.txt" 2>&1
echo "pytest rc $?"
pkill -9 -f "exec.eval.sys.stdin.readline" 2>/dev/null  # xdist workers still alive, if any
grep -E "FAILED|ERROR|passed|failed" "$LOGS/pytest_cuda_${GPU}_${GIT}.txt" | tail -15

echo "== benchmarks/kernels.py (${KERNELS_S} s)"
timeout "$KERNELS_S" python3 benchmarks/kernels.py --out "$RESULTS/kernels_${GPU}.json" ${KERNELS_ARGS:-} 2>&1 |
  tee "$LOGS/kernels_${GPU}_${GIT}.txt"

echo "== benchmarks/bench_gpu.py (${BENCH_S} s)"
timeout "$BENCH_S" python3 benchmarks/bench_gpu.py --out "$RESULTS/gpu_${GPU}.json" \
  ${BENCH_GPU_ARGS:---budget-s 320 --reserve-compiled 135 --reserve-generate 30} 2>&1 | tee "$LOGS/bench_gpu_${GPU}_${GIT}.txt"
echo "bench_gpu rc ${PIPESTATUS[0]}"
