"""KV bytes a PiKVCache allocates after each scheduling press, against (1 - r) x a DynamicCache's, on SmolLM2.

One ``--context``-token prefill of essay text into a PiKVCache (hooks recorded); every press at every ratio is
replayed on a fork of it (``pikv_hf.eval.points.PrefillRecord``), and the fork's ``kv_nbytes()`` (the
tensors it holds for its resident tokens) is compared with ``(1 - r)`` times the bytes of a DynamicCache holding the
uncompressed context. FlexGen's non-resident share sits in the offload tier (``offloaded_nbytes()``, reported
apart); Quest selects per step and frees nothing (not in the check).

    python benchmarks/scheduling_bytes.py --context 2048 --page-size 1 \
        --out benchmarks/results/scheduling_bytes_cpu.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from bench_cache import positive, run_metadata, write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=positive, default=2048)
    parser.add_argument("--page-size", type=positive, default=1)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    parser.add_argument("--threads", type=positive, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/scheduling_bytes_cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import DynamicCache

    from pikv_hf import PiKVCache
    from pikv_hf.eval.haystack import essay_sentences
    from pikv_hf.eval.pikv_presses import PIKV_PRESSES, build_pikv_press, duo_heads
    from pikv_hf.eval.points import PrefillRecord
    from pikv_hf.models import load_smollm2

    model, tok = load_smollm2()
    ids = tok(" ".join(essay_sentences()), return_tensors="pt").input_ids[:, : args.context]
    dyn = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=ids, past_key_values=dyn)
    dynamic_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in dyn.layers)
    del dyn
    cache = PiKVCache(model, page_size=args.page_size, track_stats=True)
    recorded = PrefillRecord(model, ids, cache)
    args.out.parent.mkdir(parents=True, exist_ok=True)  # the calibration is saved beside the result
    heads = duo_heads(model, tok, args.out.parent)
    rows = []
    for name in PIKV_PRESSES:
        if name.endswith("_offload_routed"):
            continue  # the same resident bytes as pikv_h2o
        for ratio in args.ratios:
            fork = recorded.compressed_cache(build_pikv_press(name, ratio, heads))
            held, offloaded = fork.kv_nbytes(), fork.offloaded_nbytes()
            target = (1 - ratio) * dynamic_bytes
            rows.append(
                {
                    "press": name,
                    "ratio": ratio,
                    "pikv_kv_bytes": held,
                    "pikv_offloaded_bytes": offloaded,
                    "target_bytes": target,
                    "over_target": held / target,
                    "within_3_percent": abs(held / target - 1) <= 0.03,
                }
            )
            print(f"{name} r={ratio}: {held:,} B resident ({held / target:.4f} x target), {offloaded:,} B offloaded")
            del fork
    write_result(
        args.out,
        {
            "benchmark": "scheduling_bytes",
            "command": f"python benchmarks/scheduling_bytes.py --context {args.context} --page-size {args.page_size} "
            f"--ratios {' '.join(map(str, args.ratios))} --threads {args.threads} --out {args.out}",
            **run_metadata(args.threads),
            "config": {
                "model": "SmolLM2-135M-Instruct (fp32, 30 layers, 3 KV heads)",
                "context_tokens": int(ids.shape[1]),
                "pikv": f"PiKVCache(model, page_size={args.page_size}, track_stats=True): round_robin, 8 shards",
                "dynamic_cache_bytes": dynamic_bytes,
                "budget_note": "ratio = fraction of the context's KV pairs evicted per KV head (AdaKV, DuoAttention: "
                "per layer, spread unevenly over heads)",
            },
            "target": "PiKVCache kv_nbytes within 3% of (1 - r) x DynamicCache bytes, every press and ratio",
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
