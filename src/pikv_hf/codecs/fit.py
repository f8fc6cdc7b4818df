"""Fitted projections (SVD, LoRA, LoRA++, distilled) of a model's keys and values, recorded on real text, saved as
safetensors with the model's identity and checked against it on load.

``python -m pikv_hf.codecs.fit --method svd lora lora_plus distill --rank 16 32`` (``make fit-projections``) records
SmolLM2's post-RoPE queries, keys and values over the calibration half of the Paul Graham essays and writes one file
per method and rank under ``$PIKV_HF_CACHE/projections`` (or ``~/.cache/pikv_hf/projections``); a few minutes on two
CPU cores. Methods, per layer and KV head (``X`` ``[T, D]`` the recorded keys or values):

* ``svd``: the right singular vectors ``V`` of ``X`` (all ``D`` of them: a press truncates to its rank on load);
* ``lora``: ``X^ = X A B`` learned by Adam on ``||X - X^||^2 / ||X||^2`` (Hu et al. 2021's factorisation);
* ``lora_plus``: ``X^ = (X A + a) B + b`` with the up matrix learning 16x faster (Hayou et al. 2024, LoRA+);
* ``distill``: ``down`` / ``up`` with biases, started from the SVD and trained to preserve attention: the KL divergence
  between the full and the compressed causal attention distributions of the recorded queries plus the relative error
  of the attention outputs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from pathlib import Path

import torch

from pikv_hf.codecs.projection import AffineMap

METHODS = ("svd", "lora", "lora_plus", "distill")
FORMAT = "pikv_hf.projections.v1"
SIDES = ("keys", "values")
CALIBRATION = "the first half of pikv_hf.eval.ruler.essay_sentences() (the second half is held out)"


# ---------------------------------------------------------------------------------------------- identity
def model_identity(model: torch.nn.Module) -> dict:
    """What a fitted projection is bound to: the attention geometry of the config and a checksum of the first
    layer's key / value projection weights (so a retrained or another model of the same shape is told apart)."""
    cfg = model.config.get_text_config()
    heads = cfg.num_attention_heads
    shape = {
        "model_type": cfg.model_type,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
    }
    attn = model.model.layers[0].self_attn
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode())
    for w in (attn.k_proj.weight, attn.v_proj.weight):
        digest.update(w.detach().float().cpu().contiguous().numpy().tobytes())
    return {**shape, "digest": digest.hexdigest()}


def default_path(model: torch.nn.Module, method: str, rank: int) -> Path:
    """``<cache_dir>/projections/<digest[:16]>_<method>[_r<rank>].safetensors`` (SVD files hold every rank)."""
    from pikv_hf.models.smollm2 import cache_dir

    suffix = "" if method == "svd" else f"_r{rank}"
    return cache_dir() / "projections" / f"{model_identity(model)['digest'][:16]}_{method}{suffix}.safetensors"


# ---------------------------------------------------------------------------------------------- recording
def calibration_ids(tokenizer, tokens: int) -> torch.Tensor:
    """``[1, tokens]`` ids of the calibration half of the essays."""
    from pikv_hf.eval.haystack import essay_sentences

    sentences = essay_sentences()
    text = " ".join(sentences[: len(sentences) // 2])[: 8 * tokens]  # > 8 characters per token is rare
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :tokens]
    if ids.shape[1] < tokens:
        raise ValueError(f"tokens: the calibration text holds {ids.shape[1]} tokens, asked for {tokens}")
    return ids


def record(model: torch.nn.Module, ids: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Per decoder layer: post-RoPE ``queries`` ``[Hq, T, D]``, ``keys`` and ``values`` ``[H, T, D]`` (float32) of one
    uncompressed forward of ``ids`` (``[1, T]``; a Llama-style attention with ``q_proj`` and rotary embeddings)."""
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    queries: dict[int, torch.Tensor] = {}

    def hook(module, args, kwargs, output):
        hs = kwargs["hidden_states"]
        q = module.q_proj(hs).view(*hs.shape[:2], -1, module.head_dim).transpose(1, 2)
        cos, sin = kwargs["position_embeddings"]
        queries[module.layer_idx] = apply_rotary_pos_emb(q, q, cos, sin)[0][0].float()

    layers = model.model.layers
    handles = [la.self_attn.register_forward_hook(hook, with_kwargs=True) for la in layers]
    cache = DynamicCache()
    try:
        with torch.no_grad():
            model.model(input_ids=ids, past_key_values=cache)
    finally:
        for h in handles:
            h.remove()
    return [
        {"queries": queries[i], "keys": la.keys[0].float(), "values": la.values[0].float()}
        for i, la in enumerate(cache.layers)
    ]


# ---------------------------------------------------------------------------------------------- fitting
def svd_map(x: torch.Tensor, rank: int | None = None) -> AffineMap:
    """The truncated-SVD map of ``x`` (``[H, T, D]``): ``down = V_r``, ``up = V_r^T`` (all ``D`` directions when
    ``rank`` is None)."""
    _, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    v = vh[:, : rank or x.shape[-1]].float()  # [H, r, D]
    return AffineMap.linear(v.transpose(1, 2).contiguous(), v.contiguous())


def truncate(m: AffineMap, rank: int) -> AffineMap:
    """The first ``rank`` directions of an SVD map."""
    return AffineMap.linear(m.down[..., :rank].contiguous(), m.up[:, :rank].contiguous())


def _train(params: list[dict], loss_fn, steps: int) -> None:
    opt = torch.optim.Adam(params)
    for _ in range(steps):
        opt.zero_grad()
        loss_fn().backward()
        opt.step()


def lora_map(x: torch.Tensor, rank: int, bias: bool, steps: int, seed: int = 0) -> AffineMap:
    """LoRA (``bias=False``) or LoRA++ (``bias=True``, up matrix at 16x the learning rate) map of ``x``
    (``[H, T, D]``) learned on the relative reconstruction error, on ``x`` scaled to unit RMS per head."""
    h, _, d = x.shape
    gen = torch.Generator().manual_seed(seed)
    s = x.square().mean(dim=(1, 2), keepdim=True).sqrt().clamp(min=1e-8)  # [H, 1, 1]
    xs = x / s
    a = (torch.randn(h, d, rank, generator=gen) / math.sqrt(d)).requires_grad_()
    b = torch.zeros(h, rank, d, requires_grad=True)
    a_bias = torch.zeros(h, 1, rank, requires_grad=bias)
    b_bias = torch.zeros(h, 1, d, requires_grad=bias)
    groups = [{"params": [a], "lr": 1e-2}, {"params": [b], "lr": 1.6e-1 if bias else 1e-2}]
    if bias:
        groups.append({"params": [a_bias, b_bias], "lr": 1e-2})

    def loss():
        return (((xs @ a + a_bias) @ b + b_bias) - xs).square().mean() / xs.square().mean()

    _train(groups, loss, steps)
    s2 = s.squeeze(-1)  # [H, 1]
    with torch.no_grad():
        return AffineMap(a / s, b * s, a_bias[:, 0], b_bias[:, 0] * s2)


def distill_maps(
    layer: dict[str, torch.Tensor], rank: int, steps: int, tokens: int, queries: int
) -> tuple[AffineMap, AffineMap]:
    """Key and value maps of one layer trained to preserve its causal attention: the last ``queries`` of the first
    ``tokens`` recorded positions attend to the keys before them, and the loss is
    ``KL(softmax(q k^T) || softmax(q k^^T))`` plus ``||o - o^||^2 / ||o||^2`` of the outputs; started from the SVD."""
    k, v = layer["keys"][:, :tokens], layer["values"][:, :tokens]
    h, t, d = k.shape
    q = layer["queries"][:, t - queries : t]
    qg = q.reshape(h, q.shape[0] // h, queries, d)  # query heads grouped by KV head
    causal = torch.arange(t) <= torch.arange(t - queries, t).unsqueeze(-1)  # [queries, t]
    scale = d**-0.5

    def attention(keys, values):
        logits = (qg @ keys.unsqueeze(1).transpose(-1, -2)) * scale
        logp = logits.masked_fill(~causal, float("-inf")).log_softmax(-1)
        return logp, logp.exp() @ values.unsqueeze(1)

    with torch.no_grad():
        full_logp, full_o = attention(k, v)
    params = [[t_.clone().requires_grad_() for t_ in svd_map(x, rank).tensors()] for x in (k, v)]

    def apply(p, x):
        return ((x @ p[0] + p[2].unsqueeze(1)) @ p[1]) + p[3].unsqueeze(1)

    def loss():
        logp, o = attention(apply(params[0], k), apply(params[1], v))
        kl = (full_logp.exp() * (full_logp - logp)).masked_fill(~causal, 0).sum(-1).mean()
        return kl + (o - full_o).square().mean() / full_o.square().mean()

    _train([{"params": [t_ for p in params for t_ in p], "lr": 2e-3}], loss, steps)
    return tuple(AffineMap(*(t_.detach() for t_ in p)) for p in params)


def fit(
    method: str,
    layers: list[dict[str, torch.Tensor]],
    rank: int,
    steps: int = 300,
    distill_tokens: int = 512,
    distill_queries: int = 256,
) -> list[tuple[AffineMap, AffineMap]]:
    """``(key map, value map)`` per layer of recorded ``layers`` (see :func:`record`); ``svd`` keeps every rank,
    ``distill`` trains ``steps // 3`` steps on the attention of ``distill_queries`` queries over ``distill_tokens``
    tokens (its steps cost the most)."""
    check_method(method)
    out = []
    for layer in layers:
        if method == "svd":
            out.append((svd_map(layer["keys"]), svd_map(layer["values"])))
        elif method == "distill":
            t = min(distill_tokens, layer["keys"].shape[1])
            out.append(distill_maps(layer, rank, steps // 3, t, min(distill_queries, t)))
        else:
            bias = method == "lora_plus"
            out.append(tuple(lora_map(layer[side], rank, bias, steps) for side in SIDES))
    return out


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")


# ---------------------------------------------------------------------------------------------- files
def save(path: str | Path, model: torch.nn.Module, method: str, rank: int, maps: list) -> Path:
    """Write ``maps`` (from :func:`fit`) with the model's identity as safetensors metadata."""
    from safetensors.torch import save_file

    tensors = {}
    for i, pair in enumerate(maps):
        for side, m in zip(SIDES, pair, strict=True):
            for name, t in zip(("down", "up", "down_bias", "up_bias"), m.tensors(), strict=True):
                tensors[f"{i}.{side}.{name}"] = t.detach().float().contiguous()
    meta = {
        "format": FORMAT,
        "method": method,
        "rank": str(maps[0][0].rank if method == "svd" else rank),
        "model": json.dumps(model_identity(model), sort_keys=True),
        "calibration": CALIBRATION,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    return path


def load(path: str | Path, model: torch.nn.Module, method: str, rank: int) -> list[tuple[AffineMap, AffineMap]]:
    """The ``(key map, value map)`` per layer saved at ``path`` for ``model``, at ``rank``.

    Raises
    ------
    FileNotFoundError
        No file at ``path`` (with the command that fits it).
    ValueError
        The file was fitted for another model (identity differs), by another method, or holds another rank.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no fitted {method} projection at {path}: fit it with `python -m pikv_hf.codecs.fit --method {method} "
            f"--rank {rank}` (make fit-projections)"
        )
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a pikv_hf projection file (format {meta.get('format')!r})")
    saved, current = json.loads(meta["model"]), model_identity(model)
    if saved != current:
        differ = sorted(k for k in current if saved.get(k) != current[k])
        raise ValueError(
            f"{path} holds a projection fitted for another model ({', '.join(differ)} differ: fitted for "
            f"{ {k: saved.get(k) for k in differ} }, this model has { {k: current[k] for k in differ} })"
        )
    if meta["method"] != method:
        raise ValueError(f"{path} holds a {meta['method']} projection, not {method}")
    saved_rank = int(meta["rank"])
    if (method == "svd" and rank > saved_rank) or (method != "svd" and rank != saved_rank):
        raise ValueError(f"rank: {path} holds rank {saved_rank}, asked for {rank}")
    out = []
    for i in range(current["num_hidden_layers"]):
        pair = []
        for side in SIDES:
            m = AffineMap(*(tensors[f"{i}.{side}.{n}"] for n in ("down", "up", "down_bias", "up_bias")))
            pair.append(truncate(m, rank) if method == "svd" else m)
        out.append(tuple(pair))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--rank", nargs="+", type=int, default=[32])
    parser.add_argument("--tokens", type=int, default=2048, help="calibration tokens recorded")
    parser.add_argument("--steps", type=int, default=300, help="optimiser steps per layer (distill: half)")
    args = parser.parse_args(argv)
    from pikv_hf.models import load_smollm2

    model, tokenizer = load_smollm2()
    layers = record(model, calibration_ids(tokenizer, args.tokens))
    for method in args.method:
        for rank in [max(args.rank)] if method == "svd" else args.rank:
            path = save(default_path(model, method, rank), model, method, rank, fit(method, layers, rank, args.steps))
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
