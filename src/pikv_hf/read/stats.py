"""What sparse decode reads cost and keep: counters accumulated per layer, as one tensor on the layer's device.

A decode step adds to the counters with tensor operations only (no host read); they become numbers when
:meth:`ReadStats.as_dict` is called (``PiKVCache.routing_stats()``). Recall, measured only on the steps that ask for
it (``measure_recall``, learning selectors), is read back there and kept as Python numbers.
"""

from __future__ import annotations

import torch

FIELDS = (
    "steps",  # decode steps of this layer
    "sparse_steps",  # of those, read under the routed / Quest policy (the others read densely)
    "dense_passes",  # dense attention weights computed besides the read (output_attentions)
    "heads",  # (row, KV head) pairs of the sparse steps
    "tokens_attended",
    "tokens_stored",
    "pages_gathered",
    "pages_stored",
    "slots_gathered",  # pages read x page size
    "bytes_fetched",  # key/value bytes of pages read from tiers on another device (offload)
)
_INDEX = {name: i for i, name in enumerate(FIELDS)}


class ReadStats:
    """Sums over decode steps, batch rows and KV heads of one layer."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None  # [len(FIELDS)] int64 on the layer's device
        self.recall_sum = 0.0
        self.recall_heads = 0

    def add(self, device: torch.device, **counts: torch.Tensor | int) -> None:
        """Add ``counts`` (int64 tensors of any shape, summed, or Python ints) to the named counters."""
        if self.total is None or self.total.device != device:
            self.total = torch.zeros(len(FIELDS), dtype=torch.int64, device=device)
        values = [torch.as_tensor(v, device=device).sum().to(torch.int64) for v in counts.values()]
        index = torch.tensor([_INDEX[name] for name in counts], device=device)
        self.total.index_add_(0, index, torch.stack(values))

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
        c = self.counts()
        return {
            "steps": c["steps"],
            "sparse_steps": c["sparse_steps"],
            "dense_passes": c["dense_passes"],
            "selected_tokens_per_head": c["tokens_attended"] / max(1, c["heads"]),
            "fraction_tokens_attended": c["tokens_attended"] / max(1, c["tokens_stored"]),
            "fraction_pages_read": c["pages_gathered"] / max(1, c["pages_stored"]),
            # slots moved (empty slots of partly filled pages included) over the tokens a dense cache would read
            "kv_read_vs_dense": c["slots_gathered"] / max(1, c["tokens_stored"]),
            "recall": self.recall_sum / self.recall_heads if self.recall_heads else float("nan"),
            "bytes_fetched_per_step": c["bytes_fetched"] / max(1, c["steps"]),
        }
