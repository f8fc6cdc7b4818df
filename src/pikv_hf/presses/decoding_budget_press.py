"""Decode-time budgets: keep every layer within a fixed number of tokens while generating."""

from __future__ import annotations

from dataclasses import dataclass

from kvpress.presses.decoding_press import DecodingPress
from torch import nn

from pikv_hf.checks import check_int_at_least
from pikv_hf.layer import PiKVLayer
from pikv_hf.presses.adakv_press import AdaKVPress
from pikv_hf.presses.base import PiKVPress, PiKVScorerPress, drop_or_offload, prefilling, refuse_compiled_decode
from pikv_hf.store.tiers import OFFLOAD


@dataclass
class DecodingBudgetPress(PiKVPress, DecodingPress):
    """Hold every (row, KV head) of every layer to ``target_size`` tokens during decoding.

    A kvpress ``DecodingPress`` (so kvpress's pipeline keeps it active while answering) around one of pikv_hf's
    presses (``base_press``: :class:`H2OPress`, :class:`StreamingLLMPress`, :class:`LRUPress`, :class:`LRUPlusPress`,
    :class:`FlexGenPress`, :class:`AdaKVPress`, ...).

    On a ``PiKVCache`` the layer is cut back to ``target_size`` tokens per (row, KV head) as soon as it holds
    ``target_size + compression_interval`` (default interval 1: every step, so it never holds more than one token over
    budget), keeping what ``base_press.decode_keep`` ranks highest from the cache's own statistics, which the
    attention path updates at every step (the press turns them on before the prefill's attention, so the prefill's
    queries count too); nothing is recomputed, and a step costs the same at any sequence length. Dropped tokens move
    to the offload tier when ``base_press.offload`` is set. On a ``DynamicCache`` it is kvpress's ``DecodingPress``:
    every ``compression_interval`` steps the base press re-scores the cache with the hidden states of the last steps
    and compresses it to ``target_size``.

    Parameters
    ----------
    base_press : PiKV press
        Ranks the tokens.
    target_size : int
        Tokens kept per (row, KV head) and layer.
    compression_interval : int
        Steps (DynamicCache) or tokens over budget (PiKVCache) between two cuts.
    """

    compression_interval: int = 1
    target_size: int = 1024
    shortens_keys = True

    def __post_init__(self) -> None:
        self.validate()
        super().__post_init__()

    def validate(self) -> None:
        super().validate()
        check_int_at_least("target_size", self.target_size, 1)
        check_int_at_least("compression_interval", self.compression_interval, 1)
        check_int_at_least("hidden_states_buffer_size", self.hidden_states_buffer_size, 0)
        n_sink = getattr(self.base_press, "n_sink", 0)
        if self.target_size <= n_sink:
            raise ValueError(
                f"target_size must exceed base_press.n_sink={n_sink} (sinks alone fill it), got {self.target_size}"
            )

    def stats_needed(self) -> tuple[str, ...]:
        return getattr(self.base_press, "decode_stats", ())

    def check_cache(self) -> None:
        """On a PiKVCache the base press ranks decoding tokens from the cache's statistics: refuse one that cannot,
        at the first forward, before the layer stores anything."""
        press = self.base_press
        inner = press.press if isinstance(press, AdaKVPress) else press
        if not isinstance(inner, PiKVScorerPress) or type(inner).decode_scores is PiKVScorerPress.decode_scores:
            raise ValueError(
                f"DecodingBudgetPress on a PiKVCache ranks decoding tokens from the cache's statistics: base_press "
                f"{type(inner).__name__} has none (use H2OPress, StreamingLLMPress, LRUPress, LRUPlusPress, "
                "FlexGenPress, or AdaKVPress over one of them)"
            )

    def press_layer(self, module: nn.Module, layer: PiKVLayer, kwargs: dict, output: list) -> None:
        if prefilling(kwargs):
            return
        refuse_compiled_decode(self, "evicts tokens")
        compressed = [name for name in layer.tiers if name != OFFLOAD]
        if compressed:  # resident and read, but outside the hot store the budget cuts: it would grow past target_size
            raise ValueError(
                f"DecodingBudgetPress holds each (row, KV head) to target_size={self.target_size} tokens of the hot "
                f"store, but layer {layer.layer_idx} also holds tokens in tier(s) {compressed} (a compressor moved "
                "them there), which it cannot cut: drop the compressor, or the budget"
            )
        per_head = layer.held()  # [B, H]
        if getattr(self.base_press, "budget_per_row", False):  # AdaKV: a row's heads share heads * target_size
            over = int(per_head.sum(-1).max()) - per_head.shape[1] * self.target_size
        else:
            over = int(per_head.max()) - self.target_size
        if over >= self.compression_interval:
            view = layer.view_index()
            keep = self.base_press.decode_keep(layer, view, self.target_size)
            drop_or_offload(layer, view, keep, getattr(self.base_press, "offload", None))
