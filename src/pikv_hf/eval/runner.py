"""Generation loop of the evaluation harness: models, presses, caches, resumable predictions, metrics and plots.

Protocol (query-agnostic, as kvpress's pipeline): the context is prefilled alone (under ``with press(model):`` when
a kvpress press is given, which compresses the cache), then the question and answer prefix are fed with explicit
positions after the original context length and the answer is decoded greedily. With ``cache="pikv"`` the context
is prefilled once into an exact ``PiKVCache``; every point (``none`` = exact attention, ``pikv_routed``,
``pikv_quest``) then decodes from its own ``fork()`` of that cache. Routed and Quest attention only change decode
steps, so they are query-aware sparse *reads* of an uncompressed cache: nothing is evicted, and the ratio is the
fraction of KV pages a decode step does not read (``1 - k / num_shards`` for routed, ``1 - read_fraction`` for
Quest); each row also records the fraction actually read.

Compression points (``quant@bits=4``, ``svd@rank=32``, ..., ``quantized_cache@nbits=4``; see
:mod:`pikv_hf.eval.compression`) run with either cache: the context's uncompressed prefill is recorded once and each
point compresses a copy of its cache (a ``fork()`` of the PiKVCache, or a copy of the DynamicCache) by replaying the
press's prefill hooks; the answer is decoded inside the press's context, so a compressor keeps moving tokens out of
its window. Each compression row records the KV bytes held, the tokens kept per KV head and layer, the press's
reconstruction error on the context's exact KV (for the first sample of each task) and that it is query-agnostic.
``perplexity_context`` adds the perplexity of held-out essay text after a compressed context, per point
(``perplexity.jsonl``).

Results: ``predictions.jsonl`` gets one line per finished sample (flushed and fsynced), so an interrupted run
resumes where it stopped; ``metrics.json`` aggregates them with library versions, git commit, seed and arguments;
``score_vs_ratio.png`` is drawn when several ratios were run.

Modules: :mod:`~pikv_hf.eval.config` (``EvalConfig``, press names, tasks), :mod:`~pikv_hf.eval.generation` (model,
prompt, prefill, greedy answer), :mod:`~pikv_hf.eval.points` (the cache of every point), :mod:`~pikv_hf.eval.results`
(output files), :mod:`~pikv_hf.eval.summary` (aggregates and plot); this one runs the loops.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pikv_hf.eval.config import EvalConfig, press_names, resolve_inputs
from pikv_hf.eval.generation import PromptBuilder, answer_in_press, eos_token_ids, load_model, press_context
from pikv_hf.eval.haystack import LengthError
from pikv_hf.eval.pikv_presses import duo_heads
from pikv_hf.eval.points import PointCaches
from pikv_hf.eval.results import (
    COMPRESSION_PLOT,
    METRICS,
    PERPLEXITY,
    PLOT_NAME,
    PREDICTIONS,
    append_row,
    git_commit,
    prepare_out,
    read_json,
    read_predictions,
    row_key,
    versions,
)
from pikv_hf.eval.summary import compression_summary, plot_score_vs_ratio, protocol, summarise


def _iter_samples(config: EvalConfig, tasks: list[str]) -> Iterator[tuple[int, int, str]]:
    # sample index outermost, so every (press, ratio) point has about the same number of samples at any time
    for index in range(config.samples):
        for length in config.lengths:
            for task in tasks:
                yield index, length, task


def _duo_heads(config: EvalConfig, model, tokenizer, out: Path) -> str | None:
    """The run's DuoAttention head scores (calibrated once, saved in ``out``) when it evaluates that press."""
    return duo_heads(model, tokenizer, out) if "pikv_duo_attention" in config.presses else None


def _perplexity_rows(config: EvalConfig, points, path: Path, model_and_tokenizer) -> list[dict]:
    """Perplexity of ``perplexity_tokens`` held-out essay tokens after a compressed held-out context of
    ``perplexity_context`` tokens, per point (resumable: one line per point and setting in ``path``: rows of other
    context or scored lengths stay there unread); [] when off."""
    if not config.perplexity_context:
        return []
    from pikv_hf.eval import compression

    context, scored = config.perplexity_context, config.perplexity_tokens - 1  # the first target is not scored
    done = {
        (r["press"], r["ratio"]): r
        for r in read_predictions(path, field="press")
        if r["context_tokens"] == context and r["tokens"] == scored
    }
    pending = [(p, r) for p, r in points if (p, r) not in done]
    if pending:
        model, tokenizer, _ = model_and_tokenizer()
        ids = compression.held_out_ids(tokenizer, context + config.perplexity_tokens)
        heads = _duo_heads(config, model, tokenizer, path.parent)
        caches = PointCaches(model, config, ids[:, :context], heads=heads, errors=False)
        with path.open("a", encoding="utf-8") as handle:
            for press_name, ratio in pending:
                kv, press, info = caches.make(press_name, ratio)
                with press_context(model, press):
                    nll, count = compression.continuation_nll(model, kv, ids[:, context:], context)
                row = {
                    "press": press_name,
                    "ratio": ratio,
                    "context_tokens": context,
                    "tokens": count,
                    "nll": round(nll, 4),
                    "perplexity": round(compression.perplexity_of(nll, count), 4),
                    **{k: v for k, v in info.items() if k in ("kv_bytes", "simulated", "kept_per_kv_head")},
                }
                append_row(handle, row)
                done[(press_name, ratio)] = row
    return [done[p] for p in points]


class _OnceFilter(logging.Filter):
    """Let each distinct log message through once (kvpress warns on every ``with press(model)`` for Mixtral)."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


def _warn_once(logger: logging.Logger) -> None:
    if not any(isinstance(f, _OnceFilter) for f in logger.filters):
        logger.addFilter(_OnceFilter())


def _query_windows(points: list[tuple[str, float]]) -> dict[str, int]:
    """The windows of the points' kvpress presses that score keys from a window of the last queries (the SnapKV
    family, which asserts that a context is longer than its window)."""
    import kvpress

    names = press_names()
    presses = {p: getattr(kvpress, names[p]) for p, _ in points if p in names}
    return {p: cls().window_size for p, cls in presses.items() if issubclass(cls, kvpress.SnapKVPress)}


def _check_windows(windows: dict[str, int], context_tokens: int, where: str) -> None:
    """``LengthError`` for a context no longer than a press's query window (kvpress asserted on it mid-run)."""
    for press_name, window in windows.items():
        if context_tokens <= window:
            raise LengthError(
                f"{where}: the context has {context_tokens} tokens, not more than press {press_name!r}'s "
                f"window_size {window} (the queries it scores with): raise --length or leave the press out"
            )


def run_eval(config: EvalConfig, progress: bool = True, inputs: tuple[list[str], dict | None] | None = None) -> dict:
    """Run (or resume) an evaluation and write predictions, metrics and plot.

    Parameters
    ----------
    config : EvalConfig
        The run's arguments (validated here before anything is written).
    progress : bool
        Show a tqdm progress bar.
    inputs : tuple, optional
        :func:`resolve_inputs` of ``config``, when the caller has resolved them already.

    Returns
    -------
    dict
        The content written to ``metrics.json``.
    """
    tasks, lb_tasks = resolve_inputs(config) if inputs is None else inputs
    out = prepare_out(config)
    pred_path = out / PREDICTIONS
    done = {row["key"]: row for row in read_predictions(pred_path)}
    code = git_commit()  # this session's code: each row records it, so rows of a resumed run name theirs
    points = config.points()
    samples = [w for w in _iter_samples(config, tasks) if lb_tasks is None or w[0] < len(lb_tasks[w[2]])]
    wanted = {row_key(p, r, n, t, i) for i, n, t in samples for p, r in points}
    pending = [(i, n, t) for i, n, t in samples if any(row_key(p, r, n, t, i) not in done for p, r in points)]
    n_pending = sum(row_key(p, r, n, t, i) not in done for i, n, t in samples for p, r in points)

    import torch
    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging

    from pikv_hf.eval import compression, longbench
    from pikv_hf.eval.ruler import MAX_NEW_TOKENS

    torch.manual_seed(config.seed)
    hf_logging.disable_progress_bar()
    _warn_once(logging.getLogger("kvpress.presses.base_press"))
    previous = out / METRICS
    model_info: dict[str, Any] = read_json(previous).get("model_info", {}) if previous.is_file() else {}
    loaded: list = []

    def model_and_tokenizer():
        if not loaded:
            loaded.extend(load_model(config))
        return loaded

    if pending:
        model, tokenizer, model_info = model_and_tokenizer()
        builder = PromptBuilder(tokenizer)
        eos_ids = eos_token_ids(model, tokenizer)
        windows = _query_windows(points)
        if config.suite == "ruler":
            from pikv_hf.eval.haystack import Haystack
            from pikv_hf.eval.ruler import generate_sample, score_sample

            haystack = Haystack(builder.count)
            for task, length in sorted({(t, n) for _, n, t in pending}):  # a length a task cannot be built at is
                probe = generate_sample(task, 0, length, config.seed, haystack, builder.reserve())  # refused before
                context = builder.build(probe.context, probe.question, probe.answer_prefix)[0]  # any answer
                _check_windows(windows, int(context.shape[1]), f"task {task} at length {length}")
        else:  # every pending prompt built now: a context a press cannot take is refused before any answer
            examples = {
                (index, length, task): longbench.build_example(lb_tasks[task][index], task, builder, length)
                for index, length, task in pending
            }
            for (index, length, task), example in examples.items():
                _check_windows(windows, int(example["ids"][0].shape[1]), f"{task} sample {index} at length {length}")
        compression.check_on_model([press for press, _ in points], model)  # before any answer, as the lengths
        if config.perplexity_context:
            compression.held_out_ids(tokenizer, config.perplexity_context + config.perplexity_tokens)
        heads = _duo_heads(config, model, tokenizer, out)
        # shown unless progress is off; then tqdm's own settings apply (TQDM_DISABLE=1 hides it too)
        hide = {} if progress else {"disable": True}
        bar = tqdm(total=n_pending, desc=f"eval {config.suite} {config.model}", unit="answer", **hide)
        with pred_path.open("a", encoding="utf-8") as handle:
            for index, length, task in pending:
                if config.suite == "ruler":
                    sample = generate_sample(task, index, length, config.seed, haystack, builder.reserve())
                    record = sample.to_dict()
                    ctx_ids, q_ids = builder.build(sample.context, sample.question, sample.answer_prefix)
                    max_new = MAX_NEW_TOKENS[task]
                else:
                    example = examples[index, length, task]
                    record, (ctx_ids, q_ids), max_new = example["record"], example["ids"], example["max_new_tokens"]
                # reconstruction errors: first sample per task
                caches = PointCaches(model, config, ctx_ids, heads=heads, errors=index == 0)
                for press_name, ratio in points:
                    key = row_key(press_name, ratio, length, task, index)
                    if key in done:
                        continue
                    started = time.perf_counter()
                    kv, press, read = caches.make(press_name, ratio)
                    if compression.is_compression(press_name):
                        kept = round(sum(read["kept_per_kv_head"]) / len(read["kept_per_kv_head"]))
                    elif config.cache == "pikv":  # mean resident tokens per layer and KV head
                        kept = round(float(kv.resident_tokens().float().mean()), 1)
                    else:
                        kept = int(kv.layers[0].keys.shape[-2])
                    generated = answer_in_press(model, press, kv, ctx_ids, q_ids, max_new, eos_ids)
                    if config.cache == "pikv" and not compression.is_compression(press_name) and kv.read.sparse:
                        stats = kv.routing_stats()["overall"]
                        read = {
                            "fraction_pages_read": round(stats["fraction_pages_read"], 4),
                            "fraction_tokens_attended": round(stats["fraction_tokens_attended"], 4),
                            "kv_read_vs_dense": round(stats["kv_read_vs_dense"], 4),
                        }
                    seconds = time.perf_counter() - started
                    prediction = tokenizer.decode(generated, skip_special_tokens=True)
                    if config.suite == "ruler":
                        score = score_sample(record, prediction)
                    else:
                        score = longbench.score_example(task, prediction, record["answers"], record["all_classes"])
                    row = {
                        "key": key,
                        "press": press_name,
                        "ratio": ratio,
                        "length": length,
                        "task": task,
                        "index": index,
                        "input_tokens": int(ctx_ids.shape[1] + q_ids.shape[1]),
                        "context_tokens": int(ctx_ids.shape[1]),
                        "kept_context_tokens": kept,
                        "prediction": prediction,
                        "answers": record["answers"],
                        "score": score,
                        "seconds": round(seconds, 3),
                        "depths": record.get("depths", []),
                        "git": code["commit"],
                        **read,
                    }
                    append_row(handle, row)
                    done[key] = row
                    bar.update(1)
                    bar.set_postfix(task=task, press=press_name, ratio=ratio, score=f"{score:.2f}")
        bar.close()
    perplexity = _perplexity_rows(config, points, out / PERPLEXITY, model_and_tokenizer)
    if loaded:
        model_info = loaded[2]
    rows = [row for key, row in done.items() if key in wanted]
    summary = summarise(rows)
    metrics = {
        "suite": config.suite,
        **protocol(config),
        "budget_note": "ratio = fraction of context KV pairs evicted per KV head per layer (kvpress compression_ratio)",
        "tasks": tasks,
        "arguments": dataclasses.asdict(config),
        "model_info": model_info,
        "seed": config.seed,
        "versions": versions(),
        "git": code,
        # rows per commit they were answered at (a resumed run holds rows of earlier code; None: not recorded)
        "row_commits": dict(Counter(r.get("git") for r in rows).most_common()),
        "command": " ".join(sys.argv),
        "complete": len(rows) == len(wanted),
        "n_rows": len(rows),
        "mean_seconds_per_sample": (sum(r["seconds"] for r in rows) / len(rows)) if rows else None,
        **summary,
    }
    if any(compression.is_compression(p) for p in config.presses) or perplexity:
        metrics["per_length"] = compression.per_length(rows)
        metrics["compression"] = compression_summary(rows)
        metrics["perplexity"] = perplexity
    (out / METRICS).write_text(json.dumps(metrics, indent=2) + "\n")
    if "per_length" in metrics:
        title = f"{config.suite} {config.model}, {config.cache} cache ({', '.join(tasks)})"
        compression.plot(metrics["per_length"], perplexity, out / COMPRESSION_PLOT, title)
    if len({p["ratio"] for p in summary["per_point"] if p["press"] != "none"}) > 1:
        plot_score_vs_ratio(
            summary["per_point"], out / PLOT_NAME, f"{config.suite} {config.model} ({', '.join(tasks)})"
        )
    return metrics
