"""What sparse decode reads cost and keep: counters accumulated per layer, as one tensor on the layer's device.

A decode step adds to the counters with tensor operations only (no host read); they become numbers when
:meth:`ReadStats.as_dict` is called (``PiKVCache.routing_stats()``). Recall, measured only on the steps that ask for
it (``measure_recall``, learning selectors), is read back there and kept as Python numbers.
"""

from __future__ import annotations

import torch

from pikv_hf.kernels.read_stats import record  # torch.ops.pikv.record_read

FIELDS = (
    "steps",  # decode steps of this layer (layer-steps once summed over layers)
    "sparse_steps",  # of those, read under the routed / Quest policy (the others read densely)
    "heads",  # (row, KV head) pairs of the steps
    "tokens_attended",
    "pages_gathered",
    "pages_stored",
    "tokens_stored",
    "slots_gathered",  # pages read x page size
    "bytes_fetched",  # key/value bytes of pages read from tiers on another device (offload)
    "slots_stored",  # pages stored x page size (stores of different page sizes: each its own)
    "dense_passes",  # dense attention weights computed besides the read (output_attentions)
)
_INDEX = {name: i for i, name in enumerate(FIELDS)}


class ReadStats:
    """Sums over decode steps, batch rows and KV heads of one layer."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None  # [len(FIELDS)] int64 on the layer's device
        self.recall_sum = 0.0
        self.recall_heads = 0

    def _total(self, device: torch.device) -> torch.Tensor:
        if self.total is None or self.total.device != device:
            self.total = torch.zeros(len(FIELDS), dtype=torch.int64, device=device)
        return self.total

    def prepare(self, heads: int, device: torch.device) -> None:
        """Allocate the counters before a compiled step runs, so that the step mutates no Python state (a compiled step
        would otherwise recompile once). ``heads``: the (row, KV head) pairs of a step."""
        self._total(device)

    def add_read(
        self,
        device: torch.device,
        attended: torch.Tensor,
        pages: torch.Tensor | None,
        n_pages: torch.Tensor,
        count: torch.Tensor,
        page_size: int,
        page_bytes: int = 0,
        step: tuple[int, int, int] = (0, 0, 0),
    ) -> None:
        """Add one store's read of a decode step (one operator, ``torch.ops.pikv.record_read``): slots ``attended``
        (``[B, H]``), the plan's ``pages`` (``[B, H, n]``, ``-1``: none; None: every stored page), pages stored
        ``n_pages`` (``[B, H]``), tokens stored per shard ``count`` (``[B, H, S]``), ``page_size`` and bytes fetched
        per page read (``page_bytes``, 0 unless offloaded); ``step``: the step's own ``(steps, sparse_steps, heads)``
        (given with the first store of a step)."""
        total = self._total(device)
        if attended.device != device:  # a store on another device (an offload tier): its figures come over
            attended, n_pages, count = attended.to(device), n_pages.to(device), count.to(device)
            pages = None if pages is None else pages.to(device)
        record(total, attended, pages, n_pages, count, page_size, page_bytes, *step)

    def add(self, device: torch.device, **counts: int) -> None:
        """Add Python ``counts`` to the named counters."""
        total = self._total(device)
        for name, value in counts.items():
            total[_INDEX[name]].add_(value)  # in place through the view (no write-back copy)

    def clear(self) -> None:
        """Start over (``PiKVCache.reset``): the counters zeroed in place (a compiled step keeps adding to the same
        tensor), recall forgotten."""
        if self.total is not None:
            self.total.zero_()
        self.recall_sum, self.recall_heads = 0.0, 0

    def add_recall(self, recall: torch.Tensor) -> None:
        """Recall of one step (``[B, H]``): read back to the host (only on steps that measure it)."""
        self.recall_sum += float(recall.sum())
        self.recall_heads += recall.numel()

    def merged(self, other: ReadStats) -> ReadStats:
        """The sum of two layers' statistics (a new object)."""
        out = ReadStats()
        totals = [t.cpu() for t in (self.total, other.total) if t is not None]
        out.total = sum(totals) if totals else None
        out.recall_sum = self.recall_sum + other.recall_sum
        out.recall_heads = self.recall_heads + other.recall_heads
        return out

    def counts(self) -> dict[str, int]:
        """The counters as Python ints (one host read)."""
        if self.total is None:
            return dict.fromkeys(FIELDS, 0)
        return dict(zip(FIELDS, self.total.tolist(), strict=True))

    def as_dict(self) -> dict[str, float]:
        """The figures of :meth:`PiKVCache.routing_stats`; steps are *layer*-steps (one layer's read at one decode
        step): summed over layers, a decode step of an L-layer model counts L.

        - ``layer_steps``, ``sparse_layer_steps``: decode steps of the layer(s) recorded, and those read under the
          routed / Quest policy (the others read densely: below ``sparse_from``, or in ``dense_layers``).
        - ``dense_passes``: dense attention weights computed besides the read (``output_attentions``).
        - ``selected_tokens_per_head``: tokens read per (row, KV head) and layer-step.
        - ``fraction_tokens_attended``, ``fraction_pages_read``: tokens read over tokens stored, pages read over
          pages stored (1.0: a dense read).
        - ``kv_read_vs_dense``: KV slots a step moves over the slots a dense read of the same pages moves (empty
          slots of partly filled pages count on both sides), so it never exceeds 1.0. How much more a paged read moves
          than a contiguous cache (``DynamicCache``) is ``kv_read_vs_dense / page_fill``.
        - ``page_fill``: tokens stored over page slots stored (few shards of many partly filled pages: a short
          context over many shards leaves most slots empty).
        - ``recall``: exact attention's mass on the tokens read (NaN unless measured).
        - ``bytes_fetched_per_layer_step``: bytes read back from offload tiers per layer-step.

        A cache whose mode is ``"exact"`` records nothing (every step reads everything): its steps count 0 and its
        read fractions are 1.0.
        """
        c = self.counts()
        read = c["steps"] > 0
        return {
            "layer_steps": c["steps"],
            "sparse_layer_steps": c["sparse_steps"],
            "dense_passes": c["dense_passes"],
            "selected_tokens_per_head": c["tokens_attended"] / max(1, c["heads"]),
            "fraction_tokens_attended": c["tokens_attended"] / max(1, c["tokens_stored"]) if read else 1.0,
            "fraction_pages_read": c["pages_gathered"] / max(1, c["pages_stored"]) if read else 1.0,
            "kv_read_vs_dense": c["slots_gathered"] / max(1, c["slots_stored"]) if read else 1.0,
            "page_fill": c["tokens_stored"] / max(1, c["slots_stored"]) if read else float("nan"),
            "recall": self.recall_sum / self.recall_heads if self.recall_heads else float("nan"),
            "bytes_fetched_per_layer_step": c["bytes_fetched"] / max(1, c["steps"]),
        }
