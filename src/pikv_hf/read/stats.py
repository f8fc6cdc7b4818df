"""What sparse decode reads cost and keep: counters accumulated per layer over routed / Quest steps."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RoutingStats:
    """Sums over decode steps, batch rows and KV heads of one layer."""

    steps: int = 0
    heads: int = 0  # (row, KV head) pairs read, summed over steps
    tokens_attended: int = 0
    tokens_stored: int = 0
    pages_gathered: int = 0
    pages_stored: int = 0
    slots_gathered: int = 0  # pages read x page size
    recall_sum: float = 0.0
    recall_heads: int = 0
    bytes_fetched: int = 0  # key/value bytes of pages read from tiers on another device (offload)

    def as_dict(self) -> dict[str, float]:
        return {
            "steps": self.steps,
            "selected_tokens_per_head": self.tokens_attended / max(1, self.heads),
            "fraction_tokens_attended": self.tokens_attended / max(1, self.tokens_stored),
            "fraction_pages_read": self.pages_gathered / max(1, self.pages_stored),
            # slots moved (empty slots of partly filled pages included) over the tokens a dense cache would read
            "kv_read_vs_dense": self.slots_gathered / max(1, self.tokens_stored),
            "recall": self.recall_sum / self.recall_heads if self.recall_heads else float("nan"),
            "bytes_fetched_per_step": self.bytes_fetched / max(1, self.steps),
        }

    def add(self, other: RoutingStats) -> None:
        for name, value in vars(other).items():
            setattr(self, name, getattr(self, name) + value)
