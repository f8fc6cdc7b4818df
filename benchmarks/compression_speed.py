"""Decode step time of SmolLM2 with a quantised PiKVCache vs transformers' QuantizedCache vs DynamicCache, at 4k and
16k tokens of context, ratios from one run.

Each cache is filled with the same context KV (random, fp32: decode speed does not depend on the values; a 16k
prefill of the model would take minutes here), then ``--steps`` greedy decode steps of the whole model are timed
(``--repeats`` times, each from a fresh fill; median step). PiKVCache runs exact (identity pages) and with
``QuantPress`` (4 bits, groups of 64, the last 128 tokens exact: the torch backend dequantises the tier's pages on
every read), QuantizedCache with quanto at 4 bits, groups of 64, residual 128 (it dequantises its whole cache every
step). ``python benchmarks/compression_speed.py --out benchmarks/results/compression_speed_cpu.json``
(make bench-compression).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from bench_cache import positive, run_metadata, write_result
from transformers import DynamicCache

from pikv_hf import PiKVCache
from pikv_hf.eval import compression
from pikv_hf.presses import QuantPress

CACHES = ("dynamic", "quantized_cache", "pikv_exact", "pikv_quant")


def fill(kind: str, model, kv, bits: int):
    if kind == "dynamic":
        cache = DynamicCache()
        for i, (k, v) in enumerate(kv):
            cache.update(k.clone(), v.clone(), i)
        return cache
    if kind == "quantized_cache":
        return compression.quantized_cache(f"quantized_cache@nbits={bits}", model, kv)
    cache = PiKVCache(model, page_size=16)
    for i, (k, v) in enumerate(kv):
        cache.update(k.clone(), v.clone(), i)
    if kind == "pikv_quant":
        press = QuantPress(bits=bits, group_size=64, window=128)
        press.post_init_from_model(model)
        for layer in cache.layers:
            press.compress_layer(layer, prefilling=True)
    return cache


def time_steps(model, cache, context: int, steps: int) -> list[float]:
    token = torch.tensor([[1]])
    times = []
    with torch.no_grad():
        for i in range(steps):
            started = time.perf_counter()
            logits = model(input_ids=token, past_key_values=cache, position_ids=torch.tensor([[context + i]])).logits
            times.append(time.perf_counter() - started)
            token = logits[:, -1:].argmax(-1)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", nargs="+", type=positive, default=[4096, 16384])
    parser.add_argument("--steps", type=positive, default=6)
    parser.add_argument("--repeats", type=positive, default=3)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--threads", type=positive, default=1)
    parser.add_argument("--out", default="benchmarks/results/compression_speed_cpu.json")
    args = parser.parse_args()
    from pikv_hf.models import load_smollm2

    torch.set_num_threads(args.threads)
    model, _ = load_smollm2()
    cfg = model.config
    rows = []
    for context in args.contexts:
        gen = torch.Generator().manual_seed(context)
        shape = (1, cfg.num_key_value_heads, context, cfg.head_dim)
        kv = [tuple(torch.randn(shape, generator=gen) for _ in "kv") for _ in range(cfg.num_hidden_layers)]
        medians = {}
        for kind in CACHES:
            samples = []
            for _ in range(args.repeats):  # a fresh fill each time (quanto's tensors cannot be copied)
                cache = fill(kind, model, kv, args.bits)
                nbytes = compression.kv_bytes(cache)
                samples += time_steps(model, cache, context, args.steps)[1:]  # the first step warms up
            medians[kind] = statistics.median(samples)
            rows.append(
                {
                    "context": context,
                    "cache": kind,
                    "median_step_s": round(medians[kind], 5),
                    "kv_bytes": nbytes,
                    "steps_timed": len(samples),
                }
            )
            if isinstance(cache, PiKVCache):
                cache.detach()
            print(json.dumps(rows[-1]), flush=True)
        for row in rows:
            if row["context"] == context:
                row["vs_dynamic"] = round(row["median_step_s"] / medians["dynamic"], 3)
                row["vs_quantized_cache"] = round(row["median_step_s"] / medians["quantized_cache"], 3)
    out = {
        "model": "SmolLM2-135M-Instruct, fp32, one greedy decode step of the whole model",
        "settings": f"{args.bits}-bit, groups of 64, residual / window 128; {args.steps - 1} timed steps x "
        f"{args.repeats} repeats per cache, {args.threads} thread(s)",
        **run_metadata(args.threads),
        "rows": rows,
    }
    write_result(Path(args.out), out)


if __name__ == "__main__":
    main()
