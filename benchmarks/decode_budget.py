"""A fixed decode-time budget over thousands of steps: resident KV bytes and time per step, on SmolLM2.

``model.generate`` writes ``--steps`` tokens after a short prompt into a ``PiKVCache(track_stats=True)`` held to
``--budget`` tokens per (row, KV head) by ``DecodingBudgetPress(H2OPress(), target_size=budget)``. Every ``--every``
steps the run logs the cache's allocated KV bytes (``kv_nbytes()``, measured on the tensors) against the bound
``budget + one page per (row, KV head, shard)`` (per layer, in bytes), and the median time of the last steps.

    python benchmarks/decode_budget.py --budget 1024 --steps 8192 --out benchmarks/results/decode_budget_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from bench_cache import positive, run_metadata, write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=positive, default=1024)
    parser.add_argument("--steps", type=positive, default=8192)
    parser.add_argument("--every", type=positive, default=500)
    parser.add_argument("--page-size", type=positive, default=16)
    parser.add_argument("--threads", type=positive, default=1)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_budget_cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from pikv_hf import PiKVCache
    from pikv_hf.eval.haystack import essay_sentences
    from pikv_hf.models import load_smollm2
    from pikv_hf.presses import DecodingBudgetPress, H2OPress

    model, tok = load_smollm2()
    ids = tok(" ".join(essay_sentences()[:20]), return_tensors="pt").input_ids[:, :256]
    cache = PiKVCache(model, page_size=args.page_size, track_stats=True)
    press = DecodingBudgetPress(H2OPress(), target_size=args.budget)
    text = model.config.get_text_config()
    heads, dim = text.num_key_value_heads, text.head_dim if hasattr(text, "head_dim") else None
    log, times, last = [], [], [time.perf_counter()]

    def on_step(module, args_, output):
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now
        step = len(times)
        if step % args.every == 0:
            st = cache.layers[0].store
            page_bytes = st.page_size * (st.k_dim + st.v_dim) * st.pool["keys"].element_size()
            bound = len(cache.layers) * heads * (args.budget * page_bytes // st.page_size + st.num_shards * page_bytes)
            held = cache.kv_nbytes()
            tokens = max(int(layer.store.tokens_per_shard().sum(-1).max()) for layer in cache.layers)
            row = {
                "step": step,
                "kv_bytes": held,
                "bound_bytes": bound,
                "within_bound": held <= bound,
                "max_tokens_per_head": tokens,
                "median_step_ms_last": statistics.median(times[-args.every :]) * 1e3,
            }
            log.append(row)
            print(row, flush=True)

    handle = model.register_forward_hook(on_step)
    try:
        with press(model):
            model.generate(
                ids, past_key_values=cache, max_new_tokens=args.steps, min_new_tokens=args.steps, do_sample=False
            )
    finally:
        handle.remove()
    first, final = log[0]["median_step_ms_last"], log[-1]["median_step_ms_last"]
    write_result(
        args.out,
        {
            "benchmark": "decode_budget",
            "command": f"python benchmarks/decode_budget.py --budget {args.budget} --steps {args.steps} "
            f"--every {args.every} --page-size {args.page_size} --threads {args.threads} --out {args.out}",
            **run_metadata(args.threads),
            "config": {
                "model": "SmolLM2-135M-Instruct (fp32, 30 layers, 3 KV heads)",
                "prompt_tokens": int(ids.shape[1]),
                "press": f"DecodingBudgetPress(H2OPress(), target_size={args.budget})",
                "cache": f"PiKVCache(model, page_size={args.page_size}, track_stats=True), 8 shards",
                "head_dim": dim,
            },
            "targets": {"kv_bytes_within_bound_every_log": True, "step_time_flat": True},
            "all_within_bound": all(r["within_bound"] for r in log),
            "step_ms_last_over_first": final / first,
            "log": log,
        },
    )


if __name__ == "__main__":
    main()
