"""``StaticPiKVLayer``: a layer whose pages are reserved once, so a decode step compiles into one graph.

``PiKVCache(..., max_cache_len=N)`` builds these layers (as ``StaticCache`` reserves its tensors): every run gets
its pages for ``N`` tokens at the first update and never moves, the count of tokens seen is a tensor (so compiled
code does not bake it in), and the frame ``get_mask_sizes`` reports is the reserved one. Appends past the
reservation are refused before anything is stored, in eager code (the check reads the count back). Compiled or
captured code cannot read it back: its appends continue past ``N`` positions (rows with left padding have room to
spare), a run that outgrows its reservation overwrites its own last page, never another row's, and from then on that
row's attention output is NaN; the next eager forward raises ``ValueError`` (the count of positions is past ``N``).
"""

from __future__ import annotations

import torch

from pikv_hf.layer import PiKVLayer
from pikv_hf.store.tiers import OFFLOAD


def _traced() -> bool:
    """Whether this code is being compiled or captured (no host reads allowed)."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class StaticPiKVLayer(PiKVLayer):
    """A ``PiKVLayer`` with pages reserved for ``max_cache_len`` tokens per (row, KV head) (module docstring)."""

    is_compileable = True

    def __init__(self, *args, max_cache_len: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_cache_len = max_cache_len
        self._seen_t: torch.Tensor | None = None  # tokens seen, on the layer's device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._seen_t = torch.zeros((), dtype=torch.int64, device=key_states.device)
        self._repacks = 0
        try:
            self.store.reserve(self._pages_for(self.max_cache_len))
        except BaseException:  # no memory for max_cache_len: the layer as before, the same error at the next forward
            self.reset()
            raise

    def _pages_for(self, tokens: int) -> int:
        """Pages a run reserves for ``tokens`` tokens: one more partly filled page per shard."""
        return -(-tokens // self.page_size) + self.num_shards

    def _fit_reservation(self) -> None:
        """After an eager forward that re-packed the hot store (a press evicted tokens or moved them to a tier), its
        runs keep room for the tokens they hold plus every position still to come (``max_cache_len - seen``), not
        for ``max_cache_len`` tokens: a compiled 4-bit or offloading cache does not hold a full-precision
        reservation of the whole length beside its tier."""
        if self.store.repacks != self._repacks:
            self._reserve_rest()

    def _reserve_rest(self) -> None:
        """Runs with room for the tokens they hold plus every position still to come."""
        self._repacks = self.store.repacks
        held = int(self.store.stats.count.sum(-1).max()) if self.store.stats.count.numel() else 0
        self.store.reserve(self._pages_for(held + self.max_cache_len - self.seen), shrink=True)

    @property
    def seen(self) -> int:
        return self._seen if self._seen_t is None else int(self._seen_t)

    def _check_capacity(self, q: int) -> None:
        if _traced():
            if self.store is None:  # the first tokens set the layer up (its batch, its reserved pages) on the host
                raise ValueError(
                    f"layer {self.layer_idx}: a compiled or captured forward on a PiKVCache that holds no tokens yet; "
                    "prefill it eagerly first (generate does), then compile the decode step"
                )
            return
        seen = self.seen
        if seen > self.max_cache_len:
            raise ValueError(
                f"layer {self.layer_idx}: compiled steps stored {seen} positions, past max_cache_len="
                f"{self.max_cache_len} (rows that outgrew their reserved pages overwrote their own and decoded NaN); "
                "reset() the PiKVCache, or build it with a larger max_cache_len"
            )
        if seen + q > self.max_cache_len:
            raise ValueError(
                f"layer {self.layer_idx}: {seen + q} tokens ({seen} stored + {q} new) exceed "
                f"max_cache_len={self.max_cache_len}; build the PiKVCache with a larger max_cache_len"
            )

    def end_forward(self) -> None:
        """After an eager forward (a prefill, the presses' edits after it): what a compiled decode step reads exists
        already (special slots, page bounds, miss counts), so the step changes no attribute dynamo guards on; on CUDA
        the state tensors are marked as static addresses (``_state_tensors``)."""
        super().end_forward()
        if self.store is None or torch.compiler.is_compiling():
            return
        self._fit_reservation()
        if self.policy.sparse:
            self.policy.prepare(self._group(), self.row_start)
        if self.store.device.type == "cuda":
            for t in _state_tensors(self):
                torch._dynamo.mark_static_address(t, guard=False)

    def _token_index(self, q: int, device: torch.device) -> torch.Tensor:
        return self._seen_t + torch.arange(q, device=device)

    def _advance(self, q: int) -> None:
        self._seen_t += q

    def _set_seen(self, value: int) -> None:
        self._seen_t.fill_(value)

    def _sparse_rows(self) -> bool:
        # the count of tokens seen is a tensor here: the reservation decides, so a compiled step has one branch; a
        # layer holding tokens in the offload tier reads sparsely at any length, as an eager one does
        if not self.policy.sparse:
            return False
        return OFFLOAD in self.stores.tiers or self.max_cache_len >= self.read.sparse_threshold

    def attend(
        self, query: torch.Tensor, scale: float, sliding_window: int | None, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        out = super().attend(query, scale, sliding_window, sinks)
        if not _traced():  # eager appends never outgrow the reservation (refused above)
            return out
        return out.masked_fill(self._spilled().view(-1, 1, 1, 1), float("nan"))

    def _spilled(self) -> torch.Tensor:
        """``[B]`` bool: rows with a run that outgrew its reservation (compiled code) and overwrote its own pages."""
        t = self.store.table
        return (t.n_pages > t.cap).any(-1)

    def crop(self, max_length: int) -> None:
        if self.store is not None and bool(self._spilled().any()):
            raise ValueError(
                f"layer {self.layer_idx}: compiled steps went past max_cache_len={self.max_cache_len} and rows "
                "overwrote their own pages; crop cannot restore them: reset() the PiKVCache"
            )
        super().crop(max_length)
        if self.store is not None:  # the positions freed are to come again: a reservation a press shrank grows back
            self._reserve_rest()  # (it overflowed: wrong logits, or an IndexError that broke the cache)

    def kv_length(self) -> int:
        """The reserved frame, at least ``max_cache_len`` (as ``StaticCache`` reports its maximum length): a press
        that moved tokens out leaves a narrower frame, but positions up to ``max_cache_len`` still come (masks and
        attention weights as wide as the frame were narrower than the positions seen)."""
        if self.store is None:
            return super().kv_length()
        return max(self.store.table.width() * self.page_size, self.max_cache_len)

    def get_max_cache_shape(self) -> int:
        return self.max_cache_len

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        return super().get_mask_sizes(cache_position) if self.store is None else (self.kv_length(), 0)

    def reset(self) -> None:
        super().reset()
        self._seen_t = None


def _state_tensors(layer: StaticPiKVLayer) -> list[torch.Tensor]:
    """The CUDA tensors a layer keeps between forwards (pools, page tables, statistics, counters), reached through
    ``__dict__``s and containers (not modules, weak references or the forward's own state). A compiled decode step
    writes into them in place; marked as static addresses, CUDA graphs replay over them (a mutated input that is not
    static makes ``mode="reduce-overhead"`` skip the graph)."""
    seen, out, stack = set(), [], [v for k, v in vars(layer).items() if k != "forward"]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (torch.nn.Module, type, str, int, float, bool)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.is_cuda:
                out.append(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        else:
            stack.extend(getattr(obj, "__dict__", {}).values())
    return out
