"""Shards across processes: real gloo ranks on loopback, launched by torchrun (or directly for fault injection),
against the single-process cache computed here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dist_worker import MODES, NUM_SHARDS, STEPS, cache_for, inputs
from helpers import free_port, greedy_logits

from pikv_hf.tiny import tiny_model

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
ARCHS = ("mixtral", "qwen3_moe")
CASES = [(a, m) for a in ARCHS for m in MODES]
TOL = 1e-5
LAUNCH_LIMIT_S = 240


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(SRC), str(TESTS), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", **extra}


def _spec(tmp_path: Path, **fields) -> Path:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"out": str(tmp_path), **fields}))
    return path


def _results(tmp_path: Path, world: int) -> list[dict]:
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


_REFERENCE: dict = {}


def _reference(arch: str, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Prefill / decode logits, tokens per shard and KV bytes of the single-process cache (no partition)."""
    if (arch, mode) not in _REFERENCE:
        model = tiny_model(arch)
        cache = cache_for(model, mode)
        ids, mask = inputs()
        logits = greedy_logits(model, ids, mask, cache, STEPS)
        _REFERENCE[arch, mode] = (*logits, cache.tokens_per_shard(), cache.kv_nbytes())
    return _REFERENCE[arch, mode]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks on 2 cores: 45 s, slow
def test_ranks_match_single_process_prefill_and_50_decode_steps(tmp_path, world):
    port = free_port()
    mismatch = [
        {"name": "page_size", "rank": 1, "cache": {"page_size": 8}},
        {"name": "model", "rank": world - 1, "model": {"rms_norm_eps": 1e-3}},
    ]
    spec = _spec(tmp_path, cases=CASES, timeout=60, mismatch=mismatch, set_attention={"rank": 1, "top_k_shards": 1})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", f"--nproc-per-node={world}"]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port), str(TESTS / "dist_worker.py"), str(spec)]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    refs = {case: _reference(*case) for case in CASES}  # computed while the ranks run
    out, _ = proc.communicate(timeout=LAUNCH_LIMIT_S)
    assert proc.returncode == 0, out[-4000:]
    ranks = _results(tmp_path, world)
    per_rank = NUM_SHARDS // world
    for arch, mode in CASES:
        prefill_ref, decode_ref, tokens_ref, kv_ref = refs[arch, mode]
        got = [r[f"{arch}/{mode}"] for r in ranks]
        for r, g in enumerate(got):
            assert (g["prefill"] - prefill_ref).abs().max() < TOL, (arch, mode, r)
            assert g["decode"].shape == (STEPS, 2, 256)
            assert (g["decode"] - decode_ref).abs().max() < TOL, (arch, mode, r)
            assert torch.equal(g["decode"], got[0]["decode"])  # every rank merges the same partials
            # rank r stores exactly the tokens of its block of shards
            mine = torch.zeros(NUM_SHARDS, dtype=torch.bool)
            mine[r * per_rank : (r + 1) * per_rank] = True
            assert torch.equal(g["tokens_per_shard"][:, mine], tokens_ref[:, mine])
            assert int(g["tokens_per_shard"][:, ~mine].sum()) == 0
            # and allocates K/V pages for them only: at least its tokens' bytes, less than the whole cache's
            token_bytes = (16 + 16) * 4
            assert int(g["tokens_per_shard"].sum()) * token_bytes <= g["kv_nbytes"] < kv_ref
            # one all-gather of [B, Hq, q, Dv + 1] floats per layer and forward: prefill + 50 steps
            layers, hq, dv = 3, 4, 16
            assert g["calls"] == layers * (STEPS + 1)
            assert g["payload_bytes"] == layers * 2 * hq * (dv + 1) * 4 * (inputs()[0].shape[1] + STEPS)
    # routed reads are not exact attention: the reference differs from exact, and the ranks still match it
    for arch in ARCHS:
        assert (refs[arch, "routed"][1] - refs[arch, "exact"][1]).abs().max() > 1e-3
        assert all(r[f"{arch}/routed"]["routing"]["fraction_tokens_attended"] < 1 for r in ranks)
    for r, res in enumerate(ranks):
        assert (
            "page_size: '4' on ranks" in res["page_size"]["error"] and "'8' on ranks [1]" in res["page_size"]["error"]
        )
        assert "model config (digest)" in res["model"]["error"], res["model"]["error"]
        assert f"rank {r} of {world}" in res["model"]["error"]
        # set_attention with settings that differ between ranks: refused everywhere (ranks merged partials of two
        # read policies before), every rank's read unchanged
        assert "read.top_k_shards: '2' on ranks" in res["set_attention"]["error"], res["set_attention"]
        assert res["set_attention"]["read"] == "exact"


@pytest.mark.parametrize("kind", ["kill", "stall"])
def test_dead_or_stuck_rank_fails_the_others_within_the_timeout(tmp_path, kind):
    world, timeout, victim, step = 2, 8.0, 1, 5
    spec = _spec(
        tmp_path, cases=[("mixtral", "exact")], timeout=timeout, fault={"rank": victim, "step": step, "kind": kind}
    )
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(TESTS / "dist_worker.py"), str(spec)],
            env=_env(RANK=str(r), WORLD_SIZE=str(world), MASTER_PORT=port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    start = time.monotonic()
    try:
        for r in range(world):
            if r != victim:
                out, _ = procs[r].communicate(timeout=LAUNCH_LIMIT_S)
                assert procs[r].returncode == 0, out[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert time.monotonic() - start < LAUNCH_LIMIT_S
    for r in range(world):
        if r == victim:
            continue
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)["mixtral/exact"]
        message = res["error"]
        assert "all_gather of attention partials of layer 0" in message, message
        assert f"on rank {r} of {world}" in message and f"collective timeout {timeout:g} s" in message
        assert res["elapsed"] < timeout + 2.0, res
        if kind == "stall":
            assert "timed out" in message.lower() and res["elapsed"] > timeout - 1.0, res
