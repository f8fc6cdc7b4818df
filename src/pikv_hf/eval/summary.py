"""Aggregates of a run's prediction rows for ``metrics.json`` (per task and per point, the compression points'
bytes and errors, the protocol each point followed) and the score-vs-ratio plot."""

from __future__ import annotations

import os
from collections import defaultdict

from pikv_hf.eval.config import PIKV_MODES, EvalConfig
from pikv_hf.eval.pikv_presses import ROUTED_SUFFIX


def summarise(rows: list[dict]) -> dict:
    """Aggregate prediction rows into per-(press, ratio, length, task) and per-(press, ratio) mean scores.

    Parameters
    ----------
    rows : list of dict
        Rows with ``press``, ``ratio``, ``length``, ``task`` and ``score`` in [0, 1].

    Returns
    -------
    dict
        ``{"per_task": [...], "per_point": [...]}``; a point's score is the mean over all its samples (all tasks),
        as a percentage, with ``n`` samples.
    """
    per_task: dict[tuple, list[dict]] = defaultdict(list)
    per_point: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        per_task[(row["press"], row["ratio"], row["length"], row["task"])].append(row)
        per_point[(row["press"], row["ratio"])].append(row)
    return {
        "per_task": [
            {"press": p, "ratio": r, "length": n, "task": t, **_aggregate(v)}
            for (p, r, n, t), v in sorted(per_task.items())
        ],
        "per_point": [{"press": p, "ratio": r, **_aggregate(v)} for (p, r), v in sorted(per_point.items())],
    }


def _aggregate(rows: list[dict]) -> dict:
    """``n``, mean score in percent and, for routed / Quest rows, the mean fractions read and attended."""
    out = {"n": len(rows), "score": 100.0 * sum(r["score"] for r in rows) / len(rows)}
    for name in ("fraction_pages_read", "fraction_tokens_attended", "kv_read_vs_dense"):
        if all(name in r for r in rows):
            out[name] = sum(r[name] for r in rows) / len(rows)
    return out


def protocol(config: EvalConfig) -> dict:
    """Whether each point's KV selection saw the question, in words, for ``metrics.json``: ``query_aware`` is True,
    False or ``"mixed"`` (then ``query_aware_presses`` names the query-aware ones)."""
    aware = [p for p in config.presses if config.cache == "pikv" and (p in PIKV_MODES or p.endswith(ROUTED_SUFFIX))]
    agnostic = [p for p in config.presses if p != "none" and p not in aware]
    reads = (
        "query-aware sparse reads: the uncompressed context is kept (resident or offloaded); every decode step of the "
        "answer reads only the KV its own query selects (routed shards or Quest pages, plus sinks and recent window), "
        "per layer and KV head"
    )
    compressed = "query-agnostic: the context is prefilled (and compressed) before the question is seen"
    if aware and agnostic:
        return {
            "query_aware": "mixed",
            "query_aware_presses": aware,
            "protocol": f"mixed. {', '.join(aware)}: {reads}. The others: {compressed}",
        }
    if aware:
        return {"query_aware": True, "query_aware_presses": aware, "protocol": reads}
    return {"query_aware": False, "query_aware_presses": [], "protocol": compressed}


def compression_summary(rows: list[dict]) -> list[dict]:
    """Per compression point: mean KV bytes, reconstruction error, tokens kept per KV head and layer (mean over its
    rows), whether simulated, and that it is query-agnostic."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        if "kv_bytes" in row:
            groups[(row["press"], row["ratio"], row["length"])].append(row)
    out = []
    for (press, ratio, length), rs in sorted(groups.items()):
        errors = [r["reconstruction_error"] for r in rs if r.get("reconstruction_error")]
        kept = [r["kept_per_kv_head"] for r in rs]
        out.append(
            {
                "press": press,
                "ratio": ratio,
                "length": length,
                "n": len(rs),
                "kv_bytes": sum(r["kv_bytes"] for r in rs) / len(rs),
                "simulated": rs[0]["simulated"],
                "query_agnostic": True,
                "kept_per_kv_head": [round(sum(k[i] for k in kept) / len(kept), 2) for i in range(len(kept[0]))],
                "reconstruction_error": None
                if not errors
                else {side: sum(e[side] for e in errors) / len(errors) for side in ("keys", "values")},
            }
        )
    return out


def plot_score_vs_ratio(per_point: list[dict], path: str | os.PathLike, title: str) -> None:
    """Draw score vs compression ratio, one line per press; ``none`` as a horizontal reference line.

    Parameters
    ----------
    per_point : list of dict
        ``summarise(...)["per_point"]``.
    path : str or os.PathLike
        PNG file to write.
    title : str
        Figure title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    by_press: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for point in per_point:
        by_press[point["press"]].append((point["ratio"], point["score"]))
    for press, pts in sorted(by_press.items()):
        pts.sort()
        if press == "none":
            ax.axhline(pts[0][1], color="black", linestyle="--", label="no compression")
        else:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=press)
    ax.set_xlabel("compression ratio (fraction of context KV evicted)")
    ax.set_ylabel("score (%)")
    ax.set_ylim(-2, 102)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center right", framealpha=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
