"""DuoAttention: retrieval heads keep everything, streaming heads keep sinks and a recent window."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from kvpress.presses.base_press import BasePress
from kvpress.utils import compute_n_kept
from torch import nn

from pikv_hf.checks import check_int_at_least, is_number
from pikv_hf.layer import PiKVLayer
from pikv_hf.presses.base import PiKVPress, check_offload, drop_or_offload, prefill_layer
from pikv_hf.presses.queries import model_queries


def model_identity(model: nn.Module) -> str:
    """A digest of the model's config and of a few of its weights: head scores fitted on one model are refused by
    another."""
    public = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_")}  # not the attention choice
    digest = hashlib.sha256(json.dumps(public, sort_keys=True, default=str).encode())
    for name, tensor in list(model.state_dict().items())[:4]:
        digest.update(name.encode())
        digest.update(tensor.detach().float().flatten()[:64].numpy().tobytes())
    return digest.hexdigest()[:32]


@torch.no_grad()
def calibrate_heads(model: nn.Module, input_ids: torch.Tensor, n_sink: int = 4, window: int = 64) -> dict:
    """Retrieval score of every (layer, KV head) on real text: the attention mass its queries put outside the first
    ``n_sink`` tokens and their last ``window`` tokens, averaged over the queries that have such tokens and over the
    query heads of the KV head. Streaming heads score near 0, retrieval heads high (DuoAttention's distinction,
    measured here instead of trained).

    Returns a dict ``{"identity", "n_sink", "window", "scores": [L][H]}`` for :func:`save_heads`.
    """
    from pikv_hf.routing.expert import decoder_layers

    check_int_at_least("n_sink", n_sink, 0)
    check_int_at_least("window", window, 1)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be an integer tensor [B, T] of token ids, got {got}")
    if input_ids.shape[1] <= n_sink + window:
        raise ValueError(
            f"input_ids must hold more than n_sink + window = {n_sink + window} tokens (no query reaches past its "
            f"sinks and window otherwise, so no head has a score), got {input_ids.shape[1]}"
        )
    captured: dict[int, tuple] = {}

    def hook(module, args, kwargs, output):
        captured[module.layer_idx] = (kwargs["hidden_states"], kwargs["position_embeddings"])

    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in decoder_layers(model)]
    from transformers import DynamicCache

    cache = DynamicCache()
    try:
        model(input_ids, past_key_values=cache)
    finally:
        for handle in handles:
            handle.remove()
    scores = []
    t = input_ids.shape[1]
    pos = torch.arange(t)
    far = (pos.view(1, -1) >= n_sink) & (pos.view(-1, 1) - pos.view(1, -1) >= window)  # [q, k] outside sink/window
    rows = far.any(-1)
    for i, layer in enumerate(decoder_layers(model)):
        hidden, embeddings = captured[i]
        queries = model_queries(layer.self_attn, hidden, {"position_embeddings": embeddings})  # [B, Hq, T, D]
        keys = cache.layers[i].keys
        b, hq, _, d = queries.shape
        h = keys.shape[1]
        logits = queries.view(b, h, hq // h, t, d) @ keys.unsqueeze(2).transpose(-1, -2) * layer.self_attn.scaling
        prob = logits.masked_fill(pos.view(1, -1) > pos.view(-1, 1), float("-inf")).softmax(-1)
        outside = (prob * far).sum(-1)[..., rows].mean(dim=(0, 2, 3))  # [H]
        scores.append(outside.tolist())
    return {"identity": model_identity(model), "n_sink": n_sink, "window": window, "scores": scores}


def save_heads(calibration: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(calibration, indent=1))


def checked_scores(calibration: dict, model: nn.Module, source: str) -> list[list[float]]:
    """The scores of a :func:`calibrate_heads` result; ``ValueError`` if they were fitted on another model."""
    if not isinstance(calibration, dict) or not {"identity", "scores"} <= set(calibration):
        raise ValueError(f"{source} is not what calibrate_heads returns (a dict with 'identity' and 'scores')")
    if calibration["identity"] != model_identity(model):
        raise ValueError(
            f"head scores in {source} were calibrated on another model (identity {calibration['identity']}, this "
            f"model {model_identity(model)}); run calibrate_heads on this model"
        )
    return calibration["scores"]


def load_heads(path: str | Path, model: nn.Module) -> list[list[float]]:
    """The head scores saved at ``path``; ``ValueError`` if they were fitted on another model."""
    try:
        calibration = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"heads must be a file written by save_heads, got {str(path)!r} (not JSON: {err})") from None
    return checked_scores(calibration, model, str(path))


def head_budgets(scores: list[float], t: int, n_kept: int, min_keep: int) -> list[int]:
    """Tokens each head keeps so that the layer keeps exactly ``len(scores) * n_kept``: the lowest-scored heads
    stream (keep ``>= min_keep``), the others keep all ``t``; as few heads stream as the budget allows."""
    h = len(scores)
    drop = h * (t - n_kept)
    order = sorted(range(h), key=lambda i: (scores[i], i))
    budgets = [t] * h
    for streaming in range(1, h + 1):
        if streaming * (t - min_keep) >= drop:
            each, extra = divmod(streaming * t - drop, streaming)
            for rank, head in enumerate(order[:streaming]):
                budgets[head] = each + (1 if rank < extra else 0)
            return budgets
    return [max(min_keep, n_kept)] * h  # even all heads streaming cannot reach the budget: keep the minimum


@dataclass
class DuoAttentionPress(PiKVPress, BasePress):
    """DuoAttention (Xiao et al., "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming
    Heads", ICLR 2025): retrieval heads keep every token; streaming heads keep the first ``n_sink`` tokens and their
    most recent ones. The heads with the lowest retrieval scores (:func:`calibrate_heads` on real text) stream, as
    few as the budget allows, so that every layer keeps exactly ``H * compute_n_kept(T, compression_ratio)`` tokens
    per row (``T``: the row's own tokens; its sinks are its first real tokens).

    On a ``DynamicCache`` the streaming heads' dropped tokens are masked the way kvpress's head-wise presses mask them
    (``module.masked_key_indices``, a fake key per decode step; nothing is freed); on a ``PiKVCache`` they are
    evicted per head (or moved to the offload tier), so the bytes are freed.

    Parameters
    ----------
    compression_ratio : float
        Fraction of the context's KV pairs removed per layer, in ``[0, 1)``.
    heads : str, dict or list
        What :func:`calibrate_heads` returns (checked against the model), a path it was saved to with
        :func:`save_heads`, or the scores themselves (``[L][H]`` numbers in ``[0, 1]``).
    n_sink : int
        Sink tokens every streaming head keeps.
    offload : str or None
        PiKVCache only: move dropped tokens to the offload tier instead of dropping them.
    """

    compression_ratio: float = 0.0
    heads: str | Path | dict | list = field(default_factory=list)
    n_sink: int = 4
    offload: str | None = None
    masks_keys = True

    def __post_init__(self) -> None:
        self.validate()
        self._scores = self.heads if isinstance(self.heads, list) and self.heads else None

    def validate(self) -> None:
        super().validate()
        check_int_at_least("n_sink", self.n_sink, 0)
        check_offload(self.offload)
        if isinstance(self.heads, (str, Path)) and not Path(self.heads).is_file():
            raise ValueError(f"heads must be a file written by save_heads, got {str(self.heads)!r} (no such file)")

    def post_init_from_model(self, model: nn.Module) -> None:
        if self._scores is None:
            if not self.heads:
                raise ValueError(
                    "DuoAttentionPress needs heads: what calibrate_heads returns, a path from save_heads or the "
                    "scores [L][H]"
                )
            if isinstance(self.heads, dict):
                self._scores = checked_scores(self.heads, model, "the heads given")
            else:
                self._scores = load_heads(self.heads, model)
        n_layers = model.config.get_text_config().num_hidden_layers
        if not isinstance(self._scores, list) or len(self._scores) != n_layers:
            got = f"{len(self._scores)} layers" if isinstance(self._scores, list) else repr(self._scores)
            raise ValueError(f"heads must hold a list of head scores per layer, {n_layers} layers; got {got}")
        for i, layer in enumerate(self._scores):
            ok = isinstance(layer, list) and all(is_number(x) and 0 <= x <= 1 for x in layer)
            if not ok:  # a NaN sorted as both lowest and highest: the streaming heads depended on its place
                raise ValueError(
                    f"heads must hold numbers in [0, 1] (a KV head's attention mass outside its sinks and window), "
                    f"got {layer!r} for layer {i}"
                )

    def keep_view(self, layer_idx: int, rel_pos: torch.Tensor) -> torch.Tensor:
        """``[B, H, T]`` keep mask over position-ordered entries (``rel_pos``: positions counted from each row's
        first real token, ``-1``: padding); each row's budgets come from its own token count."""
        b, h, t = rel_pos.shape
        scores = self._scores[layer_idx]
        if len(scores) != h:
            raise ValueError(f"heads holds {len(scores)} head scores for layer {layer_idx}, the layer has {h} KV heads")
        count = (rel_pos >= 0).sum(-1)[:, 0].tolist()  # tokens of each row (every head holds them at prefill)
        budgets = [head_budgets(scores, n, compute_n_kept(n, self.compression_ratio), self.n_sink + 1) for n in count]
        budget = torch.tensor(budgets, device=rel_pos.device).view(b, h, 1)
        n = torch.tensor(count, device=rel_pos.device).view(b, 1, 1)
        newest = rel_pos.amax(-1, keepdim=True)
        recent = rel_pos > newest - (budget - self.n_sink).clamp(min=1)
        keep = (rel_pos < self.n_sink) | recent | (budget == n)
        return keep & (rel_pos >= 0)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        b, h, t, _ = keys.shape
        keep = self.keep_view(module.layer_idx, torch.arange(t, device=keys.device).expand(b, h, t))
        module.masked_key_indices = (~keep).nonzero(as_tuple=True)
        return keys, values

    def press_layer(self, module: nn.Module, layer: PiKVLayer, kwargs: dict, output: list) -> None:
        layer = prefill_layer(module, kwargs, self.compression_ratio)
        if layer is None:
            return
        view = layer.view_index()
        drop_or_offload(layer, view, self.keep_view(module.layer_idx, view.rel_pos), self.offload)
