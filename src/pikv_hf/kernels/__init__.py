"""Triton kernels of the paged store, each next to its torch reference (``triton`` is the optional extra
``kernels``; without it the references still work and launching a kernel raises):

* ``gather``: selected pool pages into one contiguous buffer (``gather_pages``, ``gather_pages_reference``);
* ``decode``: fused paged decode attention, GQA, split-KV partials merged by log-sum-exp (``decode_attention``,
  ``decode_attention_reference``);
* ``decode_quant``: the same over int2 / int4 / int8 pages (``decode_attention_quant``; 4-bit pages through their
  own kernel that dots the codes' nibble fields against the matching query channels), with the page layout's torch
  ``quantize_pages`` / ``dequantize_pages``;
* ``dequant``: quantised pages to dense K/V in one operator (``dequantize``, ``torch.ops.pikv.dequant_pages``);
* ``merge``: two attention partials merged by log-sum-exp (``torch.ops.pikv.merge_partials``);
* ``quest``: Quest's page scores and page selection, of one store or one budget over several
  (``torch.ops.pikv.quest_scores`` / ``quest_select`` / ``quest_group_select``);
* ``read_stats``: a store's read added to the read counters (``torch.ops.pikv.record_read``);
* ``append``: one decode token per (row, head) stored, slot assignment included (``torch.ops.pikv.append_one``);
* ``place_key``, ``route_select``, ``routed_plan``: a routed step's key-cluster placement, shard selection and plan
  (``torch.ops.pikv.place_key`` / ``route_select`` / ``routed_plan``).

The attention backend that dispatches to them is ``pikv_hf.attention.triton_backend``.
"""

from pikv_hf.kernels.decode import decode_attention, decode_attention_reference
from pikv_hf.kernels.decode_quant import QuantPages, decode_attention_quant, dequantize_pages, quantize_pages
from pikv_hf.kernels.dequant import dequantize
from pikv_hf.kernels.gather import gather_pages, gather_pages_reference
from pikv_hf.kernels.merge import merge_two  # registers torch.ops.pikv.merge_partials

__all__ = [
    "QuantPages",
    "decode_attention",
    "decode_attention_quant",
    "decode_attention_reference",
    "dequantize",
    "dequantize_pages",
    "gather_pages",
    "gather_pages_reference",
    "merge_two",
    "quantize_pages",
]
