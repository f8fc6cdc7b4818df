"""``ReadConfig``: how decode steps read a ``PiKVCache`` (exact, routed shards, Quest pages), validated in one place.

The cache (``PiKVCache(..., attention=..., **options)`` and ``set_attention``), the ``pikv-hf eval`` command line and
the evaluation harness all build their read settings through :meth:`ReadConfig.build`, so every option is declared,
documented and checked once.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from pikv_hf.checks import check_int_at_least, is_number

ATTENTION_MODES = ("exact", "routed", "quest")
# sinks and recent window of a sparse read, at most: every layer keeps one slot per (row, KV head) for each
# (``SpecialSlots``), so 2**20 held 126 MB for a 21-token context and 10**30 overflowed at the first forward
MAX_SPECIAL = 2**16
# Context (positions seen per row) from which a decode step reads sparsely when ``sparse_from`` is not given: where
# the sparse read stopped costing more than PiKV's exact read on SmolLM2-135M (fp32, one CPU thread, batch 1 and 4;
# benchmarks/results/e2e_always_sparse_cpu.json). Below it, planning a sparse read costs more than it saves.
SPARSE_FROM = {"routed": 8192, "quest": 4096}


@dataclass(frozen=True)
class ReadConfig:
    """Settings of decode-time reads (PiKV Routing) and of the Quest page baseline.

    In ``"routed"`` mode each decode query attends, per batch row and KV head, only to the tokens of its
    ``top_k_shards`` selected shards, plus always the first ``n_sink`` real tokens of its row and its last
    ``window`` positions. In ``"quest"`` mode selection is per page instead, as in Quest (Tang et al., "Quest:
    Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024): every (row, KV head) reads
    ``ceil(read_fraction * pages stored)`` pages, the pages holding sink or recent-window tokens first, then the pages
    with the largest upper bound of ``q . k`` from per-page key min / max. Prefill (several new tokens) stays exact.

    Attributes
    ----------
    attention : str
        ``"exact"`` (default), ``"routed"`` or ``"quest"``.
    top_k_shards : int or None
        Routed: shards selected per query, in ``[1, num_shards]``.
    selector : str
        Routed: selection router (``pikv_hf.routing.SELECTORS``).
    selector_kwargs : dict
        Routed: constructor arguments of the selector, e.g. ``{"score": "bound"}``.
    n_sink, window : int
        Always-read first real tokens of a row and recent positions (routed and Quest), each at most
        ``MAX_SPECIAL`` (65536).
    read_fraction : float or None
        Quest: fraction of each (row, KV head)'s pages read per decode step, in ``(0, 1]``.
    dense_layers : int
        The first ``dense_layers`` decoder layers read every page at decode time (Quest keeps its first two
        layers dense); counted as full reads in ``routing_stats``.
    mass_target : float or None
        Routed: read only the shortest prefix of the ranked shards whose estimated share of the attention mass
        (``pikv_hf.routing.scores.estimated_mass``) reaches this value, in ``(0, 1]``; ``top_k_shards`` is a cap.
    sparse_from : int or None
        Routed / Quest: decode steps read every page until the layer has seen this many positions per row (below it
        a dense read costs less than planning a sparse one; ``routing_stats`` counts ``sparse_layer_steps``). None: the
        measured default of the mode (:data:`SPARSE_FROM`: 8192 routed, 4096 Quest); 0: always sparse.
    measure_recall : bool
        Also run exact attention on every routed step and record the fraction of its mass the read tokens hold.
    reward_every : int
        Learning selectors (``adaptive``) get that recall as reward every ``reward_every`` routed steps.
    """

    attention: str = "exact"
    top_k_shards: int | None = field(default=None, metadata={"help": "routed: shards read per query"})
    selector: str = field(default="topk", metadata={"help": "routed: selection router"})
    selector_kwargs: dict = field(default_factory=dict)
    n_sink: int = field(default=4, metadata={"help": "sink tokens always read (routed / quest)"})
    window: int = field(default=64, metadata={"help": "recent tokens always read (routed / quest)"})
    read_fraction: float | None = field(default=None, metadata={"help": "quest: fraction of pages read"})
    dense_layers: int = field(default=0, metadata={"help": "leading layers with exact decode attention"})
    mass_target: float | None = field(
        default=None, metadata={"help": "routed: read ranked shards until this estimated attention mass"}
    )
    sparse_from: int | None = field(
        default=None,
        metadata={
            "help": "routed / quest: decode steps read densely until this many positions per row (default: 0, sparse "
            "from the first step)"
        },
    )
    measure_recall: bool = False
    reward_every: int = 16

    @property
    def sparse(self) -> bool:
        return self.attention != "exact"

    @property
    def sparse_threshold(self) -> int:
        """``sparse_from``, or the mode's measured default (:data:`SPARSE_FROM`) when it is None."""
        if self.sparse_from is not None:
            return self.sparse_from
        return SPARSE_FROM.get(self.attention, 0)

    @classmethod
    def build(
        cls, attention: str | ReadConfig = "exact", *, num_shards: int | None, num_layers: int | None = None, **options
    ) -> ReadConfig:
        """A validated ``ReadConfig`` from a mode name and options (or an existing config, re-validated).

        ``num_shards`` bounds ``top_k_shards`` (read only in routed mode); ``num_layers`` bounds ``dense_layers``
        when known. Unknown option names raise ``TypeError``; bad values ``ValueError`` naming the option.
        """
        if isinstance(attention, ReadConfig):
            if options:
                attention = dataclasses.replace(attention, **options)
            return attention.validated(num_shards, num_layers)
        names = {f.name for f in dataclasses.fields(cls)} - {"attention"}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"unknown read option(s) {', '.join(unknown)}; expected some of {', '.join(sorted(names))}")
        kwargs = options.get("selector_kwargs")
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict):
            raise TypeError(f"selector_kwargs must be a dict of the selector's arguments, got {kwargs!r}")
        options["selector_kwargs"] = dict(kwargs)
        return cls(attention=attention, **options).validated(num_shards, num_layers)

    def validated(self, num_shards: int | None, num_layers: int | None) -> ReadConfig:
        """Check every field (see :meth:`build`); returns the config with numbers normalised."""
        from pikv_hf.routing import make_selector

        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_MODES)}; got {self.attention!r}")
        check_int_at_least("n_sink", self.n_sink, 0, MAX_SPECIAL)
        check_int_at_least("window", self.window, 1, MAX_SPECIAL)
        check_int_at_least("reward_every", self.reward_every, 1)
        if self.sparse_from is not None:
            check_int_at_least("sparse_from", self.sparse_from, 0)
        most = num_layers if num_layers is not None else "the number of layers"
        if not isinstance(self.measure_recall, bool):
            raise TypeError(f"measure_recall must be a bool, got {self.measure_recall!r}")
        dense = self.dense_layers
        if not isinstance(dense, int) or isinstance(dense, bool) or not 0 <= dense <= (num_layers or dense):
            raise ValueError(f"dense_layers must be an integer in [0, {most}], got {self.dense_layers!r}")
        try:  # the routed options are checked in every mode: a bad value is refused even where it is not read
            make_selector(self.selector, **self.selector_kwargs)
        except TypeError as err:
            kwargs = self.selector_kwargs
            raise ValueError(f"selector_kwargs {kwargs} do not fit selector {self.selector!r}: {err}") from None
        target = self.mass_target
        if target is not None and not (is_number(target) and 0 < target <= 1):
            raise ValueError(f"mass_target must be None or a number in (0, 1], got {target!r}")
        if self.attention == "exact":
            return self
        if self.attention == "routed":
            top_k, limit = self.top_k_shards, num_shards
            if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= (limit or top_k):
                raise ValueError(
                    f"top_k_shards must be an integer in [1, num_shards={limit}] for attention='routed', got {top_k!r}"
                )
            return dataclasses.replace(self, read_fraction=None, mass_target=None if target is None else float(target))
        if self.mass_target is not None:
            raise ValueError("mass_target applies to attention='routed' (shard selection) only; got attention='quest'")
        f = self.read_fraction
        if not (is_number(f) and 0 < f <= 1):
            raise ValueError(f"read_fraction must be a number in (0, 1] for attention='quest', got {f!r}")
        return dataclasses.replace(self, top_k_shards=None, read_fraction=float(f))

    # ------------------------------------------------------------------ command line
    CLI_FIELDS = ("selector", "n_sink", "window", "dense_layers", "mass_target", "sparse_from")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add ``--selector --n-sink --window --dense-layers --mass-target`` (the options a command line sets; the
        mode and its ``top_k_shards`` / ``read_fraction`` come from the evaluated point)."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name in cls.CLI_FIELDS:
            f = fields[name]
            kind = float if name == "mass_target" else (str if name == "selector" else int)
            parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=f.default, help=f.metadata["help"])

    @classmethod
    def from_arguments(cls, args: argparse.Namespace) -> dict:
        """The options of :meth:`add_arguments` as keyword arguments."""
        return {name: getattr(args, name) for name in cls.CLI_FIELDS}
