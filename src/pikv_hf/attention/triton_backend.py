"""``TritonBackend``: the fused paged decode kernel (``pikv_hf.kernels.decode``) behind the attention-backend seam,
and the dispatch a ``PiKVCache`` uses by default: Triton for stores on CUDA when triton is installed, the torch
reference elsewhere.

The kernels read K/V (or codes) in place through the page table's runs (``PageTable.start``): an exact read passes
no table at all, only each run's start and ``n_pages`` as the row lengths (splits then divide the pages in use), a
sparse plan passes its local page ids, which the kernel maps onto the runs, its rows' counts (``ReadPlan.lengths``,
from the operator that planned them) and ``page_full``. Stores of the identity codec are read as stored, stores of
``QuantCodec`` as codes dequantised in registers (``decode_quant``). The kernels run as the custom operators
``torch.ops.pikv.paged_decode`` / ``paged_decode_q4`` and the calls read only shapes, so the attention of a decode
step does not synchronise with the host and compiles with ``torch.compile(fullgraph=True)``. Attention mass
(``want_mass``), per-group partials (``groups > 1``), other codecs and chunks of more than ``max_queries`` tokens
(prefill: the kernel is built for a few query rows per KV head) use the inherited torch path.
Whether the kernels run interpreted (``TRITON_INTERPRET=1``, CPU) is decided when ``pikv_hf`` is imported.
"""

from __future__ import annotations

from importlib.util import find_spec

import torch

from pikv_hf.attention.backend import Partial, TorchBackend
from pikv_hf.codecs.quant import QuantCodec
from pikv_hf.kernels.decode import decode_attention
from pikv_hf.kernels.decode_quant import QUANT_FIELDS, QuantPages, decode_attention_quant
from pikv_hf.read.plan import ReadPlan
from pikv_hf.store import PagedStore

HAVE_TRITON = find_spec("triton") is not None


def _plan_lengths(pages: torch.Tensor) -> torch.Tensor:
    """``[B, H]`` one past the last page entry of each row of a plan's local ids (``-1`` padding after it is not
    read): the splits divide what a row reads, not the plan's width. For a plan whose operator did not count them
    (``ReadPlan.lengths``)."""
    rank = torch.arange(1, pages.shape[-1] + 1, device=pages.device)
    return torch.where(pages >= 0, rank, 0).amax(-1) if pages.shape[-1] else pages.new_zeros(pages.shape[:2])


class TritonBackend(TorchBackend):
    """Fused Triton decode attention where it applies, the torch reference (inherited) elsewhere."""

    name = "triton"
    max_queries = 16

    def fused(self, store: PagedStore, queries: int, groups: int, want_mass: bool) -> bool:
        """Whether :meth:`attend` runs the kernel for a call with ``queries`` query tokens."""
        identity = store.kv_fields == ("keys", "values")
        quant = isinstance(store.codec, QuantCodec) and store.kv_fields == QUANT_FIELDS
        return queries <= self.max_queries and not want_mass and groups == 1 and (identity or quant)

    def attend(
        self,
        query: torch.Tensor,
        store: PagedStore,
        plan: ReadPlan,
        qpos: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
        groups: int = 1,
        want_mass: bool = False,
        count: bool = False,
        newest: bool = False,
        mass_lse: torch.Tensor | None = None,
    ) -> Partial:
        """As :meth:`TorchBackend.attend`; ``attended`` (with ``count``) is computed by the kernel."""
        if not self.fused(store, query.shape[2], groups, want_mass):
            return super().attend(
                query, store, plan, qpos, scale, sliding_window, sinks, groups, want_mass, count, newest, mass_lse
            )
        pool, table = store.pool, store.table
        if plan.exact:
            lengths = table.n_pages
        else:
            lengths = _plan_lengths(plan.pages) if plan.lengths is None else plan.lengths
        # the kernels map the plan's local ids (or, exact, each run's first n_pages pages) onto the runs themselves
        read = dict(
            page_full=plan.page_full, n_sink=plan.n_sink, window=plan.window, row_start=plan.row_start,
            lengths=lengths, sliding_window=sliding_window, sinks=sinks, count=count, check=False,
            run_start=table.start, width=table.width(),
        )  # fmt: skip
        local = None if plan.exact else plan.pages.contiguous()  # a plan may be a slice of a wider one
        if store.kv_fields == ("keys", "values"):
            out = decode_attention(query, pool["keys"], pool["values"], pool["pos"], pool["valid"], local, qpos,
                                   scale, **read)  # fmt: skip
        else:
            quant = QuantPages(*(pool[name] for name in QUANT_FIELDS), bits=store.codec.bits)
            out = decode_attention_quant(query, quant, pool["pos"], pool["valid"], local, qpos, scale, **read)
        o, lse, *attended = out  # with count, the slots attended too
        return Partial(o, lse, attended=attended[0] if attended else None)


class AutoBackend(TritonBackend):
    """The default: :class:`TritonBackend` for stores on CUDA when triton is installed, the torch reference
    otherwise (CPU, or no triton)."""

    name = "auto"

    def fused(self, store: PagedStore, queries: int, groups: int, want_mass: bool) -> bool:
        return HAVE_TRITON and store.device.type == "cuda" and super().fused(store, queries, groups, want_mass)


BACKENDS = {"auto": AutoBackend, "torch": TorchBackend, "triton": TritonBackend}


def make_backend(name: str = "auto") -> TorchBackend:
    """The attention backend called ``name``: ``"auto"`` (Triton on CUDA, torch elsewhere), ``"torch"`` or
    ``"triton"`` (also on CPU tensors, where it needs ``TRITON_INTERPRET=1``)."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {tuple(BACKENDS)}, got {name!r}")
    return BACKENDS[name]()
