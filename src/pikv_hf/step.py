"""``DecodeStep``: one attention call over the parts of a layer's KV, the same path for every kind of layer.

The parts are the stores of a ``StoreGroup``: a layer's hot store and its tiers, or the local partitions of a
distributed layer. One call

1. plans: the read policy turns the query into one ``ReadPlan`` per store (all exact for a dense read);
2. attends: the backend computes each store's partial ``(o, lse)`` on that store's device;
3. merges the partials exactly by log-sum-exp, then with other ranks' (``remote``: a distributed layer's
   all-gather), then with the attention sinks (GPT-OSS);
4. records what a decode step read (``ReadStats``: tensors, no host read) and, when asked, its recall against
   exact attention (that needs the host).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from pikv_hf.attention import Partial, TorchBackend, merge_partials, sink_partial
from pikv_hf.read import ExactRead, ReadPlan, ReadStats, sink_or_recent
from pikv_hf.store import PagedStore
from pikv_hf.store.group import StoreGroup

Remote = Callable[[torch.Tensor, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]


@dataclass
class Query:
    """What one attention call asks: ``query`` ``[B, Hq, q, Dk]`` of the tokens at positions ``qpos`` (``[q]``),
    its logit ``scale``, the layer's ``sliding_window`` and attention ``sinks`` (``[Hq]``, GPT-OSS), each row's
    first real position ``row_start`` (``[B]``, where sinks are counted) and which queries are real (``present``,
    ``[B, q]``; None: all)."""

    query: torch.Tensor
    qpos: torch.Tensor
    scale: float
    sliding_window: int | None
    sinks: torch.Tensor | None
    row_start: torch.Tensor
    present: torch.Tensor | None = None

    def grouped(self, heads: int) -> torch.Tensor:
        """``[B, H, G, Dk]``: the query rows that share each of ``heads`` KV heads."""
        b, hq, q, dk = self.query.shape
        return self.query.reshape(b, heads, hq // heads * q, dk)


def whole_rows(plan: ReadPlan, store: PagedStore, rows: torch.Tensor) -> ReadPlan:
    """``plan`` with the batch rows ``rows`` (``[B]`` bool) reading every page of ``store``'s frame in full (what an
    exact read reads), widened to the frame if it is narrower (a Quest budget)."""
    if plan.exact:
        return plan
    w = store.table.width()
    extra = w - plan.pages.shape[-1]
    every = rows.view(-1, 1, 1)
    frame = torch.arange(w, device=store.device)
    # the pages in use (the frame runs past shorter runs, and a run's reserved pages past its last hold nothing: a
    # read of one-token pages takes every planned page as one token, without its valid bit)
    frame = torch.where(frame < store.table.n_pages.unsqueeze(-1), frame, -1)
    pages = torch.where(every, frame, F.pad(plan.pages, (0, extra), value=-1))
    full = None if plan.page_full is None else F.pad(plan.page_full, (0, extra), value=False) | every
    return replace(plan, pages=pages, page_full=full, lengths=None)  # its rows' counts no longer hold


class DecodeStep:
    """Plan, attend, merge and record for one layer (module docstring). ``policy`` and ``stats`` are the layer's;
    ``backend`` may be shared by the layers of a cache."""

    def __init__(self, policy: ExactRead, backend: TorchBackend, groups: int = 1, remote: Remote | None = None):
        self.policy, self.backend, self.groups, self.remote = policy, backend, groups, remote
        self.stats = ReadStats()
        self._steps = 0  # sparse decode steps of a learning selector (its reward schedule), on the host

    def __call__(
        self,
        group: StoreGroup,
        x: Query,
        sparse: bool = False,
        record: bool = False,
        mass_of: PagedStore | None = None,
        dense_rows: torch.Tensor | None = None,
    ) -> Partial:
        """Attention of ``x`` over every store of ``group``: under the read policy when ``sparse`` (except the batch
        rows where ``dense_rows``, ``[B]`` bool, is True: they read every page), else exactly; ``record`` adds the
        read to ``stats``; ``mass_of`` (a store of the group) also returns the attention mass of its slots
        (``Partial.mass`` / ``slots``)."""
        stores = group.stores
        if record and torch.compiler.is_compiling():
            self._refuse_traced_learning(sparse)
        if sparse:
            plans = self.policy.plans(group, x.grouped(group.heads), x.scale, x.qpos[-1:], x.row_start)
            if dense_rows is not None:
                plans = [whole_rows(p, s, dense_rows.to(s.device)) for p, s in zip(plans, stores, strict=True)]
        else:
            plans = [ReadPlan() for _ in stores]
        one = len(stores) == 1 and self.remote is None
        parts = [
            self.backend.attend(
                x.query.to(s.device),
                s,
                plan,
                x.qpos.to(s.device),
                x.scale,
                x.sliding_window,
                x.sinks if one else None,
                self.groups,
                one and s is mass_of,  # else once the merged log-sum-exp is known (below)
                record,
                i == 0 and group.holds_newest,  # the hot store holds the token being decoded
            )
            for i, (s, plan) in enumerate(zip(stores, plans, strict=True))
        ]
        if one:
            out = parts[0]
        else:
            d = group.device
            o, lse = merge_partials([(p.o.to(d), p.lse.to(d)) for p in parts])
            if self.remote is not None:
                o, lse = merge_partials(self.remote(o, lse))
            if x.sinks is not None:
                o, lse = merge_partials([(o, lse), sink_partial(x.sinks, o)])
            out = Partial(o, lse)  # slots attended: per store, in _record
            if mass_of is not None:  # a slot's share of everything the query read: tiers, other ranks and sinks
                i = next(i for i, s in enumerate(stores) if s is mass_of)
                d = mass_of.device
                mass = self.backend.attend(
                    x.query.to(d), mass_of, plans[i], x.qpos.to(d), x.scale, x.sliding_window, None, self.groups,
                    want_mass=True, mass_lse=lse.to(d),
                )  # fmt: skip
                out = Partial(o, lse, mass.mass, mass.slots)
        if mass_of is not None:
            self._record_mass(mass_of, x, out, sum(s.stats.count.sum(-1).to(mass_of.device) for s in stores))
        if record:
            self._record(group, plans, parts, sparse)
            self._learn(group, x, plans[0], sparse, dense_rows)
        return out

    def _refuse_traced_learning(self, sparse: bool) -> None:
        """``ValueError`` inside a traced step that would measure recall (``measure_recall``) or teach a learning
        selector: both read back to the host and count in Python every step, so a compiled step recompiled at every
        step (recall) or failed to trace the selector's sampling (its ``torch.Generator``)."""
        cfg = self.policy.config
        if cfg.measure_recall or (sparse and self.policy.learns()):
            why = "measure_recall=True" if cfg.measure_recall else f"selector {cfg.selector!r} (it learns from recall)"
            raise ValueError(
                f"a compiled decode step cannot read with {why}: recall is read back to the host and counted in Python "
                "at every step; decode eagerly (generate(..., disable_compile=True)), or use measure_recall=False and "
                "a selector that does not learn"
            )

    @staticmethod
    def _record_mass(store: PagedStore, x: Query, part: Partial, held: torch.Tensor) -> None:
        """Accumulate each slot's attention mass (summed over the query rows of its KV head: its query heads times
        the row's real tokens of this call); a *hit* is a slot that received more than a uniform share of those rows'
        mass over the ``held`` tokens read (``[B, H]``: every store's); ``last_access`` is the position of the latest
        query that hit it."""
        b, hq, q, _ = x.query.shape
        n_valid = held.unsqueeze(-1).clamp(min=1)  # [B, H, 1]
        real = torch.full((b,), q, device=n_valid.device) if x.present is None else x.present.sum(-1)
        hit = part.mass * n_valid > (hq // store.heads * real).view(-1, 1, 1)
        store.add_stats(part.slots.reshape(-1), part.mass.reshape(-1), hit.reshape(-1), x.qpos[-1:])

    def _record(self, group: StoreGroup, plans: list[ReadPlan], parts: list[Partial], sparse: bool) -> None:
        """Add one decode step's read to ``stats``: per store one operator adding its ``[B, H]`` counters (slots
        attended, pages read and stored, tokens stored, slots read, bytes fetched from an offloaded store) summed over
        rows and heads (``ReadStats.add_read``: no host read)."""
        step = (1, int(sparse), group.heads * group.batch)
        for s, plan, part in zip(group.stores, plans, parts, strict=True):
            page_bytes = s.pool.nbytes(s.kv_fields) // max(1, s.pool.num_pages) if s in group.offloaded else 0
            self.stats.add_read(
                group.device, part.attended, plan.pages, s.table.n_pages, s.stats.count, s.page_size, page_bytes, step
            )
            step = (0, 0, 0)

    def _learn(
        self, group: StoreGroup, x: Query, plan: ReadPlan, sparse: bool, dense_rows: torch.Tensor | None = None
    ) -> None:
        """Recall of the read against exact attention, on the steps that ask for it (``measure_recall``, a learning
        selector's reward, given for sparse reads only, to the rows that read their selection: not ``dense_rows``):
        the only part of a step that reads back to the host."""
        cfg = self.policy.config
        learn = False
        if sparse and self.policy.learns():  # counted only here: compiled steps (no learning) mutate no Python state
            self._steps += 1
            learn = self._steps % cfg.reward_every == 0
        if not (cfg.measure_recall or learn):
            return
        recall = self.recall(group, x, plan)
        self.stats.add_recall(recall)
        if learn:
            rows = None if dense_rows is None else (~dense_rows).nonzero().squeeze(1).to(recall.device)
            if rows is None or rows.numel():
                self.policy.feedback(x.grouped(group.heads), recall, rows)

    def recall(self, group: StoreGroup, x: Query, plan: ReadPlan) -> torch.Tensor:
        """``[B, H]`` fraction of exact attention's probability mass on the tokens ``plan`` lets the query read."""
        if len(group.stores) > 1:
            raise RuntimeError(
                "recall (measure_recall, learning selectors) is measured on the hot store only, and this layer holds "
                "tokens in tiers"
            )
        st = group.stores[0]
        if plan.exact:
            return torch.ones(st.batch, st.heads, device=st.device)
        exact = self.backend.attend(x.query, st, ReadPlan(), x.qpos, x.scale, x.sliding_window, x.sinks, want_mass=True)
        p = st.page_size
        full = (plan.pages >= 0) if plan.page_full is None else plan.page_full & (plan.pages >= 0)
        read_full = torch.zeros(st.batch, st.heads, st.table.width(), dtype=torch.int64, device=st.device)
        read_full.scatter_add_(2, plan.pages.clamp(min=0), full.long())
        kept = (read_full > 0).repeat_interleave(p, dim=-1)
        if plan.page_full is not None:
            kept = kept | sink_or_recent(st.frame("pos"), x.qpos[-1:], plan.n_sink, plan.window, x.row_start)
        mass = exact.mass
        return (mass * kept).sum(-1) / mass.sum(-1).clamp(min=torch.finfo(torch.float32).tiny)
