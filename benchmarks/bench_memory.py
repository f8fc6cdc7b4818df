"""Peak resident memory of a long prefill on the real SmolLM2: every way of keeping the KV against DynamicCache.

The ways are ``bench_e2e.MODES`` (DynamicCache, exact, the routed README setting of 256 key-cluster shards of pages
of one token, routed 1/8, Quest 1/8, QuantPress 4-bit pages of 64, Quest + 4-bit, H2O + offload + routed). Each way
runs in its own fresh process: import, read the resident size (``baseline``: interpreter and libraries), load the
offline SmolLM2-135M-Instruct (fp32), build the cache and enter the way's presses, reset the kernel's peak-RSS
counter (``/proc/self/clear_refs``), prefill ``--batch`` rows of ``--context`` tokens (``logits_to_keep=1``, as
``generate`` does) and read the peak (``VmHWM``). The child runs with ``MALLOC_MMAP_THRESHOLD_=1048576``: glibc
then returns every freed temporary of a megabyte or more to the kernel at once, so the peak is the live memory (with
the default dynamic threshold freed multi-megabyte blocks stay in the heap and the peak counts them too).

Reported per way: the peak over the baseline (model weights + KV + the prefill's temporaries: what a GPU's
``max_memory_allocated`` counts) and its ratio to DynamicCache's, the growth during the prefill itself, and the
KV (and metadata) bytes the cache holds after it. Target: every way's peak over the baseline <= 1.10x DynamicCache's.

    python benchmarks/bench_memory.py --context 8192 --batch 4 --out benchmarks/results/prefill_memory_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

from bench_cache import positive

TARGET = 1.10


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure(args: argparse.Namespace) -> dict:
    """One prefill of one way in this process (the child)."""
    import torch

    torch.set_num_threads(args.threads)
    from bench_e2e import MODES, kv_bytes

    from pikv_hf import PiKVCache
    from pikv_hf.models import load_smollm2

    baseline = status_kib("VmRSS") * 1024
    model, _ = load_smollm2()
    model.eval()
    model_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    ids = torch.randint(100, 40000, (args.batch, args.context), generator=torch.Generator().manual_seed(0))
    mode = MODES[args.way]
    cache = mode.build(model)
    with torch.no_grad(), contextlib.ExitStack() as stack:
        for press in mode.presses():
            stack.enter_context(press(model))
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
        before = status_kib("VmRSS") * 1024
        model(ids, past_key_values=cache, logits_to_keep=1)
        peak = status_kib("VmHWM") * 1024
    after = status_kib("VmRSS") * 1024
    kv, offloaded = kv_bytes(cache)
    return {
        "way": args.way,
        "baseline_rss_bytes": baseline,
        "model_bytes": model_bytes,
        "rss_before_prefill_bytes": before,
        "peak_rss_bytes": peak,
        "rss_after_prefill_bytes": after,
        "peak_over_baseline_bytes": peak - baseline,
        "prefill_growth_bytes": peak - before,
        "kv_bytes": kv,
        "offloaded_bytes": offloaded,
        "meta_bytes": cache.meta_nbytes() if isinstance(cache, PiKVCache) else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=positive, default=8192)
    parser.add_argument("--batch", type=positive, default=4)
    parser.add_argument("--threads", type=positive, default=1)
    parser.add_argument("--ways", nargs="+", default=None, help="default: every way of bench_e2e.MODES")
    parser.add_argument("--way", default=None, help="(internal) run one way in this process")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/prefill_memory_cpu.json"))
    args = parser.parse_args()
    if args.way is not None:
        print(json.dumps(measure(args)))
        return
    from bench_cache import run_metadata, write_result
    from bench_e2e import MODES

    from pikv_hf.eval.results import git_commit

    ways = args.ways or list(MODES)
    if ways[0] != "dynamic":
        ways = ["dynamic", *(w for w in ways if w != "dynamic")]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    rows = []
    for way in ways:
        cmd = [sys.executable, __file__, "--context", str(args.context), "--batch", str(args.batch)]
        cmd += ["--threads", str(args.threads), "--way", way]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        row = json.loads(out.strip().splitlines()[-1])
        row["peak_over_dynamic"] = row["peak_over_baseline_bytes"] / rows[0]["peak_over_baseline_bytes"] if rows else 1
        rows.append(row)
        print(
            f"{way}: peak - baseline {row['peak_over_baseline_bytes'] / 2**20:.0f} MiB "
            f"({row['peak_over_dynamic']:.3f}x DynamicCache), prefill growth {row['prefill_growth_bytes'] / 2**20:.0f}"
            f" MiB, KV {row['kv_bytes'] / 2**20:.0f} MiB, metadata {row['meta_bytes'] / 2**20:.0f} MiB",
            flush=True,
        )
    result = {
        "benchmark": "bench_memory",
        "command": f"python benchmarks/bench_memory.py --context {args.context} --batch {args.batch} "
        f"--threads {args.threads} --out {args.out}",
        "commit": git_commit(),
        **run_metadata(args.threads),
        "config": {"model": "SmolLM2-135M-Instruct (fp32)", "context": args.context, "batch": args.batch},
        "target": f"every way's (peak - baseline) <= {TARGET} x DynamicCache's (MALLOC_MMAP_THRESHOLD_: live memory)",
        "target_max": TARGET,
        "results": rows,
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
