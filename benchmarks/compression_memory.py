"""Bytes per token per layer of every compressor setting vs DynamicCache (fp16 and fp32), measured on tensors.

SmolLM2-135M-Instruct's real keys and values of held-out essay text (recorded in fp32, stored in float16 as an fp16
deployment would) fill a PiKVCache at each context length; each setting compresses it as its press does at prefill
end (the window kept exact), and the bytes are ``layer.kv_nbytes()`` of every layer: the hot store and the compressed
tier, every field (codes, scales and zeros, coefficients, page head ids), page slack included. The dense references
are ``2 * H * D * itemsize`` per token and layer. transformers' ``QuantizedCache`` (quanto) is filled with the same
float16 KV; its bytes are those of its packed tensors, scales and shifts.

``python benchmarks/compression_memory.py --out benchmarks/results/compression_memory.json`` (make bench-compression;
needs ``make eval-assets`` and ``make fit-projections``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from bench_cache import positive, run_metadata, write_result

from pikv_hf import PiKVCache
from pikv_hf.eval import compression
from pikv_hf.presses import cache_report, evict_lowest

SETTINGS = [  # the settings of make eval-compression, then a few more
    "quant@bits=4,group_size=64",
    "quant@bits=2,group_size=64",
    "quant@bits=2,group_size=32,n_sink=4",
    "quant@bits=8,group_size=64",
    "quant@bits=4,group_size=64,key_group_size=128",
    "quant@bits=2,group_size=64,key_group_size=128",
    "svd@rank=32",
    "svd@rank=16",
    "lora@rank=32",
    "lora@rank=16",
    "lora_plus@rank=32",
    "lora_plus@rank=16",
    "distill@rank=32",
    "distill@rank=16",
    "chunk_pca@rank=32",
    "chunk_pca@rank=16",
    "chunk_pca@rank=8",
    "pyramid@compression_ratio=0.25",
    "pyramid@compression_ratio=0.5",
    "pyramid@compression_ratio=0.75",
    "fastv_crop@channels=56",
    "fastv_crop@channels=48",
    "fastv_crop@channels=32",
    "channel_prune@channel_ratio=0.25",
    "channel_prune@channel_ratio=0.5",
    "quantized_cache@nbits=4",
    "quantized_cache@nbits=2",
]


def filled_cache(model, kv: list[tuple[torch.Tensor, torch.Tensor]], num_shards: int) -> PiKVCache:
    cache = PiKVCache(model.config, num_shards=num_shards, page_size=16)
    for i, (k, v) in enumerate(kv):
        cache.update(k.clone(), v.clone(), i)
    return cache


def compress(model, cache: PiKVCache, press, spec: str) -> None:
    """Apply ``press`` to every layer as its prefill hook does (pyramid: its budgets, tokens scored by key norm)."""
    if spec.startswith("pyramid"):
        for layer, decoder in zip(cache.layers, model.model.layers, strict=True):
            view = layer.view()
            budget = press.budget(decoder.self_attn, view)
            evict_lowest(layer, view, view.keys.float().norm(dim=-1), budget, press.shard_budget)
        return
    press.post_init_from_model(model)
    for layer in cache.layers:
        press.compress_layer(layer, prefilling=True)


def measure(model, kv, spec: str, num_shards: int) -> dict:
    tokens = kv[0][0].shape[2]
    press = compression.build(spec)
    if press is None:
        qc = compression.quantized_cache(spec, model, kv)
        per_layer = [compression.layer_nbytes(layer) / tokens for layer in qc.layers]
        return {"per_layer": per_layer, "kv_bytes": compression.kv_bytes(qc)}
    cache = filled_cache(model, kv, num_shards)
    compress(model, cache, press, spec)
    report = cache_report(cache)
    return {"per_layer": [la["bytes_per_token"] for la in report["layers"]], "kv_bytes": report["kv_bytes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", nargs="+", type=positive, default=[2048, 4096])
    parser.add_argument("--shards", nargs="+", type=positive, default=[1, 8])
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results/compression_memory.json")
    args = parser.parse_args()
    from pikv_hf.codecs import fit
    from pikv_hf.models import load_smollm2

    torch.set_num_threads(1)
    model, tokenizer = load_smollm2()
    cfg = model.config
    heads, dim = cfg.num_key_value_heads, cfg.head_dim
    dense = {"fp16": 2 * heads * dim * 2, "fp32": 2 * heads * dim * 4}
    ids = compression.held_out_ids(tokenizer, max(args.lengths))
    recorded = fit.record(model, ids)
    rows = []
    for length in args.lengths:
        kv = [tuple(la[side][:, :length].unsqueeze(0).half() for side in ("keys", "values")) for la in recorded]
        for spec in SETTINGS:
            for shards in [None] if spec.startswith("quantized_cache") else args.shards:
                windowed = not spec.startswith(("pyramid", "quantized_cache"))
                spec_w = f"{spec},window={args.window}" if windowed else spec
                started = time.perf_counter()
                got = measure(model, kv, spec_w, shards or 1)
                per_layer = got["per_layer"]
                mean = sum(per_layer) / len(per_layer)
                row = {
                    "setting": spec_w,
                    "tokens": length,
                    "num_shards": shards,
                    "bytes_per_token_per_layer": round(mean, 3),
                    "vs_fp16": round(mean / dense["fp16"], 4),
                    "vs_fp32": round(mean / dense["fp32"], 4),
                    "kv_bytes": got["kv_bytes"],
                    "per_layer": [round(x, 3) for x in per_layer],
                    "seconds": round(time.perf_counter() - started, 2),
                }
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "per_layer"}), flush=True)
    out = {
        "model": "SmolLM2-135M-Instruct (30 layers, 3 KV heads, head_dim 64)",
        "kv": "post-RoPE keys and values of held-out essay text, recorded in fp32, stored as float16",
        "dense_bytes_per_token_per_layer": dense,
        "window": args.window,
        "page_size_hot": 16,
        "notes": "bytes = layer.kv_nbytes() (hot store + compressed tier, every codec field, page slack included) "
        "per sequence token and layer; num_shards 8 is PiKVCache's default for a dense model (each shard's last "
        "compressed page is partly empty), 1 shows the codec alone; pyramid evicts (tokens scored by key norm, "
        "layer budgets of PyramidPress); quantized_cache is transformers' QuantizedCache(backend='quanto') filled "
        "with the same KV (its residual empty at fill)",
        **run_metadata(1),
        "rows": rows,
    }
    write_result(Path(args.out), out)


if __name__ == "__main__":
    main()
