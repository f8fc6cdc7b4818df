"""Ragged budgets and eviction cost of the paged store, measured on one layer.

* ``ragged``: a layer holding ``--context`` tokens keeps 100% of the tokens of even KV heads and 12.5% of odd ones
  (random tokens per head, as a head-wise press would); ``kv_nbytes()`` before and after, against the bytes of the
  kept tokens alone and that plus one page per (row, head, shard) (the most a re-pack may leave partly filled). A
  ``DynamicCache`` holds one rectangle, so the same budgets would leave it at the largest head's tokens.
* ``evict_half``: evicting half the tokens of every head (a different random half per head) against one exact decode
  attention of the same layer (``PiKVLayer.attend`` of one query token), medians side by side.

Realistic attention sizes (``bench_cache.CONFIG``: 32 query / 4 KV heads, head_dim 128, fp32), random keys.

    python benchmarks/bench_store.py --context 4096 --out benchmarks/results/store_ragged_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from bench_cache import CONFIG, median_ms, positive, run_metadata, write_result

from pikv_hf import PiKVCache
from pikv_hf.tiny import tiny_config


def filled(context: int, shards: int, page_size: int, gen: torch.Generator) -> PiKVCache:
    cache = PiKVCache(tiny_config("llama", **CONFIG), router="key_cluster", num_shards=shards, page_size=page_size)
    k = torch.randn(1, CONFIG["num_key_value_heads"], context, CONFIG["head_dim"], generator=gen)
    cache.update(k, torch.randn(k.shape, generator=gen), 0)
    return cache


def ragged(context: int, shards: int, page_size: int, gen: torch.Generator) -> dict:
    cache = filled(context, shards, page_size, gen)
    layer = cache.layers[0]
    st = layer.store
    h = st.heads
    before = cache.kv_nbytes()
    share = torch.tensor([1.0 if i % 2 == 0 else 0.125 for i in range(h)])
    keep_tok = torch.rand(1, h, context, generator=gen).argsort(-1).argsort(-1) < (share * context).view(1, h, 1)
    frame_pos = st.frame("pos").long().clamp(min=0, max=context - 1)
    layer.evict(st.frame("valid") & keep_tok.gather(2, frame_pos))
    after = cache.kv_nbytes()
    token_bytes = (st.k_dim + st.v_dim) * st.pool["keys"].element_size()
    kept = int(keep_tok.sum())
    partial_pages = 1 * h * shards  # at most one partly filled page per (row, head, shard)
    bound = kept * token_bytes + partial_pages * page_size * token_bytes
    return {
        "context": context,
        "kept_share_per_head": share.tolist(),
        "kept_tokens_per_head": keep_tok.sum(-1)[0].tolist(),
        "kv_bytes_before": before,
        "kv_bytes_after": after,
        "kept_token_bytes": kept * token_bytes,
        "bound_bytes": bound,
        "after_within_bound": after <= bound,
        "after_over_kept": after / (kept * token_bytes),
        "dynamic_cache_bytes_same_budgets": int(keep_tok.sum(-1).max()) * h * token_bytes,
    }


def evict_half(context: int, shards: int, page_size: int, repeats: int, gen: torch.Generator) -> dict:
    hq, d = CONFIG["num_attention_heads"], CONFIG["head_dim"]
    base = filled(context, shards, page_size, gen)
    layer = base.layers[0]
    new = torch.randn(1, CONFIG["num_key_value_heads"], 1, d, generator=gen)
    layer.update(new, new, None)
    query = torch.randn(1, hq, 1, d, generator=gen)
    layer.attend(query, d**-0.5, None, None, None)
    attend_ms = median_ms(lambda: layer.attend(query, d**-0.5, None, None, None), repeats)
    forks = [base.fork() for _ in range(repeats)]
    masks = []
    for f in forks:
        st = f.layers[0].store
        score = torch.rand(st.frame("valid").shape, generator=gen).masked_fill(~st.frame("valid"), -1)
        n_keep = (context + 1) // 2
        masks.append(torch.zeros_like(score, dtype=torch.bool).scatter_(2, score.topk(n_keep, -1).indices, True))
    times = []
    for f, keep in zip(forks, masks, strict=True):
        t0 = time.perf_counter()
        f.layers[0].evict(keep)
        times.append(time.perf_counter() - t0)
    evict_ms = statistics.median(times) * 1e3
    return {
        "context": context,
        "evict_half_ms": evict_ms,
        "exact_decode_attention_ms": attend_ms,
        "evict_over_attention": evict_ms / attend_ms,
        "kv_bytes_after_evict": forks[0].kv_nbytes(),
        "kv_bytes_before_evict": base.kv_nbytes(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=positive, default=4096)
    parser.add_argument("--shards", type=positive, default=8)
    parser.add_argument("--page-size", type=positive, default=16)
    parser.add_argument("--repeats", type=positive, default=9)
    parser.add_argument("--threads", type=positive, default=1)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/store_ragged_cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rag = ragged(args.context, args.shards, args.page_size, gen)
    print(
        f"ragged: kv bytes {rag['kv_bytes_before']:,} -> {rag['kv_bytes_after']:,} (kept tokens "
        f"{rag['kept_token_bytes']:,}, bound {rag['bound_bytes']:,}, within: {rag['after_within_bound']}; "
        f"a DynamicCache would hold {rag['dynamic_cache_bytes_same_budgets']:,})"
    )
    ev = evict_half(args.context, args.shards, args.page_size, args.repeats, gen)
    print(
        f"evict half at {args.context}: {ev['evict_half_ms']:.2f} ms vs one exact decode attention "
        f"{ev['exact_decode_attention_ms']:.2f} ms (x{ev['evict_over_attention']:.2f})"
    )
    result = {
        "benchmark": "bench_store",
        "command": f"python benchmarks/bench_store.py --context {args.context} --shards {args.shards} "
        f"--page-size {args.page_size} --repeats {args.repeats} --threads {args.threads} --out {args.out}",
        **run_metadata(args.threads),
        "config": {**CONFIG, "dtype": "float32", "batch": 1, "shards": args.shards, "page_size": args.page_size},
        "targets": {"ragged_after_within_bound": True, "evict_over_attention_max": 1.0},
        "ragged": rag,
        "evict_half": ev,
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
