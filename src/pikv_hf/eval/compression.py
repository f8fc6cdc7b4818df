"""Compression points of the evaluation harness: compressor presses (``quant@bits=4``), transformers'
``QuantizedCache`` baseline (``quantized_cache@nbits=4``), their bytes, and perplexity on held-out essay text.

A point is named by a spec ``NAME[@key=value,...]``: ``NAME`` one of :data:`COMPRESSORS` (a PiKV compressor press,
its dataclass fields as keys) or ``quantized_cache`` (``QuantizedCache(backend="quanto")``, keys ``nbits``,
``q_group_size``, ``residual_length``). Such points run once each (at ratio 0) with ``--cache pikv`` (real
compressed storage: the bytes are ``cache.kv_nbytes()``) or ``--cache dynamic`` (kvpress's simulated compression:
the bytes are those of the uncompressed tensors). ``QuantizedCache`` is filled from the context's exact KV (one
``update`` per layer, as its prefill would) and its bytes are those of its quantised tensors plus residual.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from pikv_hf.checks import check_int_at_least

QUANTIZED_CACHE = "quantized_cache"
QUANTIZED_CACHE_DEFAULTS = {"nbits": 4, "q_group_size": 64, "residual_length": 128}


def compressors() -> dict:
    """Spec name -> press class."""
    from pikv_hf import presses

    return {
        "quant": presses.QuantPress,
        "svd": presses.SVDPress,
        "lora": presses.LoRAPress,
        "lora_plus": presses.LoRAPlusPress,
        "distill": presses.DistillPress,
        "chunk_pca": presses.ChunkPCAPress,
        "fastv_crop": presses.FastVCropPress,
        "channel_prune": presses.ChannelPrunePress,
        "pyramid": presses.PyramidPress,
    }


COMPRESSORS = ("quant", "svd", "lora", "lora_plus", "distill", "chunk_pca", "fastv_crop", "channel_prune", "pyramid")


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_spec(spec: str) -> tuple[str, dict]:
    """``"quant@bits=4,group_size=64"`` -> ``("quant", {"bits": 4, "group_size": 64})``."""
    name, _, args = spec.partition("@")
    kwargs = {}
    for item in filter(None, args.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"press spec {spec!r}: settings must be key=value pairs separated by commas")
        if key in kwargs:
            raise ValueError(f"press spec {spec!r}: {key} is set twice")
        kwargs[key] = _value(value)
    return name, kwargs


def is_compression(spec: str) -> bool:
    """Whether ``spec`` names a compressor press or the QuantizedCache baseline."""
    return parse_spec(spec)[0] in (*COMPRESSORS, QUANTIZED_CACHE)


def build(spec: str):
    """The press of a compressor spec, or None for the QuantizedCache baseline (its settings checked here)."""
    name, kwargs = parse_spec(spec)
    if name == QUANTIZED_CACHE:
        unknown = set(kwargs) - set(QUANTIZED_CACHE_DEFAULTS)
        if unknown:
            raise ValueError(f"press spec {spec!r}: {QUANTIZED_CACHE} takes {sorted(QUANTIZED_CACHE_DEFAULTS)}")
        if kwargs.get("nbits", 4) not in (2, 4):
            raise ValueError(f"press spec {spec!r}: nbits must be 2 or 4 (quanto backend)")
        for key, low in (("q_group_size", 1), ("residual_length", 0)):
            try:
                check_int_at_least(key, kwargs.get(key, QUANTIZED_CACHE_DEFAULTS[key]), low)
            except ValueError as err:
                raise ValueError(f"press spec {spec!r}: {err}") from None
        return None
    if name not in COMPRESSORS:
        raise ValueError(f"press spec {spec!r}: the name must be one of {COMPRESSORS + (QUANTIZED_CACHE,)}")
    try:
        return compressors()[name](**kwargs)
    except TypeError as err:
        raise ValueError(f"press spec {spec!r}: {err}") from None


class PressModelError(ValueError):
    """A compressor spec the loaded model refuses (a rank or channel count beyond its head dim, a projection not
    fitted for it), found once the model is loaded, before any answer."""


def check_on_model(specs: list[str], model) -> None:
    """Enter each compressor press of ``specs`` on ``model`` once (its model checks, its fitted projections loaded),
    raising :class:`PressModelError` naming the spec."""
    for spec in specs:
        press = build(spec) if is_compression(spec) else None
        if press is None:
            continue
        try:
            with press(model):
                pass
        except (ValueError, OSError) as err:
            raise PressModelError(f"press spec {spec!r}: {err}") from err


def quantized_cache(spec: str, model, layers) -> object:
    """A quanto ``QuantizedCache`` holding ``layers`` (``(keys, values)`` ``[B, H, T, D]`` per layer)."""
    from transformers import QuantizedCache

    settings = {**QUANTIZED_CACHE_DEFAULTS, **parse_spec(spec)[1]}
    kv = QuantizedCache(backend="quanto", config=model.config, **settings)
    for i, (keys, values) in enumerate(layers):
        kv.update(keys.clone(), values.clone(), i)
    return kv


def tensor_nbytes(t) -> int:
    """Bytes of a tensor, or of the inner tensors of a tensor subclass (quanto's packed ``QBitsTensor``)."""
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(tensor_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def kv_bytes(kv) -> int:
    """Key/value bytes a cache holds, measured on its tensors."""
    from pikv_hf import PiKVCache

    if isinstance(kv, PiKVCache):
        return kv.kv_nbytes()
    return sum(layer_nbytes(layer) for layer in kv.layers)


def layer_nbytes(layer) -> int:
    """Key/value bytes of one ``DynamicCache`` / ``QuantizedCache`` layer (quantised tensors and residual)."""
    tensors = (getattr(layer, n, None) for n in ("_quantized_keys", "_quantized_values", "keys", "values"))
    return sum(tensor_nbytes(t) for t in tensors if isinstance(t, torch.Tensor))


def kept_per_kv_head(kv) -> list[float]:
    """Tokens stored per (row, KV head) of every layer (mean over rows and heads)."""
    from pikv_hf import PiKVCache

    if isinstance(kv, PiKVCache):
        return [float(la.tokens_per_shard().sum(-1).float().mean()) for la in kv.layers]
    return [float(getattr(la, "cumulative_length", None) or la.keys.shape[-2]) for la in kv.layers]


def reconstruction_error(press, layers) -> dict | None:
    """Mean over layers of the press's ``||x - D(E(x))|| / ||x||`` for keys and values of ``layers`` (exact KV of
    the context); None for a press without reconstruction (eviction)."""
    if press is None or not hasattr(press, "reconstruction_error"):
        return None
    errors = [press.reconstruction_error(k, v, i) for i, (k, v) in enumerate(layers)]
    return {side: round(sum(e[side] for e in errors) / len(errors), 6) for side in ("keys", "values")}


def held_out_ids(tokenizer, tokens: int) -> torch.Tensor:
    """``[1, tokens]`` ids of the end of the essays (held out from the projections' calibration half)."""
    from pikv_hf.eval.haystack import essay_sentences

    sentences = essay_sentences()
    text = " ".join(sentences[len(sentences) // 2 :])
    text = text[-8 * tokens :].split(" ", 1)[-1]  # whole words; > 8 characters per token is rare
    ids = tokenizer(text, return_tensors="pt").input_ids[:, -tokens:]
    if ids.shape[1] < tokens:
        from pikv_hf.eval.haystack import LengthError

        raise LengthError(f"perplexity: the held-out text holds {ids.shape[1]} tokens, asked for {tokens}")
    return ids


def continuation_nll(model, kv, targets: torch.Tensor, context_len: int) -> tuple[float, int]:
    """Summed negative log-likelihood of ``targets[:, 1:]`` given the (compressed) cache of the context and the
    earlier targets, fed in one forward at positions after ``context_len``; returns ``(nll, count)``."""
    positions = torch.arange(context_len, context_len + targets.shape[1]).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=targets, past_key_values=kv, position_ids=positions).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, targets[0, 1:], reduction="sum")
    return float(nll), targets.shape[1] - 1


def perplexity_of(nll: float, count: int) -> float:
    return math.exp(nll / count)


def per_length(rows: list[dict]) -> list[dict]:
    """Mean needle score (%) and sample count per (press, ratio, length), with the mean KV bytes of compression rows."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[(row["press"], row["ratio"], row["length"])].append(row)
    out = []
    for (press, ratio, length), rs in sorted(groups.items()):
        point = {"press": press, "ratio": ratio, "length": length, "n": len(rs)}
        point["score"] = 100.0 * sum(r["score"] for r in rs) / len(rs)
        if all("kv_bytes" in r for r in rs):
            point["kv_bytes"] = sum(r["kv_bytes"] for r in rs) / len(rs)
        out.append(point)
    return out


def plot(per_length_points: list[dict], perplexity: list[dict], path, title: str) -> None:
    """Needle score per point and length (bars) and perplexity per point, next to each other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({p["press"] for p in per_length_points}, key=lambda n: (n != "none", n))
    lengths = sorted({p["length"] for p in per_length_points})
    score = {(p["press"], p["length"]): p["score"] for p in per_length_points}
    ppl = {p["press"]: p["perplexity"] for p in perplexity}
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.35 * len(names) + 1.8), sharey=True)
    height = 0.8 / max(1, len(lengths))
    for j, length in enumerate(lengths):
        ys = [i + j * height for i in range(len(names))]
        axes[0].barh(ys, [score.get((n, length), 0.0) for n in names], height=height, label=f"{length} tokens")
    axes[0].set_yticks([i + 0.4 - height / 2 for i in range(len(names))], names, fontsize=7)
    axes[0].set_xlabel("needle score (%)")
    axes[0].legend(fontsize=7)
    axes[1].barh(range(len(names)), [ppl.get(n, float("nan")) for n in names], color="gray")
    axes[1].set_xlabel("perplexity (held-out essays, log scale)")
    axes[1].set_xscale("log")
    axes[0].invert_yaxis()  # the uncompressed point first (the axes share it)
    for ax in axes:
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
