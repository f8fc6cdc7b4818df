"""The harness on the real SmolLM2 (slow): needle retrieval without compression, replay equals kvpress's flow."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


def test_needle_retrieval_at_1k_without_compression(tmp_path):
    from pikv_hf.eval.config import EvalConfig
    from pikv_hf.eval.runner import run_eval

    metrics = run_eval(
        EvalConfig(
            suite="ruler",
            model="smollm2",
            presses=["none"],
            ratios=[0.5],
            out=str(tmp_path),
            samples=3,
            lengths=[1024],
            tasks="niah_single_number",
        ),
        progress=False,
    )
    assert metrics["per_point"][0]["score"] == 100.0


def test_replayed_prefill_equals_kvpress_flow_on_smollm2():
    from pikv_hf.eval.config import build_press
    from pikv_hf.eval.generation import PromptBuilder, prefill
    from pikv_hf.eval.haystack import Haystack
    from pikv_hf.eval.points import PrefillRecord
    from pikv_hf.eval.ruler import generate_sample
    from pikv_hf.models import load_smollm2

    model, tok = load_smollm2()
    builder = PromptBuilder(tok)
    sample = generate_sample("niah_single_number", 0, 1024, 0, Haystack(builder.count), builder.reserve())
    context, _ = builder.build(sample.context, sample.question, sample.answer_prefix)
    record = PrefillRecord(model, context)
    for name in ("expected_attention", "snapkv"):
        replayed = record.compressed_cache(build_press(name, 0.5))
        real = prefill(model, context, build_press(name, 0.5))
        assert all(torch.equal(a.keys, b.keys) for a, b in zip(replayed.layers, real.layers, strict=True))
