"""FlexGen: keep the recent KV resident, offload the rest."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pikv_hf.layer import PiKVLayer
from pikv_hf.presses.base import PiKVScorerPress
from pikv_hf.view import DenseView


@dataclass
class FlexGenPress(PiKVScorerPress):
    """FlexGen's KV placement (Sheng et al., "FlexGen: High-Throughput Generative Inference of Large Language Models
    with a Single GPU", ICML 2023): a fixed share of the KV stays resident on the accelerator and the rest lives in
    CPU memory or on disk, from where attention reads it. Here the resident share is the most recent
    ``1 - compression_ratio`` of each (row, KV head)'s tokens.

    In a ``PiKVCache`` the older tokens move to the offload tier (``offload``, default ``"cpu"``), nothing is lost,
    and every decode step reads them back (``routing_stats()["overall"]["bytes_fetched_per_decode_step"]``; a routed
    read fetches only its selected shards). A ``DynamicCache`` has no second tier: there, as in kvpress, the press drops
    them (a recent window).
    """

    offload: str | None = "cpu"

    def score(self, module: nn.Module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        b, h, t, _ = keys.shape
        return torch.arange(t, device=keys.device, dtype=torch.float32).expand(b, h, t)

    def score_view(self, module: nn.Module, kwargs: dict, view: DenseView, attentions) -> torch.Tensor:
        return view.rel_pos.float()

    def decode_scores(self, layer: PiKVLayer, view: DenseView, n_kept: int) -> torch.Tensor:
        return view.rel_pos.float()
