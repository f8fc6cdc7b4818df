"""``pikv-hf eval``: arguments and entry point (heavy imports happen inside :func:`run`)."""

from __future__ import annotations

import argparse
import json

from pikv_hf.config import ReadConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``eval`` sub-command's arguments.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The sub-parser of ``pikv-hf eval``.
    """
    parser.add_argument("--suite", required=True, help="ruler (offline long-context suite) | longbench")
    parser.add_argument("--model", default="smollm2", help="smollm2 | smollm2-moe | PATH (save_pretrained dir)")
    parser.add_argument(
        "--press",
        nargs="+",
        default=["none"],
        help="none and/or kvpress presses (snapkv, expected_attention, ...); with --cache pikv: none, pikv_routed, "
        "pikv_quest; with either cache: compression specs NAME[@key=value,...] (quant, svd, lora, lora_plus, distill, "
        "chunk_pca, fastv_crop, channel_prune, pyramid, or quantized_cache for transformers' QuantizedCache), e.g. "
        "quant@bits=4,group_size=64",
    )
    parser.add_argument(
        "--ratio",
        nargs="+",
        type=float,
        default=[0.5],
        help="compression ratio(s) in [0, 1); for pikv_routed / pikv_quest the fraction of KV a decode step skips",
    )
    parser.add_argument("--cache", default="dynamic", help="dynamic (kvpress flow) | pikv (PiKVCache)")
    parser.add_argument(
        "--router", default="round_robin", help="PiKVCache router: round_robin | expert (MoE only) | key_cluster"
    )
    parser.add_argument("--num-shards", type=int, default=None, help="PiKVCache shards (default: experts, or 8)")
    parser.add_argument("--page-size", type=int, default=16, help="PiKVCache tokens per page")
    ReadConfig.add_arguments(parser)  # --selector --n-sink --window --dense-layers --mass-target
    parser.add_argument("--samples", type=int, default=20, help="samples per task, length, press and ratio")
    parser.add_argument(
        "--length", nargs="+", type=int, default=[2048], help="RULER prompt length(s); LongBench truncation length"
    )
    parser.add_argument(
        "--tasks", default=None, help="RULER tasks/groups (needle, all, ...) or LongBench datasets, comma-separated"
    )
    parser.add_argument("--longbench-dir", default=None, help="local LongBench JSONL directory (else the hub)")
    parser.add_argument("--num-experts", type=int, default=8, help="experts of smollm2-moe")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token of smollm2-moe")
    parser.add_argument(
        "--perplexity-context",
        type=int,
        default=0,
        help="also measure, per point, the perplexity of held-out essay text after a compressed context of this many "
        "tokens (0: off)",
    )
    parser.add_argument("--perplexity-tokens", type=int, default=256, help="tokens scored for the perplexity")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="output directory (resumable)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args: argparse.Namespace) -> int:
    """Run the evaluation described by ``args`` and print the per-point summary.

    Parameters
    ----------
    args : argparse.Namespace
        Parsed arguments of ``pikv-hf eval``.

    Returns
    -------
    int
        Process exit status (0). Bad arguments, unknown tasks, data that cannot be loaded and an ``--out`` holding
        another configuration's results raise :class:`pikv_hf.checks.CommandLineError` before anything is written.
    """
    from pikv_hf.checks import CommandLineError
    from pikv_hf.eval.compression import PressModelError
    from pikv_hf.eval.config import EvalConfig, resolve_inputs
    from pikv_hf.eval.haystack import LengthError
    from pikv_hf.eval.results import prepare_out
    from pikv_hf.eval.runner import run_eval

    tasks = ("needle" if args.suite == "ruler" else "all") if args.tasks is None else args.tasks
    try:
        config = EvalConfig(
            suite=args.suite,
            model=args.model,
            presses=list(args.press),
            ratios=list(args.ratio),
            out=args.out,
            cache=args.cache,
            router=args.router,
            num_shards=args.num_shards,
            page_size=args.page_size,
            read=ReadConfig(**ReadConfig.from_arguments(args)),
            samples=args.samples,
            lengths=list(args.length),
            tasks=tasks,
            seed=args.seed,
            num_experts=args.num_experts,
            top_k=args.top_k,
            longbench_dir=args.longbench_dir,
            perplexity_context=args.perplexity_context,
            perplexity_tokens=args.perplexity_tokens,
        )
        inputs = resolve_inputs(config)
        prepare_out(config)  # an --out of another configuration's results is refused here, as a bad argument
    except (ValueError, RuntimeError, OSError) as err:  # OSError: data files that cannot be read
        raise CommandLineError(str(err)) from err
    try:
        metrics = run_eval(config, progress=not args.no_progress, inputs=inputs)
    except (LengthError, PressModelError) as err:  # found once the model and tokenizer load, before any answer
        raise CommandLineError(str(err)) from err
    for point in metrics["per_point"]:
        print(json.dumps(point))
    print(f"wrote {args.out}/metrics.json ({metrics['n_rows']} samples, complete={metrics['complete']})")
    return 0
