"""README's quickstart runs as written on the offline SmolLM2 (slow: ~1 min): its exact cache generates
DynamicCache's tokens, the routed cache reads part of the KV, Quest + 4-bit and H2O hold fewer bytes."""

import re
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_quickstart_runs_as_written():
    text = README.read_text()
    block = re.search(r"## Quickstart\n.*?```python\n(.*?)```", text, re.S).group(1)
    ns: dict = {}
    exec(compile(block, "README.md quickstart", "exec"), ns)
    model, ids, greedy = ns["model"], ns["ids"], ns["greedy"]
    want = model.generate(ids, past_key_values=DynamicCache(), **greedy)
    assert torch.equal(ns["exact_out"], want)
    assert 0 < ns["routed"].routing_stats()["overall"]["fraction_tokens_attended"] < 0.9
    full = ns["exact"].kv_nbytes()
    assert ns["quest"].kv_nbytes() < 0.6 * full and ns["small"].kv_nbytes() < 0.6 * full
