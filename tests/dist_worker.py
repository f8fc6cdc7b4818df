"""One rank of the multi-process tests (``test_distributed_ranks.py``); launched by ``torchrun`` or with the same
environment variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).

    python tests/dist_worker.py SPEC.json

The spec names the cases to decode, an optional fault (``{"rank": r, "step": i, "kind": "kill" | "stall"}``) and
mismatched cache settings to try (``{"name": ..., "rank": r, "cache": {...}, "model": {...}}``). Each rank writes
``rank<r>.pt`` into ``spec["out"]``: per case the prefill and decode logits, its KV bytes, tokens per shard and the
bytes it handed to collectives, or the error a case raised (with the seconds from the faulty step's start).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from helpers import greedy_logits, prompt

from pikv_hf import PiKVCache
from pikv_hf.distributed import CollectiveError, ShardPlan, init_process_group
from pikv_hf.tiny import tiny_model

PROMPT_LEN, STEPS, PAGE_SIZE, NUM_SHARDS = 24, 50, 4, 4
MODES = {"exact": {}, "routed": dict(attention="routed", top_k_shards=2, n_sink=2, window=8, sparse_from=0)}


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows, the second left-padded by 5 tokens."""
    ids = prompt(PROMPT_LEN, batch=2, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    return ids, mask


def cache_for(model, mode: str, partition: ShardPlan | None = None, **overrides) -> PiKVCache:
    """The cache of a case: expert placement over the model's 4 experts, pages of 4, exact or routed reads."""
    kwargs = dict(router="expert", num_shards=NUM_SHARDS, page_size=PAGE_SIZE, **MODES[mode])
    return PiKVCache(model, partition=partition, **{**kwargs, **overrides})


def _fault_hook(fault: dict | None, rank: int, started: dict):
    def hook(step: int) -> None:
        if fault is None or step != fault["step"]:
            return
        started["t"] = time.monotonic()
        if rank == fault["rank"]:
            if fault["kind"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(600)  # stall: alive but never calls the next collective

    return hook


def main() -> None:
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    init_process_group(timeout=spec["timeout"])
    rank = torch.distributed.get_rank()
    ids, mask = inputs()
    results: dict = {}
    for arch, mode in spec["cases"]:
        model = tiny_model(arch)
        cache = cache_for(model, mode, ShardPlan.for_ranks(NUM_SHARDS, timeout=spec["timeout"]))
        started: dict = {}
        try:
            prefill, decoded = greedy_logits(
                model, ids, mask, cache, STEPS, _fault_hook(spec.get("fault"), rank, started)
            )
        except CollectiveError as err:
            results[f"{arch}/{mode}"] = {"error": str(err), "elapsed": time.monotonic() - started["t"]}
            break
        comm = cache.partition.comm
        results[f"{arch}/{mode}"] = {
            "prefill": prefill,
            "decode": decoded,
            "kv_nbytes": cache.kv_nbytes(),
            "tokens_per_shard": cache.tokens_per_shard(),
            "payload_bytes": comm.payload_bytes,
            "calls": comm.calls,
            "routing": cache.routing_stats()["overall"],
        }
    for bad in spec.get("mismatch", []):
        arch = spec["cases"][0][0]
        mine = rank == bad["rank"]
        model = tiny_model(arch, **(bad.get("model", {}) if mine else {}))
        try:
            cache_for(model, "exact", ShardPlan.for_ranks(NUM_SHARDS), **(bad.get("cache", {}) if mine else {}))
            results[bad["name"]] = {"error": None}
        except ValueError as err:
            results[bad["name"]] = {"error": str(err)}
    differ = spec.get("set_attention")  # every rank switches its reads, one rank with another budget
    if differ is not None:
        cache = cache_for(tiny_model(spec["cases"][0][0]), "exact", ShardPlan.for_ranks(NUM_SHARDS))
        try:
            cache.set_attention("routed", top_k_shards=differ["top_k_shards"] if rank == differ["rank"] else 2)
            results["set_attention"] = {"error": None, "read": cache.read.attention}
        except ValueError as err:
            results["set_attention"] = {"error": str(err), "read": cache.read.attention}
    torch.save(results, Path(spec["out"]) / f"rank{rank}.pt")
    sys.stdout.flush()
    if any("elapsed" in r for r in results.values()):
        os._exit(0)  # the process group lost a peer: tearing it down could block
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
