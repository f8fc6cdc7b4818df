"""Attention over a paged store: the torch reference (masked partials), the log-sum-exp merge and the backends."""

from pikv_hf.attention.backend import Partial, TorchBackend
from pikv_hf.attention.merge import merge_partials, sink_partial
from pikv_hf.attention.reference import allowed_mask, masked_attention, partial_attention

__all__ = [
    "Partial",
    "TorchBackend",
    "allowed_mask",
    "masked_attention",
    "merge_partials",
    "partial_attention",
    "sink_partial",
]
