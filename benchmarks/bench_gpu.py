"""Decode on a GPU end to end: every way of keeping the KV against DynamicCache (eager) and StaticCache (compiled).

One command for a machine with a CUDA GPU and no network (``make bench-gpu``). It uses the machine's own torch and
triton; the project's other pins (transformers 5.2.0, kvpress 0.5.5, ...) may come from a wheel folder installed with
``pip install --no-deps --target DIR`` and put on ``PYTHONPATH`` (``make bench-gpu WHEELS=DIR``). It never installs
anything. Random-weight models of named real shapes (``SHAPES``: Llama-3.1-8B; Qwen3-30B-A3B's attention on a dense
MLP), fewer layers than the real models (the JSON says how many), the model's SDPA attention, bf16 on CUDA.

Sections, in the order they run (each way in its own ``try``: an error or out-of-memory is recorded and the rest go on;
the JSON is rewritten after every way, so a run cut short still leaves what it measured):

- ``eager``: per shape and batch, one prefill of ``--context`` random tokens per way, then greedy one-token forwards
  (the loop of ``generate``): ms/token (median of ``--steps`` after ``--warmup``), its ratio to DynamicCache, prefill
  seconds, peak memory at prefill and at decode (``torch.cuda.max_memory_allocated`` after a reset), KV bytes, fraction
  of the KV a step reads, kernels launched and GPU-busy time per step (``torch.profiler`` over ``--profile-steps``
  steps; on a CPU the leaf operators and their time instead), and the first generated tokens;
- ``compiled``: StaticCache with the decode step under ``torch.compile(fullgraph=True, mode="reduce-overhead")`` as the
  baseline, every PiKV way beside it as ``PiKVCache(model, max_cache_len=N)`` compiled the same way (a way that does
  not compile is recorded with its error);
- ``generate``: ``model.generate(past_key_values=PiKVCache(model, max_cache_len=N))`` taking transformers' automatic
  compile of the decode step (on a CPU forced with a ``CompileConfig``): graph breaks, graphs compiled, ms/token and
  whether its tokens equal the same generate run eagerly;
- ``tuned``: the configuration each autotuned kernel chose per key (``pikv_hf.kernels.decode.tuned_choices``).

``--budget-s`` bounds the whole run (a way that would start after it is recorded as skipped); ``--tiny`` runs the
same code on the CPU with tiny shapes in seconds (``tests/test_bench_gpu.py``).

    PYTHONPATH=src python benchmarks/bench_gpu.py                     # on the GPU machine: ~6 min on an H200
    PYTHONPATH=src python benchmarks/bench_gpu.py --tiny --out /tmp/gpu_tiny.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import re
import signal
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

import torch
import transformers
from bench_cache import positive
from bench_e2e import MODES, git_revision, kv_bytes
from torch.profiler import ProfilerActivity, profile
from transformers import (
    CompileConfig,
    DynamicCache,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    Qwen3Config,
    Qwen3ForCausalLM,
    StaticCache,
)

import pikv_hf
from pikv_hf import PiKVCache
from pikv_hf.kernels.decode import tuned_choices


@dataclass(frozen=True)
class Shape:
    """A real model's decoder shape, built with random weights and ``layers`` of its ``real_layers`` layers."""

    family: str  # "llama" or "qwen3"
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float
    real_layers: int
    note: str

    def config(self, layers: int):
        cls = LlamaConfig if self.family == "llama" else Qwen3Config
        cfg = cls(
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab,
            max_position_embeddings=1 << 17,
            rope_theta=self.rope_theta,
        )
        cfg._attn_implementation = "sdpa"
        return cfg

    def build(self, layers: int, device: torch.device, dtype: torch.dtype):
        cls = LlamaForCausalLM if self.family == "llama" else Qwen3ForCausalLM
        torch.manual_seed(0)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                return cls(self.config(layers)).eval()
        finally:
            torch.set_default_dtype(previous)


QWEN_NOTE = (
    "Qwen3-30B-A3B's attention (32 query / 4 KV heads, head_dim 128, hidden 2048, q/k norms) on a dense Qwen3 MLP of "
    "width 6144 = its 8 active experts x 768: the 128-expert MoE itself is not built"
)
SHAPES = {
    "llama3.1-8b": Shape("llama", 4096, 14336, 32, 8, 128, 128256, 500000.0, 32, "Llama-3.1-8B's decoder shape"),
    "qwen3-30b-a3b-attn": Shape("qwen3", 2048, 6144, 32, 4, 128, 151936, 1e6, 48, QWEN_NOTE),
}
TINY_SHAPES = {  # the same families and head ratios (4 and 8 query heads per KV head), tiny
    "llama3.1-8b": Shape("llama", 64, 128, 4, 1, 64, 256, 10000.0, 32, "tiny stand-in (--tiny)"),
    "qwen3-30b-a3b-attn": Shape("qwen3", 64, 128, 8, 1, 64, 256, 10000.0, 48, "tiny stand-in (--tiny)"),
}
SPARSE = ("routed", "quest")
# ways: bench_e2e's MODES, sparse reads from the first token (sparse_from=0; at 32k the defaults read sparsely anyway)
WAYS = list(MODES)
COMPILED_WAYS = ["static", "exact", "routed_1_8", "quest_1_8", "quant4", "routed", "quest_quant4", "h2o_offload_routed"]


TOP_KERNELS = 12  # the kernels with the most GPU time a profile lists


class Timeout(BaseException):  # not an Exception: code inside a way (torch.compile) must not swallow it
    """A way ran past its time limit."""


def _alarm(signum, frame):
    raise Timeout()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak(device: torch.device) -> int | None:
    """Peak bytes allocated since the last reset (CUDA only)."""
    return torch.cuda.max_memory_allocated() if device.type == "cuda" else None


def cache_options(way: str, attention_backend: str = "auto") -> dict:
    """PiKVCache arguments of ``way`` (sparse reads from the first token)."""
    options = dict(MODES[way].cache)
    if options.get("attention") in SPARSE:
        options["sparse_from"] = 0
    return options if attention_backend == "auto" else {**options, "attention_backend": attention_backend}


def build_cache(model, way: str, max_cache_len: int | None, attention_backend: str):
    if way == "static":
        return StaticCache(config=model.config, max_cache_len=max_cache_len)
    if MODES[way].cache is None:
        return DynamicCache()
    extra = {} if max_cache_len is None else {"max_cache_len": max_cache_len}
    return PiKVCache(model, **cache_options(way, attention_backend), **extra)


def prefill(model, way: str, cache, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Run the prompt into ``cache`` under ``way``'s presses (in chunks of ``chunk`` tokens when > 0); last logits."""
    presses = [] if way == "static" else MODES[way].presses()
    bounds = list(range(0, ids.shape[1], chunk)) if chunk else [0]
    with torch.no_grad(), contextlib.ExitStack() as stack:
        for press in presses:
            stack.enter_context(press(model))
        for i, start in enumerate(bounds):
            end = bounds[i + 1] if i + 1 < len(bounds) else ids.shape[1]
            pos = torch.arange(start, end, device=ids.device)
            logits = model(ids[:, start:end], past_key_values=cache, cache_position=pos, logits_to_keep=1).logits
    return logits[:, -1:].argmax(-1)


def read_fraction(cache) -> float:
    """Fraction of the stored tokens a decode step attends to (1.0 for a dense read)."""
    if isinstance(cache, PiKVCache) and cache.read.sparse:
        overall = cache.routing_stats()["overall"]
        return overall["fraction_tokens_attended"] if overall["sparse_layer_steps"] else 1.0
    return 1.0


def cache_bytes(cache) -> tuple[int, int]:
    if isinstance(cache, StaticCache):
        return sum(la.keys.nbytes + la.values.nbytes for la in cache.layers if la.keys is not None), 0
    return kv_bytes(cache)


def profile_steps(step, n: int, device: torch.device) -> dict:
    """Kernels launched and GPU-busy ms per step over ``n`` calls of ``step`` (on a CPU: leaf operators, their ms)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(n):
            step()
        sync(device)
    if device.type == "cuda":
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        count, busy_us = sum(e.count for e in events), sum(e.self_device_time_total for e in events)
        graphs = sum(e.count for e in prof.key_averages() if e.key == "cudaGraphLaunch")
        top = sorted(events, key=lambda e: -e.self_device_time_total)[:TOP_KERNELS]
        return {
            "kernels_per_step": count / n,
            "busy_ms_per_step": busy_us / n / 1e3,
            "graph_launches_per_step": graphs / n,
            "counted": "CUDA kernels and copies, GPU time",
            "top_kernels": [
                {"name": e.key[:120], "per_step": e.count / n, "ms_per_step": e.self_device_time_total / n / 1e3}
                for e in top
            ],
        }
    leaves = [
        e
        for e in prof.events()
        if e.name.startswith("aten::") and not any(c.name.startswith("aten::") for c in e.cpu_children)
    ]
    return {
        "kernels_per_step": len(leaves) / n,
        "busy_ms_per_step": sum(e.self_cpu_time_total for e in leaves) / n / 1e3,
        "graph_launches_per_step": 0.0,
        "counted": "CPU leaf aten operators, CPU time",
    }


class Decoder:
    """Greedy one-token steps on a prefilled cache, eager or through a compiled step function."""

    def __init__(self, model, cache, token: torch.Tensor, context: int, compiled=None) -> None:
        self.model, self.cache, self.token, self.pos, self.compiled = model, cache, token, context, compiled
        self.device = token.device
        self.tokens = [token]

    def step(self) -> None:
        with torch.no_grad():
            if self.compiled is None:
                logits = self.model(self.token, past_key_values=self.cache).logits
            else:
                if self.device.type == "cuda":
                    torch.compiler.cudagraph_mark_step_begin()
                logits = self.compiled(self.token, torch.tensor([self.pos], device=self.device))
            self.token = logits[:, -1:].argmax(-1)
        self.pos += 1
        self.tokens.append(self.token)

    def timed(self, n: int) -> list[float]:
        times = []
        for _ in range(n):
            sync(self.device)
            start = time.perf_counter()
            self.step()
            sync(self.device)
            times.append(time.perf_counter() - start)
        return times

    def token_rows(self) -> list[list[int]]:
        return torch.cat(self.tokens, dim=1).tolist()


def measure(model, way: str, ids: torch.Tensor, args, compiled: bool) -> dict:
    """One way at one point: prefill, decode steps, a profile; the measured fields."""
    device, context = ids.device, ids.shape[1]
    max_len = context + args.warmup + args.steps + args.profile_steps + 8 if compiled else None
    reset_peak(device)
    cache = build_cache(model, way, max_len, args.attention_backend)
    sync(device)
    start = time.perf_counter()
    token = prefill(model, way, cache, ids, args.prefill_chunk)
    sync(device)
    out: dict = {"prefill_s": time.perf_counter() - start, "peak_prefill_bytes": peak(device)}
    step_fn = None
    if compiled:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        mode = args.compile_mode if args.compile_backend == "inductor" else None
        step_fn = torch.compile(
            lambda t, p: model(t, past_key_values=cache, cache_position=p).logits,
            backend=args.compile_backend,
            mode=mode,
            fullgraph=True,
        )
    reset_peak(device)
    decoder = Decoder(model, cache, token, context, step_fn)
    warm = decoder.timed(args.warmup)
    times = decoder.timed(args.steps)
    profiled = profile_steps(decoder.step, args.profile_steps, device)
    held, offloaded = cache_bytes(cache)
    out |= {
        "ms_per_token": statistics.median(times) * 1e3,
        "ms_all": [t * 1e3 for t in times],
        "first_step_s": warm[0] if warm else None,
        "peak_decode_bytes": peak(device),
        "kv_bytes": held,
        "offloaded_bytes": offloaded,
        "read_fraction": read_fraction(cache),
        **profiled,
        "tokens": decoder.token_rows(),
    }
    if compiled:
        out["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
        out["graph_breaks"] = sum(counters["graph_break"].values())
    return out


class StepClock(LogitsProcessor):
    """Records the time at every generation step (called once per forward), synchronising the device first."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.stamps = device, []

    def __call__(self, input_ids, scores):
        sync(self.device)
        self.stamps.append(time.perf_counter())
        return scores


def measure_generate(model, way: str, ids: torch.Tensor, args) -> dict:
    """``generate`` on ``PiKVCache(max_cache_len)`` with transformers' automatic compile, against the same eagerly."""
    from torch._dynamo.utils import counters

    device, new = ids.device, args.warmup + args.steps + 1
    max_len = ids.shape[1] + new + 8
    common = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        eager = model.generate(
            ids,
            past_key_values=build_cache(model, way, max_len, args.attention_backend),
            generation_config=GenerationConfig(disable_compile=True, **common),
        )
    gc.collect()
    if device.type == "cuda":  # transformers compiles by itself on CUDA: its default CompileConfig
        config = GenerationConfig(**common)
    else:  # elsewhere only when told to: the same path, forced
        compile_config = CompileConfig(backend=args.compile_backend, fullgraph=True, mode=None)
        compile_config._compile_all_devices = True
        config = GenerationConfig(compile_config=compile_config, **common)
    torch._dynamo.reset()
    counters.clear()
    clock = StepClock(device)
    reset_peak(device)
    with torch.no_grad():
        got = model.generate(
            ids,
            past_key_values=build_cache(model, way, max_len, args.attention_backend),
            generation_config=config,
            logits_processor=LogitsProcessorList([clock]),
        )
    steps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:], strict=False)][args.warmup :]
    return {
        "compiled_by_generate": hasattr(model, "_compiled_call"),
        "graph_breaks": sum(counters["graph_break"].values()),
        "graphs_compiled": counters["stats"]["unique_graphs"],
        "ms_per_token": statistics.median(steps) * 1e3,
        "peak_decode_bytes": peak(device),
        "tokens_equal_eager": bool(torch.equal(got, eager)),
        "tokens": got[:, ids.shape[1] :].tolist(),
    }


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def gpu_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def machine(device: torch.device) -> dict:
    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    info = {
        "device": "cpu",
        "processor": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "device": props.name,
            "memory_bytes": props.total_memory,
            "cuda": torch.version.cuda,
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
        }
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": version("triton"),
        "transformers": transformers.__version__,
        "kvpress": version("kvpress"),
        "pikv_hf": pikv_hf.__version__,  # from the source tree (PYTHONPATH=src on a GPU machine: not installed)
    }
    return {"machine": info, "versions": versions}


class Runner:
    """Runs the sections' jobs in order within the time budget and rewrites the JSON after every way."""

    def __init__(self, args, device: torch.device, dtype: torch.dtype, result: dict) -> None:
        self.args, self.device, self.dtype, self.result = args, device, dtype, result
        self.start = time.monotonic()
        self.deadline = self.start + args.budget_s  # of the running section: the budget less later sections' reserve
        self.model, self.model_key = None, None
        self.shapes = TINY_SHAPES if args.tiny else SHAPES

    def model_for(self, shape: str, layers: int):
        if self.model_key != (shape, layers):
            self.model = None
            free(self.device)
            self.model = self.shapes[shape].build(layers, self.device, self.dtype)
            self.model_key = (shape, layers)
        return self.model

    def write(self) -> None:
        self.result["elapsed_s"] = time.monotonic() - self.start
        self.result["tuned"] = tuned_choices()
        tmp = self.args.out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.result, indent=1))
        tmp.replace(self.args.out)

    def guarded(self, label: str, fn) -> dict:
        """``fn()``, or an ``error`` / ``skipped`` record; never raises (but KeyboardInterrupt)."""
        left = self.deadline - time.monotonic()
        if left < self.args.min_way_s:
            spent = time.monotonic() - self.start
            return {"skipped": f"time budget spent ({spent:.0f} of {self.args.budget_s:.0f} s, less later sections')"}
        signal.alarm(max(1, int(min(self.args.way_timeout, left))))
        start = time.perf_counter()
        try:
            rec = fn()
        except Timeout:
            rec = {"error": f"timeout after {time.perf_counter() - start:.0f} s"}
        except Exception as err:  # noqa: BLE001 - every failure is a result of the run
            rec = {"error": f"{type(err).__name__}: {err}"[:800], "trace": traceback.format_exc()[-2500:]}
        finally:
            signal.alarm(0)
        rec["wall_s"] = time.perf_counter() - start
        status = f"{rec['ms_per_token']:.2f} ms/token" if "ms_per_token" in rec else rec["error"].splitlines()[0]
        print(f"  {label}: {status} ({rec['wall_s']:.1f} s)", flush=True)
        torch._dynamo.reset()
        free(self.device)
        return rec

    def point(self, section: str, shape: str, layers: int, batch: int, ways: list[str], fn) -> None:
        ctx = self.args.context
        entry = {"shape": shape, "layers": layers, "batch": batch, "context": ctx, "results": {}}
        self.result[section].append(entry)
        print(f"{section}: {shape}, {layers} layers, {ctx} tokens x batch {batch}", flush=True)
        base = "dynamic" if section == "eager" else "static"
        for way in ways:

            def run(way=way):
                model = self.model_for(shape, layers)
                gen = torch.Generator().manual_seed(batch)
                ids = torch.randint(0, model.config.vocab_size, (batch, ctx), generator=gen).to(self.device)
                return fn(model, way, ids)

            rec = self.guarded(f"{section} {way}", run)
            ref = rec if way == base else entry["results"].get(base, {})
            if "ms_per_token" in rec and "ms_per_token" in ref:
                for field in (
                    "ms_per_token",
                    "kernels_per_step",
                    "busy_ms_per_step",
                    "peak_prefill_bytes",
                    "peak_decode_bytes",
                    "prefill_s",
                ):
                    if rec.get(field) is not None and ref.get(field):
                        rec[field.removesuffix("_per_token").removesuffix("_per_step") + "_ratio"] = (
                            rec[field] / ref[field]
                        )
                rec["tokens_equal_baseline"] = rec["tokens"] == ref["tokens"]
            entry["results"][way] = rec
            self.write()
        if self.model is not None:
            entry["weight_bytes"] = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.write()
        plot(self.result, self.args.out.with_suffix(".png"))


# --- the plot ------------------------------------------------------------------------------------------------


def plot(result: dict, path: Path) -> None:
    """ms/token over the section's baseline, one panel per point (ways that failed are labelled)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        result["plot"] = "matplotlib is not installed: no plot"
        return
    panels = [(s, p) for s in ("eager", "compiled") for p in result[s]]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 4), squeeze=False)
    for ax, (section, p) in zip(axes[0], panels, strict=True):
        names = list(p["results"])
        ratios = [p["results"][w].get("ms_ratio", 0.0) for w in names]
        ax.barh(names, ratios, color=["tab:gray" if r == 1.0 else "tab:blue" for r in ratios])
        for i, w in enumerate(names):
            if "ms_ratio" not in p["results"][w]:
                ax.text(0.02, i, "error" if "error" in p["results"][w] else "skipped", va="center", fontsize=7)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.invert_yaxis()
        base = "DynamicCache" if section == "eager" else "StaticCache compiled"
        ax.set_title(f"{section}: {p['shape']}\n{p['layers']} layers, {p['context']} x {p['batch']}", fontsize=8)
        ax.set_xlabel(f"ms/token / {base}", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(f"{result['machine']['device']}, git {result['git']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- main ----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU, fp32, aot_eager compile (seconds)")
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/gpu_<device>.json; --tiny: a temp)")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--layers", type=positive, help="decoder layers of the eager models (default 8; --tiny 2)")
    p.add_argument(
        "--compile-layers", type=positive, help="decoder layers of the compiled section (default 4; --tiny 2)"
    )
    p.add_argument("--context", type=positive, help="prompt tokens per row (default 32768; --tiny 256)")
    p.add_argument("--batches", type=positive, nargs="+", help="eager batch sizes (default 1 8; --tiny 1 2)")
    p.add_argument("--compile-batches", type=positive, nargs="+", help="compiled batch sizes (default 8; --tiny 2)")
    p.add_argument("--ways", nargs="+", choices=WAYS, default=WAYS, help="eager ways (dynamic is the baseline)")
    p.add_argument("--compiled-ways", nargs="+", choices=COMPILED_WAYS, default=COMPILED_WAYS)
    p.add_argument("--generate-ways", nargs="+", choices=WAYS[1:], default=["exact", "routed_1_8"])
    p.add_argument(
        "--sections", nargs="+", choices=["eager", "compiled", "generate"], default=["eager", "compiled", "generate"]
    )
    p.add_argument("--steps", type=positive, default=5, help="timed decode steps per way (default 5)")
    p.add_argument("--warmup", type=int, default=3, help="untimed decode steps first (default 3; compiled >= 3)")
    p.add_argument("--profile-steps", type=positive, default=2, help="profiled decode steps per way (default 2)")
    p.add_argument("--prefill-chunk", type=int, default=0, help="prefill in chunks of this many tokens (0: one)")
    p.add_argument("--compile-backend", help="torch.compile backend (default inductor; --tiny aot_eager)")
    p.add_argument("--compile-mode", default="reduce-overhead", help="inductor mode (default reduce-overhead)")
    p.add_argument("--budget-s", type=float, help="stop starting ways after this many seconds (default 330; tiny 600)")
    p.add_argument("--reserve-compiled", type=float, default=130, help="seconds the eager section leaves (default 130)")
    p.add_argument("--reserve-generate", type=float, default=40, help="seconds the sections before leave (default 40)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"], help="PiKVCache's")
    p.add_argument("--way-timeout", type=float, default=150, help="seconds one way may take (default 150)")
    p.add_argument("--min-way-s", type=float, default=10, help="skip a way with less than this left (default 10)")
    p.add_argument("--device", help="cuda (default when available) or cpu")
    args = p.parse_args(argv)
    tiny = args.tiny
    defaults = dict(
        layers=2 if tiny else 8,
        compile_layers=2 if tiny else 4,
        context=256 if tiny else 32768,
        batches=[1, 2] if tiny else [1, 8],
        compile_batches=[2] if tiny else [8],
        compile_backend="aot_eager" if tiny else "inductor",
        budget_s=600 if tiny else 330,
        device="cpu" if tiny or not torch.cuda.is_available() else "cuda",
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.warmup < 1 or args.steps < 1 or args.profile_steps < 1:
        p.error("--warmup, --steps and --profile-steps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" and not args.tiny else torch.float32
    meta = machine(device)
    if args.out is None:
        name = "gpu_tiny.json" if args.tiny else f"gpu_{gpu_slug(meta['machine']['device'])}.json"
        args.out = Path(tempfile.gettempdir()) / name if args.tiny else Path("benchmarks/results") / name
    args.out.parent.mkdir(parents=True, exist_ok=True)
    shapes = TINY_SHAPES if args.tiny else SHAPES
    result = {
        "benchmark": "gpu",
        "tiny": args.tiny,
        "command": " ".join(["python benchmarks/bench_gpu.py", *sys.argv[1:]]) if argv is None else "main()",
        "git": os.environ.get("PIKV_GIT") or git_revision(),
        **meta,
        "config": {
            "context": args.context,
            "dtype": str(dtype).removeprefix("torch."),
            "attention_implementation": "sdpa",
            "warmup": args.warmup,
            "steps": args.steps,
            "profile_steps": args.profile_steps,
            "prefill_chunk": args.prefill_chunk,
            "attention_backend": args.attention_backend,
            "compile": {
                "backend": args.compile_backend,
                "mode": args.compile_mode if args.compile_backend == "inductor" else None,
                "fullgraph": True,
            },
            "budget_s": args.budget_s,
            "shapes": {
                s: {**asdict(shapes[s]), "layers": args.layers, "compile_layers": args.compile_layers}
                for s in args.shapes
            },
            "ways": {
                w: {
                    "cache": None if MODES[w].cache is None else cache_options(w),
                    "presses": [type(p).__name__ for p in MODES[w].presses()],
                }
                for w in WAYS
            },
            "random_weights": True,
        },
        "eager": [],
        "compiled": [],
        "generate": [],
    }
    signal.signal(signal.SIGALRM, _alarm)
    runner = Runner(args, device, dtype, result)
    eager_ways = ["dynamic", *(w for w in args.ways if w != "dynamic")]
    reserve = {"eager": args.reserve_compiled + args.reserve_generate, "compiled": args.reserve_generate}
    if "eager" in args.sections:
        runner.deadline = runner.start + args.budget_s - reserve["eager"]
        for shape in args.shapes:
            for batch in args.batches:
                runner.point(
                    "eager",
                    shape,
                    args.layers,
                    batch,
                    eager_ways,
                    lambda m, w, ids: measure(m, w, ids, args, compiled=False),
                )
    compiled_ways = ["static", *(w for w in args.compiled_ways if w != "static")]
    if "compiled" in args.sections:
        runner.deadline = runner.start + args.budget_s - reserve["compiled"]
        for batch in args.compile_batches:
            runner.point(
                "compiled",
                args.shapes[0],
                args.compile_layers,
                batch,
                compiled_ways,
                lambda m, w, ids: measure(m, w, ids, args, compiled=True),
            )
    if "generate" in args.sections:
        runner.deadline = runner.start + args.budget_s
        runner.point(
            "generate",
            args.shapes[0],
            args.compile_layers,
            1,
            args.generate_ways,
            lambda m, w, ids: measure_generate(m, w, ids, args),
        )
    result["complete"] = True
    runner.write()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
