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
    "heads",  # (row, KV head) pairs of the steps
    "tokens_attended",
    "pages_gathered",
    "pages_stored",
    "tokens_stored",
    "slots_gathered",  # pages read x page size
    "bytes_fetched",  # key/value bytes of pages read from tiers on another device (offload)
    "dense_passes",  # dense attention weights computed besides the read (output_attentions)
)
_INDEX = {name: i for i, name in enumerate(FIELDS)}


class ReadStats:
    """Sums over decode steps, batch rows and KV heads of one layer."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None  # [len(FIELDS)] int64 on the layer's device
        self.recall_sum = 0.0
        self.recall_heads = 0
        self._step_counts: dict[tuple, torch.Tensor] = {}  # (sparse, heads, device) -> [3] constant counts

    def _total(self, device: torch.device) -> torch.Tensor:
        if self.total is None or self.total.device != device:
            self.total = torch.zeros(len(FIELDS), dtype=torch.int64, device=device)
        return self.total

    def add_step(self, sparse: bool, heads: int, device: torch.device) -> None:
        """One decode step: whether it read sparsely and how many (row, KV head) pairs it read for (one in-place
        addition of a constant kept per key)."""
        total = self._total(device)
        key = (sparse, heads, device)
        if key not in self._step_counts:
            self._step_counts[key] = torch.tensor([1, int(sparse), heads], dtype=torch.int64, device=device)
        total[:3].add_(self._step_counts[key])

    def add_counts(self, first: str, values: torch.Tensor, device: torch.device) -> None:
        """Add ``values`` (int64 ``[n]``) to the ``n`` counters from ``first`` on (in :data:`FIELDS` order): one
        in-place addition."""
        i = _INDEX[first]
        self._total(device)[i : i + values.numel()].add_(values.to(device))

    def add(self, device: torch.device, **counts: int) -> None:
        """Add Python ``counts`` to the named counters."""
        total = self._total(device)
        for name, value in counts.items():
            total[_INDEX[name]] += value

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
