"""PiKVCache (exact mode) vs DynamicCache + SDPA: prefill time, per-token decode time and allocated KV bytes.

Realistic attention sizes on a small model (weights random, sizes are what matter): 32 query heads, 4 KV heads,
head_dim 128, 4 layers, fp32. Both caches run side by side in one process on models with identical weights; ratios
come from the same run. The decode step is also compared with its memory-bandwidth bound: the bytes of K and V the
step must read, divided by the read bandwidth measured here with the same thread count.

    python benchmarks/bench_cache.py --contexts 1024 4096 16384 --out benchmarks/results/cache_exact_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache

import pikv_hf
from pikv_hf import PiKVCache
from pikv_hf.tiny import tiny_model

CONFIG = dict(
    hidden_size=1024,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=1024,
    max_position_embeddings=65536,
)


def _at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
    return value


def positive(text: str) -> int:
    """An ``argparse`` type: an integer >= 1 (a count, size or length), else the option's one error line."""
    return _at_least(text, 1)


def non_negative(text: str) -> int:
    """An ``argparse`` type: an integer >= 0 (sinks, leading layers), else the option's one error line."""
    return _at_least(text, 0)


def read_bandwidth_gbs(n_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Best-of-``repeats`` read bandwidth of a large fp32 reduction, in GB/s."""
    x = torch.ones(n_bytes // 4)
    x.sum()
    best = min(_timed(x.sum) for _ in range(repeats))
    return n_bytes / best / 1e9


def matmul_gflops(n: int = 2048, repeats: int = 3) -> float:
    """Best-of-``repeats`` fp32 throughput of an ``n x n x n`` matmul, in GFLOP/s (the compute roof)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def run_metadata(threads: int, bandwidth_gbs: float | None = None, matmul_gflops: float | None = None) -> dict:
    """The ``machine`` and ``versions`` entries every benchmark JSON carries (bandwidth and FLOP rate when measured)."""
    machine = {"device": "cpu", "processor": platform.processor() or platform.machine(), "threads": threads}
    if bandwidth_gbs is not None:
        machine["read_bandwidth_gbs"] = bandwidth_gbs
    if matmul_gflops is not None:
        machine["matmul_gflops"] = matmul_gflops
    return {
        "machine": machine,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "pikv_hf": pikv_hf.__version__,
        },
    }


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def write_result(out: Path, result: dict) -> None:
    """Write a benchmark's result JSON (creating its folder) and say where."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_cache(model, ids: torch.Tensor, make_cache, steps: int) -> dict:
    cache = make_cache()
    with torch.no_grad():
        t0 = time.perf_counter()
        logits = model(ids, past_key_values=cache, logits_to_keep=1).logits
        prefill = time.perf_counter() - t0
        token = logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            logits = model(token, past_key_values=cache).logits
            times.append(time.perf_counter() - t0)
            token = logits[:, -1:].argmax(-1)
    if isinstance(cache, PiKVCache):
        kv = cache.kv_nbytes()
        meta = cache.meta_nbytes()
    else:
        kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        meta = 0
    return {
        "prefill_s": prefill,
        "decode_ms_median": statistics.median(times) * 1e3,
        "decode_ms_all": [t * 1e3 for t in times],
        "kv_bytes": kv,
        "meta_bytes": meta,
        "tokens": cache.get_seq_length(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=positive, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--steps", type=positive, default=16, help="decode steps timed per context")
    parser.add_argument("--threads", type=positive, default=torch.get_num_threads())
    parser.add_argument("--router", default="round_robin")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cache_exact_cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    ref = tiny_model("llama", seed=0, **CONFIG)
    model = tiny_model("llama", seed=0, **CONFIG)
    bandwidth = read_bandwidth_gbs()
    print(f"threads {args.threads}, measured read bandwidth {bandwidth:.1f} GB/s")
    warm = torch.randint(3, CONFIG["vocab_size"], (1, 64))
    run_cache(ref, warm, DynamicCache, 2)
    run_cache(model, warm, lambda: PiKVCache(model, router=args.router), 2)

    rows = []
    for ctx in args.contexts:
        ids = torch.randint(3, CONFIG["vocab_size"], (1, ctx), generator=torch.Generator().manual_seed(ctx))
        dyn = run_cache(ref, ids, DynamicCache, args.steps)
        pik = run_cache(model, ids, lambda: PiKVCache(model, router=args.router), args.steps)
        bound_ms = dyn["kv_bytes"] / (bandwidth * 1e9) * 1e3  # K and V of every layer read once per step
        row = {
            "context": ctx,
            "dynamic": dyn,
            "pikv": pik,
            "decode_ratio_pikv_over_dynamic": pik["decode_ms_median"] / dyn["decode_ms_median"],
            "prefill_ratio_pikv_over_dynamic": pik["prefill_s"] / dyn["prefill_s"],
            "kv_bytes_ratio_pikv_over_dynamic": pik["kv_bytes"] / dyn["kv_bytes"],
            "total_bytes_ratio_pikv_over_dynamic": (pik["kv_bytes"] + pik["meta_bytes"]) / dyn["kv_bytes"],
            "kv_read_bound_ms": bound_ms,
            "pikv_decode_over_bound": pik["decode_ms_median"] / bound_ms,
            "dynamic_decode_over_bound": dyn["decode_ms_median"] / bound_ms,
        }
        rows.append(row)
        print(
            f"ctx {ctx:>6}: prefill dyn {dyn['prefill_s']:.2f}s pikv {pik['prefill_s']:.2f}s | decode/token "
            f"dyn {dyn['decode_ms_median']:.1f}ms pikv {pik['decode_ms_median']:.1f}ms "
            f"(x{row['decode_ratio_pikv_over_dynamic']:.2f}; KV-read bound {bound_ms:.1f}ms) | KV bytes "
            f"dyn {dyn['kv_bytes'] / 2**20:.1f}MiB pikv {pik['kv_bytes'] / 2**20:.1f}MiB "
            f"(x{row['kv_bytes_ratio_pikv_over_dynamic']:.3f}; +{pik['meta_bytes'] / 2**20:.2f}MiB metadata)"
        )

    result = {
        "benchmark": "bench_cache",
        "command": "python benchmarks/bench_cache.py "
        + " ".join(
            [
                f"--contexts {' '.join(map(str, args.contexts))}",
                f"--steps {args.steps}",
                f"--threads {args.threads}",
                f"--router {args.router}",
                f"--out {args.out}",
            ]
        ),
        **run_metadata(args.threads, bandwidth),
        "config": {**CONFIG, "dtype": "float32", "batch": 1, "router": args.router, "page_size": 16},
        "targets": {"decode_ratio_max": 1.5, "kv_bytes_ratio_max": 1.05},
        "results": rows,
    }
    write_result(args.out, result)
    _plot(rows, args.out.with_suffix(".png"))


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctx = [r["context"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(ctx, [r["dynamic"]["decode_ms_median"] for r in rows], "o-", label="DynamicCache + SDPA")
    a.plot(ctx, [r["pikv"]["decode_ms_median"] for r in rows], "s-", label="PiKVCache (exact)")
    a.plot(ctx, [r["kv_read_bound_ms"] for r in rows], "k--", label="KV-read bandwidth bound")
    a.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="decode ms / token", title="decode step")
    a.legend()
    b.plot(ctx, [r["dynamic"]["kv_bytes"] / 2**20 for r in rows], "o-", label="DynamicCache")
    b.plot(ctx, [r["pikv"]["kv_bytes"] / 2**20 for r in rows], "s-", label="PiKVCache K+V")
    b.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="MiB", title="allocated KV bytes")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
