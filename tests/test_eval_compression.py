"""Compression points of the evaluation harness on a tiny random Llama: both caches, QuantizedCache, bytes,
perplexity, bad specs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from fixtures.tiny_assets import save_tiny_model_dir

from pikv_hf.eval import compression
from pikv_hf.eval.runner import EvalConfig, load_model, run_eval

QUANT = "quant@bits=4,group_size=8,window=32"
POINTS = ["none", QUANT, "channel_prune@channel_ratio=0.5,window=32", "quantized_cache@nbits=4,q_group_size=16"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def _config(model_dir: str, out: Path, cache: str, presses: list[str]) -> EvalConfig:
    return EvalConfig(
        suite="ruler",
        model=model_dir,
        presses=presses,
        ratios=[0.5],
        out=str(out),
        cache=cache,
        samples=1,
        lengths=[512],
        tasks="niah_single_number,niah_single_word",
        perplexity_context=200,
        perplexity_tokens=40,
    )


def test_compression_points_on_both_caches_record_bytes_errors_and_perplexity(model_dir, tmp_path):
    metrics = {}
    for cache in ("dynamic", "pikv"):
        presses = POINTS + (["pyramid@compression_ratio=0.5"] if cache == "pikv" else [])
        metrics[cache] = run_eval(_config(model_dir, tmp_path / cache, cache, presses), progress=False)
        rows = [json.loads(line) for line in (tmp_path / cache / "predictions.jsonl").read_text().splitlines()]
        assert metrics[cache]["complete"] and len(rows) == 2 * len(presses)
        for row in rows:
            if row["press"] == "none":
                assert "kv_bytes" not in row
                continue
            assert row["query_agnostic"] is True and len(row["kept_per_kv_head"]) == 2  # layers
            assert row["simulated"] == (cache == "dynamic" and not row["press"].startswith("quantized_cache"))
            if row["press"].startswith(("quantized_cache", "pyramid")):
                assert row["reconstruction_error"] is None
            else:
                assert 0 < row["reconstruction_error"]["keys"] < 1
        saved = json.loads((tmp_path / cache / "metrics.json").read_text())
        assert saved["query_aware"] is False and {p["press"] for p in saved["per_length"]} == set(presses)
        assert (tmp_path / cache / "compression.png").read_bytes()[:4] == b"\x89PNG"
        ppl = {p["press"]: p for p in saved["perplexity"]}
        assert set(ppl) == set(presses) and all(p["tokens"] == 39 for p in ppl.values())
        assert ppl["none"]["perplexity"] == pytest.approx(math.exp(ppl["none"]["nll"] / 39), rel=1e-3)
    # the exact point agrees across caches; PiKVCache holds compressed bytes, the simulation does not
    none = {c: {p["press"]: p for p in metrics[c]["perplexity"]}["none"]["perplexity"] for c in metrics}
    assert none["dynamic"] == pytest.approx(none["pikv"], rel=1e-4)
    summary = {c: {(p["press"], p["length"]): p for p in metrics[c]["compression"]} for c in metrics}
    dense_bytes = summary["dynamic"][QUANT, 512]["kv_bytes"]
    assert summary["pikv"][QUANT, 512]["kv_bytes"] < dense_bytes / 2
    pyramid = summary["pikv"]["pyramid@compression_ratio=0.5", 512]["kept_per_kv_head"]
    assert pyramid[0] > pyramid[-1]  # the pyramid: more tokens kept in the first layer


def _continuation_nll(model, ids: torch.Tensor, context: int, hidden: tuple[int, int] | None = None) -> float:
    """Summed nll of ``ids[:, context + 1:]`` from one plain forward of the whole sequence; ``hidden``: the context
    positions ``[start, stop)`` that the continuation's queries may not see (the context itself attends causally, as
    in a prefill before eviction)."""
    n = ids.shape[1]
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    if hidden is not None:
        mask[context:, hidden[0] : hidden[1]] = False
    with torch.no_grad():
        logits = model(ids, attention_mask=mask[None, None]).logits[0, context:-1].float()
    return float(torch.nn.functional.cross_entropy(logits, ids[0, context + 1 :], reduction="sum"))


def test_perplexity_points_of_duo_attention_use_the_runs_heads(model_dir, tmp_path):
    """Both points equal a plain forward of the same tokens. DuoAttention at ratio 0.5 keeps 100 of the 200 context
    tokens per layer and row; with 2 KV heads one streaming head cannot drop 200 tokens (it keeps >= n_sink + 1), so
    both heads stream: each keeps the 4 sinks and the 96 most recent tokens, and the text cannot see positions 4..103.

    Whether evicting raises the nll is not a property of this random model: its predictions are near uniform (5.98
    nats per token against ln 400 = 5.99), and hiding other halves of the context moves the nll either way (measured
    on 39 tokens: +0.0175 for positions 4..103, +0.1002 for 0..99, -0.0613 for 100..199). So the direction and size
    are pinned by that independent forward instead: each point equals its own forward within 2e-4 (feeding the text
    one position late moves the none point by 4e-4), and the duo point's change, +0.0175, is 87x that (no eviction,
    or evicting another half, fails)."""
    context, tol = 200, 2e-4  # the points' nll are rounded to 4 decimals; they differ from these forwards by <= 3e-5
    metrics = run_eval(_config(model_dir, tmp_path, "pikv", ["none", "pikv_duo_attention"]), progress=False)
    ppl = {p["press"]: p for p in metrics["perplexity"]}
    assert set(ppl) == {"none", "pikv_duo_attention"} and ppl["pikv_duo_attention"]["ratio"] == 0.5
    model, tokenizer, _ = load_model(_config(model_dir, Path("unused"), "dynamic", ["none"]))
    ids = compression.held_out_ids(tokenizer, context + 40)  # the points' context and text
    full = _continuation_nll(model, ids, context)
    duo = _continuation_nll(model, ids, context, hidden=(4, context - 96))
    assert ppl["none"]["nll"] == pytest.approx(full, abs=tol)
    assert ppl["pikv_duo_attention"]["nll"] == pytest.approx(duo, abs=tol)
    assert abs(duo - full) > 20 * tol, (duo, full)  # the eviction is visible at this tolerance


def test_quantized_cache_bytes_are_its_packed_tensors(model_dir):
    model, _, _ = load_model(_config(model_dir, Path("unused"), "dynamic", ["none"]))
    gen = torch.Generator().manual_seed(0)
    layers = [(torch.randn(1, 2, 256, 16, generator=gen), torch.randn(1, 2, 256, 16, generator=gen))] * 2
    kv = compression.quantized_cache("quantized_cache@nbits=4,q_group_size=16", model, layers)
    n = 256 * 2 * 16
    packed = n // 2 + n // 16 * 2 * 4  # 4-bit codes, a float32 scale and shift per group of 16
    assert compression.tensor_nbytes(kv.layers[0]._quantized_keys) == packed
    assert compression.kv_bytes(kv) == 2 * 2 * packed  # layers x (keys, values); the residual is empty


@pytest.mark.parametrize(
    "spec, message",
    [
        ("quant@bits=3", "bits must be one of"),
        ("quant@bits", "settings must be key=value pairs"),
        ("quant@colour=red", "unexpected keyword argument 'colour'"),
        ("svd@rank=0", "rank must be an integer"),
        ("quantized_cache@nbits=8", "nbits must be 2 or 4"),
        ("quantized_cache@bits=4", "quantized_cache takes"),
    ],
)
def test_bad_compression_specs_fail_before_anything_is_written(model_dir, tmp_path, spec, message):
    with pytest.raises(ValueError, match=message):
        run_eval(_config(model_dir, tmp_path / "never", "pikv", ["none", spec]), progress=False)
    assert not (tmp_path / "never").exists()


def test_spec_names_match_the_press_registry():
    assert tuple(compression.compressors()) == compression.COMPRESSORS
    assert compression.parse_spec("quant@bits=4,group_size=64,window=128") == (
        "quant",
        {"bits": 4, "group_size": 64, "window": 128},
    )
    assert compression.is_compression("pyramid@compression_ratio=0.5") and not compression.is_compression("snapkv")
