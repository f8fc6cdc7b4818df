"""Expert-sharded KV across G gloo ranks (G = 1, 2, 4, 8 on this machine): measured bytes per decode step and
per-rank KV bytes, against gathering the KV instead and against O(L/G) per-device memory.

For each G the script launches G ranks with ``torchrun`` (loopback only); every rank runs the same tiny-ish MoE
(Mixtral layout, 8 experts, 4 layers, 8 query / 2 KV heads of dim 32, fp32) on the same ``--context``-token prompt
with ``PiKVCache(router="expert", num_shards=8, partition=ShardPlan.for_ranks(8))``, then ``--steps`` greedy decode
steps. Measured per rank:

* ``kv_bytes``: ``cache.kv_nbytes()``, the K/V bytes its partition holds (pages allocated, page padding included);
* ``partial_bytes_per_step``: bytes of the tensors the rank handed to collectives per decode step (one
  ``[B, Hq, 1, Dv + 1]`` float32 partial per layer), and ``partial_sent_bytes_per_step`` = that x (G - 1), what an
  all-gather delivers to the other ranks;
* ``allgather_kv_sent_bytes_per_step``: the alternative of gathering the KV to attend locally: every rank's KV
  must reach the G - 1 others at every step (the rank's measured ``kv_bytes`` x (G - 1)).

The O(L/G) line is the G = 1 KV bytes divided by G. Decode logits of every G are compared with G = 1. Times are
recorded but are not the point (8 processes share 2 cores). With more than one GPU the multi-device path of one
process (``ShardPlan.for_devices`` over the GPUs) is also run and compared with one GPU; otherwise the JSON says it
was not exercised.

    python benchmarks/bench_distributed.py --ranks 1 2 4 8 --context 4096 --steps 16 \\
        --out benchmarks/results/distributed_gloo_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_cache import positive, run_metadata, write_result

from pikv_hf import PiKVCache
from pikv_hf.distributed import ShardPlan, init_process_group
from pikv_hf.tiny import tiny_model

NUM_SHARDS = 8
ROUTERS = ("expert", "round_robin")  # the model's own experts (as routed, unbalanced) and balanced pages
MODEL = dict(
    num_local_experts=8,
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=16384,
)


def _prompt(context: int) -> torch.Tensor:
    return torch.randint(3, 256, (1, context), generator=torch.Generator().manual_seed(0))


def _decode(model, cache, ids: torch.Tensor, steps: int, on_prefilled=None) -> tuple[torch.Tensor, float, float]:
    """Greedy decode: ``(decode logits [steps, V], prefill seconds, decode seconds per step)``."""
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        t1 = time.perf_counter()
        if on_prefilled is not None:
            on_prefilled()
        logits = []
        for _ in range(steps):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
            logits.append(out.logits[0, -1])
        t2 = time.perf_counter()
    return torch.stack(logits), t1 - t0, (t2 - t1) / steps


def worker(args: argparse.Namespace) -> None:
    """One rank (launched by torchrun): decode with each placement router and write ``rank<r>.json`` /
    ``rank<r>.pt`` into ``--tmp``."""
    torch.set_num_threads(1)
    init_process_group(timeout=600)
    rank, g = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = tiny_model("mixtral", **MODEL)
    rows, logits = {}, {}
    for router in ROUTERS:
        plan = ShardPlan.for_ranks(NUM_SHARDS)
        cache = PiKVCache(model, router=router, num_shards=NUM_SHARDS, partition=plan)
        comm = cache.partition.comm  # None with one rank: nothing to exchange

        def counted(comm=comm) -> tuple[int, int]:
            return (0, 0) if comm is None else (comm.payload_bytes, comm.calls)

        mark: dict = {}

        def prefilled(mark=mark, counted=counted) -> None:
            mark["prefill"] = counted()

        logits[router], prefill_s, step_s = _decode(model, cache, _prompt(args.context), args.steps, prefilled)
        tokens = cache.tokens_per_shard()
        payload = (counted()[0] - mark["prefill"][0]) / args.steps
        rows[router] = {
            "rank": rank,
            "shards": plan.shards_of(rank),
            "tokens_stored": int(tokens.sum()),
            "kv_bytes": cache.kv_nbytes(),
            "meta_bytes": cache.meta_nbytes(),
            "collectives_per_step": (counted()[1] - mark["prefill"][1]) / args.steps,
            "partial_bytes_per_step": payload,
            "partial_sent_bytes_per_step": payload * (g - 1),
            "allgather_kv_sent_bytes_per_step": cache.kv_nbytes() * (g - 1),
            "prefill_s": prefill_s,
            "decode_step_ms": step_s * 1e3,
        }
    tmp = Path(args.tmp)
    (tmp / f"rank{rank}.json").write_text(json.dumps(rows))
    torch.save(logits, tmp / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(g: int, args: argparse.Namespace) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Run ``g`` ranks with torchrun; their rows and rank 0's decode logits (per router)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", f"--nproc-per-node={g}"]
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port()), __file__, "--worker"]
        cmd += ["--context", str(args.context), "--steps", str(args.steps), "--tmp", tmp]
        src = str(Path(__file__).resolve().parents[1] / "src")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
        subprocess.run(cmd, env=env, check=True)
        rows = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(g)]
        logits = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(g)]
    for router in ROUTERS:
        if any(not torch.equal(x[router], logits[0][router]) for x in logits):
            raise RuntimeError(f"G={g}, router {router}: ranks decoded different logits")
    return rows, logits[0]


def summarize(g: int, router: str, rows: list[dict], logits: torch.Tensor, base: torch.Tensor) -> dict:
    """One (G, router) point: per-rank KV (largest, mean), bytes per decode step, logits against the first G."""
    mine = [r[router] for r in rows]
    kv = [r["kv_bytes"] for r in mine]
    return {
        "world_size": g,
        "max_rank_kv_bytes": max(kv),
        "mean_rank_kv_bytes": sum(kv) / g,
        "total_kv_bytes": sum(kv),
        "partial_bytes_per_step": mine[0]["partial_bytes_per_step"],
        "partial_sent_bytes_per_step": mine[0]["partial_sent_bytes_per_step"],
        "allgather_kv_sent_bytes_per_step": sum(r["allgather_kv_sent_bytes_per_step"] for r in mine) / g,
        "max_abs_logit_diff_vs_first": float((logits - base).abs().max()),
        "ranks": mine,
    }


def multi_device(args: argparse.Namespace) -> dict:
    """One process, shards over every visible GPU, against one GPU (only with more than one GPU)."""
    n = torch.cuda.device_count()
    if n < 2:
        return {"exercised": False, "why": f"this machine has {n} CUDA device(s); the multi-device path needs 2+"}
    model = tiny_model("mixtral", **MODEL).to("cuda:0")
    ids = _prompt(args.context).to("cuda:0")
    ref, _, _ = _decode(model, PiKVCache(model, router="expert", num_shards=NUM_SHARDS), ids, args.steps)
    devices = [f"cuda:{i}" for i in range(n)]
    cache = PiKVCache(
        model, router="expert", num_shards=NUM_SHARDS, partition=ShardPlan.for_devices(NUM_SHARDS, devices)
    )
    got, prefill_s, step_s = _decode(model, cache, ids, args.steps)
    parts = cache.layers[-1].store.parts
    return {
        "exercised": True,
        "devices": devices,
        "max_abs_logit_diff_vs_one_gpu": float((got - ref).abs().max()),
        "kv_bytes_per_device_last_layer": {str(p.device): p.kv_nbytes() for p in parts},
        "prefill_s": prefill_s,
        "decode_step_ms": step_s * 1e3,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for router, style, colors in zip(ROUTERS, ("o", "s"), (("C0", "C1"), ("C2", "C3")), strict=True):
        rows = result["runs"][router]
        g = [r["world_size"] for r in rows]
        a.plot(
            g, [r["max_rank_kv_bytes"] / 2**20 for r in rows], style + "-", c=colors[0], label=f"{router}: largest rank"
        )
        a.plot(
            g, [r["mean_rank_kv_bytes"] / 2**20 for r in rows], style + "--", c=colors[1], label=f"{router}: mean rank"
        )
    rows = result["runs"][ROUTERS[0]]
    g = [r["world_size"] for r in rows]
    a.plot(g, [r["o_l_over_g_bytes"] / 2**20 for r in rows], "k:", label="O(L/G): KV at G=1 / G")
    a.axhline(rows[0]["total_kv_bytes"] / 2**20, color="grey", lw=0.8, label="replicated KV (every rank)")
    a.set(xlabel="ranks G", ylabel="KV MiB per rank", xscale="log", yscale="log")
    a.set_title(f"per-rank KV, L = {result['context']} tokens")
    many = [r for r in rows if r["world_size"] > 1]
    gm = [r["world_size"] for r in many]
    b.plot(gm, [r["partial_sent_bytes_per_step"] for r in many], "o-", label="partials (o, lse), measured")
    b.plot(gm, [r["allgather_kv_sent_bytes_per_step"] for r in many], "s-", label="all-gather the KV instead")
    b.set(xlabel="ranks G", ylabel="bytes sent per rank per decode step", xscale="log", yscale="log")
    b.set_title(f"communication per decode step ({ROUTERS[0]} placement)")
    for ax, ticks in ((a, g), (b, gm)):
        ax.set_xticks(ticks, [str(x) for x in ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.legend(fontsize=7)
    a.yaxis.set_major_formatter(ScalarFormatter())
    a.yaxis.set_minor_formatter(NullFormatter())
    a.set_yticks([0.5, 1, 2, 4, 8])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=positive, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--context", type=positive, default=4096)
    parser.add_argument("--steps", type=positive, default=16)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/distributed_gloo_cpu.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    runs: dict[str, list[dict]] = {router: [] for router in ROUTERS}
    base: dict[str, torch.Tensor] = {}
    for g in args.ranks:
        rows, logits = launch(g, args)
        for router in ROUTERS:
            base.setdefault(router, logits[router])
            run = summarize(g, router, rows, logits[router], base[router])
            runs[router].append(run)
            print(
                f"{router:>11} G={g}: KV per rank max {run['max_rank_kv_bytes'] / 2**20:.3f} MiB (mean "
                f"{run['mean_rank_kv_bytes'] / 2**20:.3f}); partials {run['partial_bytes_per_step']:.0f} B/step "
                f"handed to all_gather ({run['partial_sent_bytes_per_step']:.0f} B sent) vs all-gather KV "
                f"{run['allgather_kv_sent_bytes_per_step'] / 2**20:.3f} MiB/step; logits vs G={args.ranks[0]}: "
                f"{run['max_abs_logit_diff_vs_first']:.1e}"
            )
    for router_runs in runs.values():
        first = router_runs[0]
        for run in router_runs:
            run["o_l_over_g_bytes"] = first["total_kv_bytes"] / run["world_size"]
            run["max_rank_kv_over_o_l_over_g"] = run["max_rank_kv_bytes"] / run["o_l_over_g_bytes"]
            run["mean_rank_kv_over_o_l_over_g"] = run["mean_rank_kv_bytes"] / run["o_l_over_g_bytes"]
    result = {
        "benchmark": "distributed expert-sharded KV, gloo ranks on one machine",
        "model": {"arch": "mixtral", **MODEL, "dtype": "float32"},
        "num_shards": NUM_SHARDS,
        "routers": list(ROUTERS),
        "context": args.context,
        "decode_steps": args.steps,
        "runs": runs,
        "multi_device": multi_device(args),
        **run_metadata(threads=1),
    }
    write_result(args.out, result)
    plot(result, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
