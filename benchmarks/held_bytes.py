"""Bytes a cache holds beyond its K/V, every way of keeping the KV at two attention shapes (issue 31 item 5: <= 5% of
the fp16 KV).

Per shape and way (``bench_e2e.MODES``): a random-weight bfloat16 model with that attention shape (a tiny MLP: the
cache does not depend on it), a prefill of the shape's context (random tokens), then ``--steps`` greedy decode steps
with sparse reads forced (``sparse_from=0``), so that the state a sparse step keeps is counted. Then, measured on the
tensors:

* ``held``: every tensor storage the cache references, each once (``PiKVCache.held_nbytes``);
* ``kv`` / ``offloaded``: key / value bytes allocated, resident and in the offload tier (``kv_nbytes``,
  ``offloaded_nbytes``);
* ``meta``: the stores' positions, valid bits, masks, page shard ids and key bounds, page tables, shard key sums and
  the sink / recent-window slots of sparse reads (``meta_nbytes``);
* ``workspace``: the torch backend's CPU scratch, shared by all layers: one gather buffer per field (as large as the
  largest read of one layer) and, for a quantised store, one code field's uint8 and float32 conversion buffers (on
  CUDA a gather allocates its output instead);
* ``other``: the rest (the key-cluster placement's centroids and counts, read and routing state);
* of these, the summaries a sparse read selects from, which grow with the shards or pages and not with the tokens:
  ``shard_stats`` (every store's per-shard key sums, squares and bounds, in ``meta``), ``page_bounds`` (Quest's key
  min / max per page, in ``meta``) and ``centroids`` (the key-cluster placement's, in ``other``), told apart by the
  attribute that holds each tensor (``pikv_hf.memory.reachable_tensors``);
* ``beyond_kv_over_fp16`` = (held - kv - offloaded) / the fp16 KV of the tokens held (2 x 2 B x tokens x KV heads x
  head dim x layers).

Shapes: SmolLM2-135M's attention (30 layers, 9 query / 3 KV heads of 64) at 4096 tokens, as ``tests/test_memory.py``;
Llama-3.1-8B's (32 layers, head dim 128) at 32768 tokens with one KV head and one query head (every byte a cache
holds beyond the model is per KV head, and one head keeps the prefill's attention affordable on a CPU).

    python benchmarks/held_bytes.py --out benchmarks/results/held_bytes_cpu.json     # ~30 min on one thread
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from bench_cache import positive, run_metadata, write_result
from bench_e2e import MODES

from pikv_hf.memory import reachable_tensors, storage_nbytes
from pikv_hf.tiny import tiny_model

GOAL = 0.05  # bytes held beyond K/V over the fp16 KV (issue 31, item 5)
WAYS = ["exact", "routed", "routed_1_8", "quest_1_8", "quant4", "quest_quant4", "h2o_offload_routed"]


@dataclass(frozen=True)
class Shape:
    layers: int
    query_heads: int
    kv_heads: int
    head_dim: int
    context: int


SHAPES = {
    "smollm2": Shape(30, 9, 3, 64, 4096),
    "llama3.1-8b": Shape(32, 1, 1, 128, 32768),
}
TINY_SHAPES = {  # --tiny: the same head dims, few layers and tokens (seconds)
    "smollm2": Shape(2, 3, 1, 64, 512),
    "llama3.1-8b": Shape(2, 1, 1, 128, 768),
}


def model_of(shape: Shape, steps: int):
    return tiny_model(
        "llama", seed=0, dtype=torch.bfloat16, hidden_size=shape.query_heads * shape.head_dim,
        num_attention_heads=shape.query_heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        intermediate_size=64, num_hidden_layers=shape.layers, max_position_embeddings=shape.context + steps + 8,
    )  # fmt: skip


# attribute path endings of the summary tensors, by part
SUMMARIES = {
    "shard_stats": (".stats.sum", ".stats.sq", ".stats.min", ".stats.max"),
    "page_bounds": ("['key_min']", "['key_max']"),
    "centroids": (".placement.centroids",),
}


def summary_parts(cache) -> dict[str, int]:
    """Bytes of the cache's summary tensors by part (``SUMMARIES``), each storage once."""
    tensors = reachable_tensors(cache).values()
    return {name: storage_nbytes(t for path, t in tensors if path.endswith(ends)) for name, ends in SUMMARIES.items()}


def measure(model, shape: Shape, way: str, steps: int) -> dict:
    """Prefill ``shape.context`` random tokens into ``way``'s cache, take ``steps`` decode steps, count its bytes."""
    mode = MODES[way]
    cache = mode.build(model, sparse_from=0)
    ids = torch.randint(3, model.config.vocab_size, (1, shape.context), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    with torch.no_grad():
        with contextlib.ExitStack() as stack:
            for press in mode.presses():
                stack.enter_context(press(model))
            token = model(ids, past_key_values=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
        for _ in range(steps):
            token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
    tokens = shape.context + steps
    fp16 = 2 * 2 * tokens * shape.kv_heads * shape.head_dim * shape.layers
    held, kv, offloaded = cache.held_nbytes(), cache.kv_nbytes(), cache.offloaded_nbytes()
    meta, workspace = cache.meta_nbytes(), cache.workspace_nbytes()
    beyond = held - kv - offloaded
    return {
        "way": way,
        "tokens": tokens,
        "fp16_kv_bytes": fp16,
        "held_bytes": held,
        "kv_bytes": kv,
        "offloaded_bytes": offloaded,
        "meta_bytes": meta,
        "workspace_bytes": workspace,
        "other_bytes": beyond - meta - workspace,
        **{f"{name}_bytes": n for name, n in summary_parts(cache).items()},
        "beyond_kv_bytes": beyond,
        "beyond_kv_over_fp16": round(beyond / fp16, 4),
        "met": beyond <= GOAL * fp16,
        "read_fraction": round(cache.routing_stats()["overall"]["fraction_tokens_attended"], 3),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--ways", nargs="+", default=WAYS, choices=WAYS)
    parser.add_argument("--steps", type=positive, default=2, help="decode steps after the prefill (default 2)")
    parser.add_argument("--threads", type=positive, default=1)
    parser.add_argument("--tiny", action="store_true", help="few layers and tokens (tests/test_bench_held_bytes.py)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/held_bytes_cpu.json"))
    parser.add_argument(
        "--merge", action="store_true",
        help="keep the points of an existing --out that this run does not measure (same shape and way: replaced)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be >= 1 (a decode step's state is part of what is held); got {args.steps}")
    torch.set_num_threads(args.threads)
    shapes = TINY_SHAPES if args.tiny else SHAPES
    command = " ".join(["python", *sys.argv])
    kept, commands = [], [command]
    if args.merge and args.out.exists():
        before = json.loads(args.out.read_text())
        if before["tiny"] != args.tiny or before["steps"] != args.steps:
            parser.error(f"--merge: {args.out} was measured with tiny={before['tiny']}, steps={before['steps']}")
        mine = {(s, w) for s in args.shapes for w in args.ways}
        kept = [p for p in before["points"] if (p["shape"], p["way"]) not in mine]
        commands = [*before["commands"], command]
    result = {
        **run_metadata(args.threads),
        "commands": commands,
        "what": "tensor bytes a cache references beyond its K/V after a prefill and decode steps, over the fp16 KV",
        "tiny": args.tiny,
        "steps": args.steps,
        "goal_beyond_kv_over_fp16": GOAL,
        "shapes": {n: asdict(s) for n, s in shapes.items() if n in {*args.shapes, *(p["shape"] for p in kept)}},
        "ways": {way: {"cache": MODES[way].cache, "presses": [type(p).__name__ for p in MODES[way].presses()]}
                 for way in WAYS if way in {*args.ways, *(p["way"] for p in kept)}},  # fmt: skip
        "points": kept,
    }
    order = {(s, w): i for i, (s, w) in enumerate((s, w) for s in SHAPES for w in WAYS)}
    for name in args.shapes:
        shape = shapes[name]
        model = model_of(shape, args.steps)
        for way in args.ways:
            point = {"shape": name, **measure(model, shape, way, args.steps)}
            result["points"] = sorted([*result["points"], point], key=lambda p: order[p["shape"], p["way"]])
            print(
                f"{name:12s} {way:19s} beyond K/V {point['beyond_kv_over_fp16']:.4f}x fp16 (meta "
                f"{point['meta_bytes'] / point['fp16_kv_bytes']:.4f}, workspace "
                f"{point['workspace_bytes'] / point['fp16_kv_bytes']:.4f}, other "
                f"{point['other_bytes'] / point['fp16_kv_bytes']:.4f}; summaries "
                f"{sum(point[f'{n}_bytes'] for n in SUMMARIES) / point['fp16_kv_bytes']:.4f}) {point['seconds']} s",
                flush=True,
            )
            write_result(args.out, result)  # each point as it comes: a cut run keeps what it measured
    result["complete"] = True
    write_result(args.out, result)


if __name__ == "__main__":
    main()
