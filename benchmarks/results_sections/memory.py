"""Memory: ragged per-head budgets of the page store, peak memory of a long prefill, bytes held beyond K/V, and KV
sharded over ranks."""

from __future__ import annotations

from .framework import (
    BENCH,
    NA_READS,
    Body,
    Recorder,
    at,
    machine_text,
    makefile_command,
    row,
    table,
    verdict,
)

# -------------------------------------------------------------------------------------------------------- page store

STORE_RAGGED = f"{BENCH}/store_ragged_cpu.json"


def store_ragged(rec: Recorder) -> Body:
    """Ragged per-head budgets of the page store and the cost of an eviction."""
    p = STORE_RAGGED
    d = rec.load(p)
    mib = {
        "KV before the ragged eviction": "ragged.kv_bytes_before",
        "KV after": "ragged.kv_bytes_after",
        "kept tokens' K/V": "ragged.kept_token_bytes",
        "bound: kept + one partial page per (row, KV head, shard)": "ragged.bound_bytes",
        "DynamicCache with the same budgets (largest head's tokens)": "ragged.dynamic_cache_bytes_same_budgets",
    }
    rows = [[name, rec.fig("mib", at(p, key)) + " MiB"] for name, key in mib.items()]
    rows.append(["after over kept tokens' bytes", rec.fig("r3", at(p, "ragged.after_over_kept"))])
    rows.append(["evict half of every head: ms", rec.fig("ms", at(p, "evict_half.evict_half_ms"))])
    rows.append(["one exact decode attention: ms", rec.fig("ms", at(p, "evict_half.exact_decode_attention_ms"))])
    rows.append(["evict half over one attention", rec.fig("r2", at(p, "evict_half.evict_over_attention"))])
    t, ev = d["targets"], d["evict_half"]
    fast = ev["evict_over_attention"] <= t["evict_over_attention_max"]
    check = (
        f"Targets recorded in the JSON: KV after within the bound: {verdict(d['ragged']['after_within_bound'])}; "
        f"evict half <= {rec.fig('r2', at(p, 'targets.evict_over_attention_max'))}x one decode attention: "
        f"{verdict(fast)}."
    )
    c = d["config"]
    return Body(
        measured=(
            f"one layer holding {d['ragged']['context']} tokens keeps shares "
            f"{', '.join(map(str, d['ragged']['kept_share_per_head']))} of the tokens of its KV heads (random tokens "
            f"per head); allocated bytes against the kept tokens' bytes; and evicting half of every head's tokens "
            f"against one exact decode attention; {c['num_attention_heads']} query / {c['num_key_value_heads']} KV "
            f"heads, head_dim {c['head_dim']}, {c['shards']} shards, pages of {c['page_size']}, random keys"
        ),
        commands=[d["command"]],
        machine=machine_text(rec, p),
        reads=NA_READS,
        budget="ragged: per KV head (the shares above)",
        text=table(["measure", "value"], rows) + "\n\n" + check,
    )


# ------------------------------------------------------------------------------------------------- prefill memory

PREFILL_MEMORY = f"{BENCH}/prefill_memory_cpu.json"


def prefill_memory(rec: Recorder) -> Body:
    """Peak resident memory of a long prefill, every way of keeping the KV against DynamicCache."""
    p = PREFILL_MEMORY
    d = rec.load(p)
    rows = []
    for i, r in enumerate(d["results"]):
        k = f"results.{i}."
        rows.append(
            [r["way"]]
            + [rec.fig("mib", at(p, k + n)) for n in ("peak_over_baseline_bytes", "prefill_growth_bytes")]
            + [rec.fig("r3", at(p, k + "peak_over_dynamic"))]
            + [rec.fig("mib", at(p, k + n)) for n in ("kv_bytes", "offloaded_bytes", "meta_bytes", "model_bytes")]
        )
    header = ["way", "peak - baseline MiB", "growth during the prefill MiB", "peak over DynamicCache's", "KV MiB"]
    header += ["offloaded MiB", "metadata MiB", "model MiB"]
    bound = d["target_max"]
    worst = max(d["results"], key=lambda r: r["peak_over_dynamic"])
    judged = row(p, "results", "peak_over_dynamic", way=worst["way"])
    check = (
        f"Target recorded in the JSON: {d['target']}: the largest is {worst['way']}'s "
        f"{rec.fig('r3', judged)}, {verdict(rec.value(judged) <= bound)}."
    )
    c = d["config"]
    return Body(
        measured=(
            f"peak resident memory of a prefill of {c['batch']} rows of {c['context']} tokens of {c['model']} into "
            "every way of keeping the KV (bench_e2e's ways: DynamicCache, exact, routed, routed 1/8, Quest 1/8, "
            "4-bit, Quest + 4-bit, H2O + offload + routed), each in a fresh process with MALLOC_MMAP_THRESHOLD_ = "
            "1 MiB (live memory); the baseline is the process before the model was loaded"
        ),
        commands=[d["command"]],
        machine=machine_text(rec, p),
        reads=NA_READS,
        budget="the ways' own (H2O keeps half resident; 4-bit pages of 64 behind a 128-token window)",
        text=table(header, rows) + "\n\n" + check,
    )


# ------------------------------------------------------------------------------------------ bytes held beyond K/V

HELD_BYTES = f"{BENCH}/held_bytes_cpu.json"


def held_bytes(rec: Recorder) -> Body:
    """Tensor bytes every way's cache references beyond its K/V, in parts, against the fp16 KV."""
    p = HELD_BYTES
    d = rec.load(p)
    rows = []
    for i, pt in enumerate(d["points"]):
        k = f"points.{i}."
        fp16 = at(p, k + "fp16_kv_bytes")
        summaries = [at(p, k + n) for n in ("shard_stats_bytes", "page_bounds_bytes", "centroids_bytes")]
        share = [
            rec.fig("r3", *summaries, fp16, combine="sum_ratio"),
            rec.fig("r3", at(p, k + "meta_bytes"), *summaries[:2], fp16, combine="rest_ratio"),
            rec.fig("r3", at(p, k + "workspace_bytes"), fp16, combine="ratio"),
            rec.fig("r3", at(p, k + "other_bytes"), summaries[2], fp16, combine="rest_ratio"),
        ]
        rows.append([pt["shape"], pt["way"], rec.fig("r3", at(p, k + "read_fraction")),
                     rec.fig("r3", at(p, k + "beyond_kv_over_fp16")), *share, verdict(pt["met"])])  # fmt: skip
    header = ["shape", "way", "read", "beyond K/V (x fp16 KV)", "summaries", "other store metadata",
              "CPU workspace", "other"]  # fmt: skip
    s = d["shapes"]
    shapes = "; ".join(
        f"{name}: {v['layers']} layers, {v['query_heads']} query / {v['kv_heads']} KV heads of {v['head_dim']}, "
        f"{v['context']} tokens" for name, v in s.items()
    )  # fmt: skip
    return Body(
        measured=(
            f"every tensor storage a cache references (each once, `PiKVCache.held_nbytes`) after a prefill of random "
            f"tokens and {d['steps']} decode steps (sparse reads forced), less its K/V (resident and offloaded), over "
            f"the fp16 KV of the tokens held; bfloat16 random-weight models of these attention shapes ({shapes}); "
            "parts: the summaries a sparse read selects from, which grow with the shards or pages and not with the "
            "tokens (float32 key sums and squares of every shard in every store of a routed layer, Quest's key min / "
            "max of every page, the key-cluster placement's float32 centroids), the stores' other metadata "
            "(positions, valid bits, masks, page shard ids, page tables, shard token counts), the torch backend's "
            "CPU scratch (shared by the layers: gathers as large as one layer's read, and a 4-bit store's code "
            "conversion buffers, one code field's uint8 and float32; none on CUDA) and the rest "
            "(placement counts, read state). Routed at 4096 tokens: 256 shards' sums, squares and centroids are 3 x "
            "256 float32 vectors per KV head and layer against 4096 tokens' fp16 K and V, 0.19 of the KV whatever "
            "the read; at 32768 tokens an eighth of that. Quest: two bfloat16 vectors per page of 16, 1/16 of the KV"
        ),
        commands=d["commands"],
        machine=machine_text(rec, p),
        reads="routed: 64 (1/8: 32) of 256 key-cluster shards, mass target 0.97; Quest 1/8: 1/8 of the pages per KV "
        "head (the read column: fraction of the tokens a step attended)",
        budget="per KV head; 4-bit: pages of 64 behind a 128-token window; H2O: half of each head's tokens offloaded",
        text=table([*header, f"<= {d['goal_beyond_kv_over_fp16']} (issue 31)"], rows) + "\n\n" + HELD_NOTE,
    )


HELD_NOTE = (
    "These rows count the sink / recent-window slots a sparse read keeps per (row, KV head) under \"other\"; since "
    "db2f3ad `meta_nbytes` counts them (it left them out), so a new run moves them to \"other store metadata\". The "
    "totals beyond K/V do not change."
)


# ---------------------------------------------------------------------------------------------------- distributed

DISTRIBUTED = f"{BENCH}/distributed_gloo_cpu.json"


def distributed(rec: Recorder) -> Body:
    """Expert-sharded KV over gloo ranks: bytes per step and per-rank KV."""
    p = DISTRIBUTED
    d = rec.load(p)
    rows = []
    for router, runs in d["runs"].items():
        for i, r in enumerate(runs):
            k = f"runs.{router}.{i}."
            rows.append(
                [
                    router,
                    str(r["world_size"]),
                    rec.fig("kib", at(p, k + "max_rank_kv_bytes")),
                    rec.fig("r3", at(p, k + "max_rank_kv_over_o_l_over_g")),
                    rec.fig("int", at(p, k + "partial_bytes_per_step")),
                    rec.fig("int", at(p, k + "partial_sent_bytes_per_step")),
                    rec.fig("mib", at(p, k + "allgather_kv_sent_bytes_per_step")),
                    rec.fig("sci", at(p, k + "max_abs_logit_diff_vs_first")),
                ]
            )
    header = ["router", "ranks G", "max rank KV KiB", "max rank KV / (KV of G = 1 / G)", "partial B per rank and step"]
    header += ["partials sent B per step", "all-gather of the KV instead, MiB per step", "max abs logit diff vs G = 1"]
    md, m = d["multi_device"], d["model"]
    return Body(
        measured=(
            f"expert-sharded KV over G gloo ranks on one machine: a {m['arch']} with {m['num_local_experts']} experts, "
            f"{m['num_hidden_layers']} layers, {m['num_attention_heads']} query / {m['num_key_value_heads']} KV heads "
            f"of dim {m['head_dim']}, {m['dtype']}, {d['num_shards']} shards, {d['context']}-token prompt then "
            f"{d['decode_steps']} decode steps; bytes handed to collectives per step and per-rank KV. Multi-device "
            f"path exercised: {md['exercised']} ({md['why']})"
        ),
        commands=[makefile_command(rec, p)],
        machine=machine_text(rec, p),
        reads=NA_READS,
        budget="none (exact attention, partials merged by log-sum-exp)",
        text=table(header, rows),
    )
