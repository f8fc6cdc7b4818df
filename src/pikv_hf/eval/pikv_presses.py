"""pikv_hf's own presses in the evaluation harness: names, construction and DuoAttention's calibrated heads.

``--press pikv_h2o pikv_lru ...`` name the scheduling presses of :mod:`pikv_hf.presses` (``ratio`` is their
``compression_ratio``). ``pikv_duo_attention`` calibrates its head scores once per model on essay text that the
evaluation's haystacks do not start with (saved beside the run). ``pikv_h2o_offload_routed`` keeps H2O's share
resident, moves the rest to the CPU offload tier and then decodes with routed reads over both tiers (the read
options of the run: ``--selector --n-sink --window --dense-layers --mass-target``, with ``top_k_shards = shards / 4``
as the cap): nothing is lost, and a step reads back only the shards its query selects.

With ``--cache pikv`` a context is prefilled once into a PiKVCache while the attention hooks' calls are recorded
(:class:`pikv_hf.eval.points.PrefillRecord`); each press then acts on a ``fork()`` of that cache by replaying the
calls through its hook, which is what ``with press(model): model.model(context)`` would do (a press's hook reads only
its arguments and the cache).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from pikv_hf.config import ReadConfig
from pikv_hf.presses import (
    AdaKVPress,
    DuoAttentionPress,
    FlexGenPress,
    H2OPress,
    LRUPlusPress,
    LRUPress,
    StreamingLLMPress,
    calibrate_heads,
    load_heads,
    save_heads,
)

ROUTED_SUFFIX = "_offload_routed"
PIKV_PRESSES: dict[str, Callable] = {
    "pikv_h2o": lambda r, heads: H2OPress(r),
    "pikv_streaming_llm": lambda r, heads: StreamingLLMPress(r),
    "pikv_lru": lambda r, heads: LRUPress(r),
    "pikv_lru_plus": lambda r, heads: LRUPlusPress(r),
    "pikv_flexgen": lambda r, heads: FlexGenPress(r),
    "pikv_adakv": lambda r, heads: AdaKVPress(H2OPress(r)),
    "pikv_duo_attention": lambda r, heads: DuoAttentionPress(r, heads=heads),
    "pikv_h2o" + ROUTED_SUFFIX: lambda r, heads: H2OPress(r, offload="cpu"),
}
DUO_HEADS = "duo_heads.json"


def duo_heads(model, tokenizer, out: Path) -> str:
    """Path of the run's DuoAttention head scores, calibrated on 2048 tokens of the last essays if missing."""
    path = out / DUO_HEADS
    if path.is_file():
        load_heads(path, model)  # refuses scores of another model
        return str(path)
    from pikv_hf.eval.haystack import essay_sentences

    ids = tokenizer(" ".join(essay_sentences()[-300:]), return_tensors="pt").input_ids[:, -2048:]
    save_heads(calibrate_heads(model, ids), path)
    return str(path)


def build_pikv_press(name: str, ratio: float, heads: str | None = None):
    """The press behind ``name`` (one of ``PIKV_PRESSES``) at ``ratio``."""
    return PIKV_PRESSES[name](ratio, heads)


def routed_read(read: ReadConfig, num_shards: int) -> ReadConfig:
    """The routed read of an ``*_offload_routed`` point: the run's read options, ``top_k_shards`` a quarter of the
    shards (a cap when a mass target is set)."""
    return sparse_read(read, attention="routed", top_k_shards=max(1, num_shards // 4))


def sparse_read(read: ReadConfig, **fields) -> ReadConfig:
    """``read`` with ``fields`` replaced, reading sparsely from the first decode step when ``sparse_from`` was not
    set: an evaluation measures what a sparse read keeps, at any context length (a cache's default,
    ``pikv_hf.config.SPARSE_FROM``, reads densely where that is faster)."""
    sparse_from = 0 if read.sparse_from is None else read.sparse_from
    return dataclasses.replace(read, sparse_from=sparse_from, **fields)
