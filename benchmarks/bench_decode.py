"""Decode speed at long context: DynamicCache + SDPA vs PiKVCache exact vs PiKVCache routed (k/E = 1/4).

The caches are filled directly with ``cache.update`` (random fp32 K/V, ``context`` tokens per layer) instead of a
model prefill, because decode cost depends only on sizes and an O(T^2) CPU prefill at 32k would dominate the run.
Then, side by side in one process:

* ``step_ms``: one whole-model decode step (``model(token, past_key_values=cache)``), median of ``--steps``;
* ``attn_ms``: one layer's attention for one query token: SDPA (transformers' GQA path) over the DynamicCache
  tensors, ``PiKVLayer.attend`` for PiKVCache;
* ``bound_ms``: that attention's bytes read / measured read bandwidth. Bytes read = K+V of every stored token
  (DynamicCache, exact: slots incl. headroom), or K+V of the selected pages read once (routed: the ideal fused
  kernel; the torch path here copies them with a gather first, so it moves about 3x those bytes);
* ``matmul_floor_ms`` (routed): the two attention matmuls alone (``keys @ q^T`` and ``p @ values``, the calls
  ``masked_attention`` makes) on contiguous tensors holding as many keys per KV head as routed mode attends, in
  fp32 and in bf16, each with its own bytes bound: the fastest any path built from torch ops could run here,
  with no gather, masking or softmax;
* ``compute_ms``: that attention's FLOPs (``4 * Hq * keys * head_dim``: ``q.k`` and ``p.v``) / the measured fp32
  matmul rate, and ``roofline_ms = max(bound_ms, compute_ms)``. With 8 query heads per KV head in fp32 the
  arithmetic intensity is 4 FLOP/byte, so on one CPU core the compute roof, not the bandwidth, is the binding one.

Realistic attention sizes: 32 query heads, 4 KV heads, head_dim 128, 4 layers. Selection on random keys carries
no signal: this measures speed only (quality is in routing_recall.py and the eval harness).

    python benchmarks/bench_decode.py --contexts 8192 16384 32768 --out benchmarks/results/decode_speed_cpu.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from bench_cache import CONFIG, matmul_gflops, median_ms, positive, read_bandwidth_gbs, run_metadata, write_result
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from pikv_hf import PiKVCache
from pikv_hf.tiny import tiny_model

SHARDS = 8


def fill(cache, context: int, gen: torch.Generator) -> None:
    for layer in range(CONFIG["num_hidden_layers"]):
        k = torch.randn(1, CONFIG["num_key_value_heads"], context, CONFIG["head_dim"], generator=gen)
        cache.update(k, torch.randn(k.shape, generator=gen), layer)


def matmul_floor_ms(keys: int, dtype: torch.dtype, repeats: int, gen: torch.Generator) -> float:
    """Median ms of ``keys @ q^T`` then ``p @ values`` on ``[1, H, keys, D]`` contiguous K and V."""
    hq, hkv, d = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"], CONFIG["head_dim"]
    k, v = (torch.randn(1, hkv, keys, d, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(1, hkv, hq // hkv, d, generator=gen).to(dtype)

    def matmuls() -> torch.Tensor:
        return torch.matmul(torch.matmul(k, q.transpose(-1, -2)).transpose(-1, -2), v)

    return median_ms(matmuls, repeats)


def bench_context(model, ref, context: int, args, bandwidth: float, gflops: float) -> dict:
    gen = torch.Generator().manual_seed(context)
    hq, hkv, d = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"], CONFIG["head_dim"]
    query = torch.randn(1, hq, 1, d, generator=gen)
    new_kv = torch.randn(1, hkv, 1, d, generator=gen)
    token = torch.tensor([[5]])
    out = {}

    dyn = DynamicCache()
    fill(dyn, context, gen)
    layer0 = dyn.layers[0]
    attn = ref.model.layers[0].self_attn
    out["dynamic"] = {
        "attn_ms": median_ms(
            lambda: sdpa_attention_forward(attn, query, layer0.keys, layer0.values, None, scaling=d**-0.5),
            args.repeats,
        ),
        "attn_bytes": layer0.keys.nbytes + layer0.values.nbytes,
        "attn_keys": context,
    }
    with torch.no_grad():
        out["dynamic"]["step_ms"] = median_ms(lambda: ref(token, past_key_values=dyn), args.steps)

    for mode in ("exact", "routed"):
        kwargs = dict(attention="routed", top_k_shards=SHARDS // 4, n_sink=4, window=64) if mode == "routed" else {}
        cache = PiKVCache(model, router=args.router, num_shards=SHARDS, page_size=args.page_size, **kwargs)
        fill(cache, context, gen)
        layer = cache.layers[0]
        layer.update(new_kv, new_kv, None)  # one decode token; attend() reads the store without changing it
        attn_ms = median_ms(lambda layer=layer: layer.attend(query, d**-0.5, None, None), args.repeats)
        workspace = cache.workspace_nbytes()  # gather scratch held between steps (routed only)
        layer.crop(context)
        st = layer.store
        itemsize = st.pool["keys"].element_size()
        page_bytes = st.page_size * (st.k_dim + st.v_dim) * itemsize
        if mode == "routed":
            stats = layer.read_stats.counts()
            pages = stats["pages_gathered"] / max(1, stats["steps"])  # summed over KV heads
            attn_bytes = int(pages * page_bytes)  # ideal: the selected pages read once (the torch path copies them)
            attn_keys = pages / st.heads * st.page_size  # slots attended per KV head
        else:
            attn_bytes = st.kv_nbytes()
            attn_keys = st.table.width() * st.page_size  # exact attention scores every slot of the frame
        with torch.no_grad():
            step_ms = median_ms(lambda cache=cache: model(token, past_key_values=cache), args.steps)
        out[mode] = {
            "attn_ms": attn_ms,
            "attn_bytes": attn_bytes,
            "attn_keys": attn_keys,
            "step_ms": step_ms,
        }
        if mode == "routed":
            out[mode]["routing"] = cache.routing_stats()["overall"]
            out[mode]["workspace_bytes"] = workspace
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                floor = matmul_floor_ms(round(attn_keys), dtype, args.repeats, gen)
                bound = attn_bytes * dtype.itemsize / itemsize / (bandwidth * 1e9) * 1e3
                out[mode][f"matmul_floor_{name}"] = {"ms": floor, "bound_ms": bound, "over_bound": floor / bound}
        del cache
    for mode in ("dynamic", "exact", "routed"):
        out[mode]["bound_ms"] = out[mode]["attn_bytes"] / (bandwidth * 1e9) * 1e3
        out[mode]["attn_over_bound"] = out[mode]["attn_ms"] / out[mode]["bound_ms"]
        out[mode]["compute_ms"] = 4 * hq * out[mode]["attn_keys"] * d / (gflops * 1e9) * 1e3
        out[mode]["roofline_ms"] = max(out[mode]["bound_ms"], out[mode]["compute_ms"])
        out[mode]["attn_over_roofline"] = out[mode]["attn_ms"] / out[mode]["roofline_ms"]
    out["ratios"] = {
        "attn_dynamic_over_routed": out["dynamic"]["attn_ms"] / out["routed"]["attn_ms"],
        "attn_dynamic_over_exact": out["dynamic"]["attn_ms"] / out["exact"]["attn_ms"],
        "step_dynamic_over_routed": out["dynamic"]["step_ms"] / out["routed"]["step_ms"],
        "step_dynamic_over_exact": out["dynamic"]["step_ms"] / out["exact"]["step_ms"],
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=positive, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--steps", type=positive, default=8, help="whole-model decode steps timed")
    parser.add_argument("--repeats", type=positive, default=10, help="single-layer attention repeats timed")
    parser.add_argument("--threads", type=positive, default=torch.get_num_threads())
    parser.add_argument("--router", default="round_robin", help="balanced shards: k/E of the tokens are read")
    parser.add_argument("--page-size", type=positive, default=16, help="tokens per page of the PiKVCache store")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_speed_cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ref = tiny_model("llama", seed=0, **CONFIG)
    model = tiny_model("llama", seed=0, **CONFIG)
    bandwidth, gflops = read_bandwidth_gbs(), matmul_gflops()
    print(f"threads {args.threads}, read bandwidth {bandwidth:.1f} GB/s, fp32 matmul {gflops:.0f} GFLOP/s")
    rows = []
    for context in args.contexts:
        row = {"context": context, **bench_context(model, ref, context, args, bandwidth, gflops)}
        rows.append(row)
        print(
            f"ctx {context}: "
            + " | ".join(
                f"{m} attn {row[m]['attn_ms']:.2f}ms (bound {row[m]['bound_ms']:.2f}, "
                f"roof {row[m]['roofline_ms']:.2f}) step {row[m]['step_ms']:.1f}ms"
                for m in ("dynamic", "exact", "routed")
            )
            + f" | dynamic/routed attn x{row['ratios']['attn_dynamic_over_routed']:.1f} "
            f"step x{row['ratios']['step_dynamic_over_routed']:.2f}"
            + "".join(
                f" | routed matmul floor {n} {row['routed'][f'matmul_floor_{n}']['ms']:.2f}ms "
                f"({row['routed'][f'matmul_floor_{n}']['over_bound']:.1f}x its bound)"
                for n in ("fp32", "bf16")
            ),
            flush=True,
        )
    result = {
        "benchmark": "bench_decode",
        "command": f"python benchmarks/bench_decode.py --contexts {' '.join(map(str, args.contexts))} "
        f"--steps {args.steps} --repeats {args.repeats} --threads {args.threads} --router {args.router} "
        f"--page-size {args.page_size} --out {args.out}",
        **run_metadata(args.threads, bandwidth, gflops),
        "config": {
            **CONFIG,
            "dtype": "float32",
            "batch": 1,
            "shards": SHARDS,
            "top_k_shards": SHARDS // 4,
            "n_sink": 4,
            "window": 64,
            "router": args.router,
            "page_size": args.page_size,
        },
        "targets": {
            "attn_routed_over_bound_max": 2.0,
            "attn_dynamic_over_routed_min_at_32k": 8.0,
            "step_dynamic_over_routed_min_at_32k": 2.0,
            "exact_no_slower_than_dynamic": True,
        },
        "results": rows,
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
