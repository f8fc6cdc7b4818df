"""Peak resident memory of a long prefill: PiKVCache (many shards) vs DynamicCache, on the real SmolLM2.

Each cache runs in its own fresh process: import, load the offline SmolLM2-135M-Instruct (fp32), reset the kernel's
peak-RSS counter (``/proc/self/clear_refs``), prefill ``--context`` tokens (``logits_to_keep=1``, as ``generate``
does) and read the peak (``VmHWM``). Reported: the peak, the process's resident size before the model was loaded
(interpreter and libraries), the model's parameter bytes, the cache's allocated KV (and metadata) bytes, the
resident size after the prefill, and ``(peak - baseline) / (KV + model)``.

Each cache is measured twice: with glibc's default allocator settings, whose dynamic mmap threshold keeps freed
multi-megabyte temporaries (a layer's activations at 8k tokens) in the heap, so the peak counts freed memory too;
and with ``MALLOC_MMAP_THRESHOLD_=1048576``, where such temporaries are returned to the kernel when freed and the
peak is the live memory. The target is judged on the second.

    python benchmarks/bench_memory.py --context 8192 --shards 256 --page-size 1 \
        --out benchmarks/results/prefill_memory_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure(args: argparse.Namespace) -> dict:
    """One prefill in this process (the child)."""
    import torch

    torch.set_num_threads(args.threads)
    from transformers import DynamicCache

    from pikv_hf import PiKVCache
    from pikv_hf.models import load_smollm2

    baseline = status_kib("VmRSS") * 1024
    model, _ = load_smollm2()
    model.eval()
    model_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    ids = torch.randint(100, 40000, (1, args.context), generator=torch.Generator().manual_seed(0))
    if args.cache == "pikv":
        cache = PiKVCache(model, router=args.router, num_shards=args.shards, page_size=args.page_size)
    else:
        cache = DynamicCache()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
    before = status_kib("VmRSS") * 1024
    with torch.no_grad():
        model(ids, past_key_values=cache, logits_to_keep=1)
    peak = status_kib("VmHWM") * 1024
    after = status_kib("VmRSS") * 1024
    if args.cache == "pikv":
        kv, meta = cache.kv_nbytes(), cache.meta_nbytes()
    else:
        kv, meta = sum(la.keys.nbytes + la.values.nbytes for la in cache.layers), 0
    return {
        "cache": args.cache,
        "baseline_rss_bytes": baseline,
        "model_bytes": model_bytes,
        "rss_before_prefill_bytes": before,
        "peak_rss_bytes": peak,
        "rss_after_prefill_bytes": after,
        "kv_bytes": kv,
        "meta_bytes": meta,
        "peak_over_kv_plus_model": (peak - baseline) / (kv + model_bytes),
        "peak_over_kv_meta_plus_model": (peak - baseline) / (kv + meta + model_bytes),
        "prefill_growth_over_kv": (peak - before) / kv,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--shards", type=int, default=256)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--router", default="key_cluster")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", default=None, help="(internal) run one cache in this process")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/prefill_memory_cpu.json"))
    args = parser.parse_args()
    if args.cache is not None:
        print(json.dumps(measure(args)))
        return
    from bench_cache import run_metadata, write_result

    rows = []
    for malloc in ("default", "mmap_threshold_1MiB"):
        env = dict(os.environ)
        if malloc != "default":
            env["MALLOC_MMAP_THRESHOLD_"] = str(2**20)
        for cache in ("dynamic", "pikv"):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--cache", cache]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
            row = {"malloc": malloc, **json.loads(out.strip().splitlines()[-1])}
            rows.append(row)
            print(
                f"{malloc} {cache}: peak {row['peak_rss_bytes'] / 2**20:.0f} MiB "
                f"(baseline {row['baseline_rss_bytes'] / 2**20:.0f}, "
                f"model {row['model_bytes'] / 2**20:.0f}, KV {row['kv_bytes'] / 2**20:.0f}, meta "
                f"{row['meta_bytes'] / 2**20:.0f}) -> (peak - baseline) / (KV + model) = "
                f"{row['peak_over_kv_plus_model']:.3f}; after prefill {row['rss_after_prefill_bytes'] / 2**20:.0f} MiB",
                flush=True,
            )
    result = {
        "benchmark": "bench_memory",
        "command": f"python benchmarks/bench_memory.py --context {args.context} --shards {args.shards} "
        f"--page-size {args.page_size} --router {args.router} --threads {args.threads} --out {args.out}",
        **run_metadata(args.threads),
        "config": {
            "model": "SmolLM2-135M-Instruct (fp32)",
            "context": args.context,
            "shards": args.shards,
            "page_size": args.page_size,
            "router": args.router,
        },  # fmt: skip
        "target": "pikv (peak - baseline) / (KV + model) <= 1.3 with MALLOC_MMAP_THRESHOLD_ (live memory)",
        "results": rows,
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
