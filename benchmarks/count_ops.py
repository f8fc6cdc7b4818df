"""Operators one eager decode step dispatches, per way of keeping the KV, against DynamicCache in the same run.

On a GPU every operator that computes is a kernel launch, and an eager step whose kernels are small is bound by the
host issuing them (``../shared/GPU.md``: a routed step launched 3.9x DynamicCache's kernels). This script counts
that cost on the CPU, where it is deterministic: the shapes of a decode step do not depend on the data, so the count
is the same on every run and machine.

Two paths are counted, each way side by side with DynamicCache: ``cpu``, the step as it runs on this CPU (the torch
attention backend), and ``cuda``, the step a CUDA device runs: the Triton backend selected, so every kernel launch of
the CUDA step is one operator here (the custom operators run their CPU implementations under the counter, each
counted as its one launch; a ratio of the H100 profile at 7c04f95, routed 1.28x / Quest 1.33x DynamicCache's kernels
at 8 layers, was counted 1.29x / 1.37x this way at that commit).

What is counted: the aten operators one decode step dispatches, seen by a ``TorchDispatchMode`` (below autograd,
after composite operators decomposed: what reaches a device's kernels), less those that launch no kernel on a GPU:
views (``OpOverload.is_view`` and ``_unsafe_view`` / ``_reshape_alias``) and bare allocations (``empty``,
``empty_strided``). Reads of a tensor's value back to the host (``_local_scalar_dense``: ``int(t)``, ``t.item()``)
are counted apart as ``host_reads`` (on a GPU each is a synchronisation, not a launch). The profiler's leaf events
were not used: an ``aten::mm`` or SDPA call records a child (``aten::resolve_conj``) and so is no leaf, while no-op
``aten::to`` calls and views are.

The model has SmolLM2-135M's shape (30 layers, hidden 576, 9 query / 3 KV heads of 64) with random weights (no
download; the count does not depend on the weights), fp32. Each way prefills ``--context`` random tokens, takes
``--warmup`` decode steps, then one profiled step. Sparse reads are forced (``sparse_from=0``) so that the routed and
Quest ways plan a sparse read at any context.

    python benchmarks/count_ops.py --out benchmarks/results/ops_per_step_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
from collections import Counter
from pathlib import Path

import torch
from bench_cache import positive, run_metadata, write_result
from bench_e2e import MODES
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

# bench_e2e's ways (cache arguments and prefill presses); H2O + offload + routed reads over two tiers
WAYS = ["dynamic", "exact", "routed", "quest_1_8", "quant4", "quest_quant4", "h2o_offload_routed"]
# ratio to DynamicCache's count each way should stay under (issue 31, item 4)
GOALS = {"exact": 1.2, "routed": 1.6, "quest_1_8": 1.6, "quant4": 1.4, "quest_quant4": 1.6}
# the attention backend of each counted path: this CPU's torch path, and the Triton path of a step on CUDA
PATHS = {"cpu": "auto", "cuda": "triton"}


SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               vocab_size=49152)  # fmt: skip


def llama(layers: int = 30, **dims: int) -> LlamaForCausalLM:
    """A random-weight fp32 Llama of SmolLM2-135M's shape with ``layers`` decoder layers (``dims`` override its
    sizes: the operators a step dispatches do not depend on them)."""
    cfg = LlamaConfig(
        **{**SMOLLM2, **dims}, num_hidden_layers=layers, max_position_embeddings=8192, rope_theta=100000.0,
        tie_word_embeddings=True,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


NO_KERNEL = {"_unsafe_view", "_reshape_alias", "empty", "empty_strided", "_local_scalar_dense"}


class OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched inside it by name (``counts``: operators that launch a kernel on a GPU;
    ``host_reads``: values read back to the host; ``dispatched``: every operator, views included)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.host_reads = 0
        self.dispatched = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.dispatched += 1
        if name == "_local_scalar_dense":
            self.host_reads += 1
        elif not func.is_view and name not in NO_KERNEL:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def count_way(model, way: str, ids: torch.Tensor, warmup: int = 2, path: str = "cpu") -> OpCounter:
    """Operators of one decode step of ``way`` after a prefill of ``ids`` (``[B, T]``) and ``warmup`` steps, on
    ``path`` (a key of ``PATHS``)."""
    mode = MODES[way]
    cache = mode.build(model, sparse_from=0, attention_backend=PATHS[path])
    with torch.no_grad():
        with contextlib.ExitStack() as stack:
            for press in mode.presses():
                stack.enter_context(press(model))
            logits = model(ids, past_key_values=cache, logits_to_keep=1).logits
        token = logits[:, -1:].argmax(-1)
        for _ in range(warmup):
            token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
        with OpCounter() as counter:
            model(token, past_key_values=cache)
    return counter


def count_all(model, ids: torch.Tensor, ways: list[str], warmup: int = 2, path: str = "cpu") -> dict[str, OpCounter]:
    """``count_way`` of every way of ``ways`` on ``path`` (DynamicCache's always included, first)."""
    return {
        way: count_way(model, way, ids, warmup, path) for way in ["dynamic", *[w for w in ways if w != "dynamic"]]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=positive, default=2048)
    parser.add_argument("--layers", type=positive, default=30)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ways", nargs="+", default=WAYS, choices=WAYS)
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    parser.add_argument("--top", type=int, default=15, help="operators listed per way, most frequent first")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/ops_per_step_cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = llama(args.layers)
    ids = torch.randint(0, model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    paths = {}
    for path in args.paths:
        counts = count_all(model, ids, args.ways, args.warmup, path)
        base = sum(counts["dynamic"].counts.values())
        ways = paths[path] = {}
        for way, c in counts.items():
            n = sum(c.counts.values())
            ways[way] = {
                "ops_per_step": n,
                "host_reads_per_step": c.host_reads,
                "dispatched_per_step": c.dispatched,
                "ratio_to_dynamic": round(n / base, 3),
                "goal": GOALS.get(way),
                "met": None if way not in GOALS else n / base <= GOALS[way],
                "top_ops": c.counts.most_common(args.top),
            }
            print(
                f"{path} {way:>18}: {n:6d} ops per step, {n / base:.2f}x DynamicCache (goal {GOALS.get(way)}), "
                f"{c.host_reads} host reads",
                flush=True,
            )
    result = {
        **run_metadata(1),
        "what": "aten operators one eager decode step dispatches (views, allocations and host reads apart) on the "
        "CPU's torch path and on the Triton path of a CUDA step (one operator per kernel launch)",
        "model": {"shape": "SmolLM2-135M", "layers": args.layers, "dtype": "float32", "weights": "random"},
        "context": args.context,
        "batch": 1,
        "warmup_steps": args.warmup,
        "sparse_from": 0,
        "paths": {path: {"attention_backend": PATHS[path], "ways": ways} for path, ways in paths.items()},
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
