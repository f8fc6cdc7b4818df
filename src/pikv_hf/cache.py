"""``PiKVCache``: a ``transformers.Cache`` whose layers store KV in expert shards of fixed-size pages.

The cache is a container of ``PiKVLayer`` objects (``layer.py``); per-layer policy lives in the layer. Data flow of
one forward (see docs/ARCHITECTURE.md):

0. The decoder's forward hook (``hf.py``) calls ``begin_forward``: the cache learns the left padding of the new
   tokens and whether the forward runs the ``"pikv"`` attention, before any layer stores anything.
1. ``PiKVCache.update(k, v, layer_idx)`` -> ``PiKVLayer.update``: placement router -> ``PagedStore.append`` ->
   a ``PagedKV`` handle (not tensors).
2. transformers calls the registered ``"pikv"`` attention function (``hf.py``) with that handle; it calls
   ``PiKVLayer.attend`` -> ``DecodeStep``: read policy -> ``ReadPlan`` -> attention backend -> ``(o, lse)``.
"""

from __future__ import annotations

import copy
import operator
import weakref
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from pikv_hf.attention.triton_backend import make_backend
from pikv_hf.checks import check_int_at_least
from pikv_hf.config import ReadConfig
from pikv_hf.distributed import ShardPlan, bind
from pikv_hf.distributed.layer import PartitionedLayer
from pikv_hf.forward import ForwardState, PagedKV
from pikv_hf.hf import ForwardAwareCache, attach, detach
from pikv_hf.layer import PiKVLayer
from pikv_hf.memory import held_nbytes
from pikv_hf.read import ReadStats, make_policy
from pikv_hf.routing import ExpertTap, check_placement_name, make_placement
from pikv_hf.routing.expert import decoder_layers, num_experts_of
from pikv_hf.static_layer import StaticPiKVLayer
from pikv_hf.store.paged import MAX_POSITION, check_num_shards, check_page_size

DEFAULT_DENSE_SHARDS = 8


def sliding_layers(text_config: PretrainedConfig) -> list[bool]:
    """Which decoder layers slide, read as ``DynamicCache(config)`` reads it (``layer_types``, else all layers when
    the config has a sliding window)."""
    n = text_config.num_hidden_layers
    types = getattr(text_config, "layer_types", None)
    if types is None:
        window = getattr(text_config, "sliding_window", None) or getattr(text_config, "attention_chunk_size", None)
        return [window is not None] * n
    return [t in ("sliding_attention", "chunked_attention") for t in types[:n]]


def _expert_tap(model: nn.Module) -> ExpertTap:
    """The model's ``ExpertTap`` (installed once per model, shared by every cache built on it)."""
    tap = getattr(model, "_pikv_expert_tap", None)
    if tap is None:
        tap = ExpertTap(model)
        model._pikv_expert_tap = tap
    return tap


class PiKVCache(ForwardAwareCache):
    """Expert-sharded paged KV cache; with no compression it reproduces ``DynamicCache`` exactly.

    Parameters
    ----------
    model : PreTrainedModel or PretrainedConfig
        The model (the cache attaches it: ``"pikv"`` attention and the forward hooks that hand the cache each
        forward's padding; for ``router="expert"`` also the hooks that capture expert choices) or its config (a
        cache on its own: call ``pikv_hf.attach(model)`` before running a model on it; without that it reads like a
        ``DynamicCache``).
    router : str
        Placement router: ``"round_robin"`` (alias ``"hash"``), ``"expert"`` (the model's own MoE routing from
        the previous MoE layer; MoE models only) or ``"key_cluster"`` (online k-means on keys).
    num_shards : int, optional
        Shards per layer and KV head. Default: the model's number of routed experts, or 8 for a dense model.
    page_size : int
        Tokens per page (default 16, at most 65536).
    shard_groups : int
        Exact attention computes one partial per group of shards and merges the partials with log-sum-exp, as
        shards on several devices would be (default 1).
    track_stats : bool
        Update per-token attention mass / hits / last access during attention (default False).
    attention : str or ReadConfig
        Decode-time reads: ``"exact"`` (default), ``"routed"`` (each query reads only its ``top_k_shards``
        selected shards plus sinks and a recent window) or ``"quest"`` (Quest's per-page selection); a
        ``ReadConfig`` may be given instead.
    sparse_from : int, optional
        Routed / Quest: decode steps read every page until a layer has seen this many positions per row (below it a
        dense read costs less than planning a sparse one). Default: the mode's measured threshold on a CPU
        (``pikv_hf.config.SPARSE_FROM``: 8192 routed, 4096 Quest); ``0`` reads sparsely from the first step.
        ``routing_stats()`` counts the steps that read sparsely (``sparse_layer_steps``).
    max_cache_len : int, optional
        Reserve pages for this many tokens per (row, KV head) at the first update and never move them: the exact
        decode step then runs without host synchronisation, so ``torch.compile`` captures it in one graph and the
        cache reports ``is_compileable`` (as ``StaticCache`` does). Default: grow as tokens arrive.
    partition : pikv_hf.distributed.ShardPlan, optional
        Where the shards live: partitions on several devices of this process (``ShardPlan.for_devices``,
        ``ShardPlan.from_accelerate``) or one per ``torch.distributed`` rank (``ShardPlan.for_ranks``); attention
        merges the partitions' partials exactly. Not with ``track_stats``, Quest reads, eviction or crop.
    attention_backend : str
        ``"auto"`` (default: the fused Triton kernels for a cache on CUDA when triton is installed, the torch
        reference otherwise), ``"torch"`` or ``"triton"`` (on CPU only under ``TRITON_INTERPRET=1``, for tests).
    **read_options
        The other ``ReadConfig`` fields (``sparse_from`` above, ``top_k_shards``, ``selector``,
        ``selector_kwargs``, ``n_sink``, ``window``, ``read_fraction``, ``dense_layers``, ``mass_target``,
        ``measure_recall``, ``reward_every``); see ``pikv_hf.config.ReadConfig``.

    Notes
    -----
    The cache masks by the positions it holds and reads a 2-D ``attention_mask`` for left padding only. A mask whose
    earlier columns hide a position the cache holds a token of (a DynamicCache would mask it) is refused with a
    ``ValueError`` for a forward of several tokens, and not checked for a one-token forward once every row has had
    a real token (reading the mask would make every decode step wait for the device): the token is then attended.
    Continue such a batch with a forward of several tokens (the new turn's prompt), or ``crop`` the hidden tokens.

    Examples
    --------
    >>> cache = PiKVCache(model)  # exact; router="expert" on an MoE model
    >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=32)
    >>> routed = PiKVCache(model, router="key_cluster", attention="routed", top_k_shards=2, sparse_from=0)
    >>> with PiKVCache(model) as cache:  # the model's previous attention is restored on exit
    ...     out = model.generate(**inputs, past_key_values=cache)
    """

    def __init__(
        self,
        model: nn.Module | PretrainedConfig,
        router: str = "round_robin",
        num_shards: int | None = None,
        page_size: int = 16,
        shard_groups: int = 1,
        track_stats: bool = False,
        attention: str | ReadConfig = "exact",
        max_cache_len: int | None = None,
        partition: ShardPlan | None = None,
        attention_backend: str = "auto",
        **read_options: Any,
    ) -> None:
        is_model = isinstance(model, nn.Module)
        config = getattr(model, "config", None) if is_model else model
        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"model must be a transformers model or config, got {type(model).__name__}")
        router = check_placement_name(router)
        if router == "expert" and not is_model:
            raise ValueError("router='expert' needs the model itself (its MoE routing is captured with hooks)")
        text_config = config.get_text_config()
        num_experts = num_experts_of(text_config)
        if num_shards is None:
            num_shards = num_experts or DEFAULT_DENSE_SHARDS
        check_num_shards(num_shards)
        check_page_size(page_size)
        if max_cache_len is not None:
            check_int_at_least("max_cache_len", max_cache_len, 1, MAX_POSITION + 1)
        if not isinstance(track_stats, bool):
            raise TypeError(f"track_stats must be a bool, got {track_stats!r}")
        if not isinstance(shard_groups, int) or isinstance(shard_groups, bool) or not 1 <= shard_groups <= num_shards:
            raise ValueError(f"shard_groups must be an integer in [1, num_shards={num_shards}], got {shard_groups!r}")
        n_layers = text_config.num_hidden_layers
        read = ReadConfig.build(attention, num_shards=num_shards, num_layers=n_layers, **read_options)
        if router == "expert" and num_experts is None:
            raise ValueError(
                f"router='expert' needs an MoE model; {type(config).__name__} declares no experts: use "
                "router='key_cluster' (tokens placed by key similarity) or 'round_robin'"
            )
        placed = None
        if partition is not None and max_cache_len is not None:
            raise ValueError("max_cache_len (a compileable cache) is not supported with a partition")
        backend = make_backend(attention_backend)  # one for all layers: they attend one after the other
        if partition is not None:  # checks the plan (and, over ranks, that every rank builds this cache) first
            settings = dict(num_shards=num_shards, page_size=page_size, router=router, shard_groups=shard_groups)
            placed = bind(partition, config=text_config, track_stats=track_stats, read=read, **settings)
        modules = [getattr(la, "self_attn", None) for la in decoder_layers(model)] if is_model else [None] * n_layers
        if is_model and None in modules:
            raise ValueError(
                f"PiKVCache needs a self-attention module in every decoder layer; {type(model).__name__} has none in "
                f"layer {modules.index(None)}"
            )
        tap = _expert_tap(model) if router == "expert" else None  # the model changes from here on
        if is_model:
            attach(model)
        self.backend = backend
        self._forward = ForwardState()
        self._forwards: list[ForwardState] = []  # the states of forwards in progress (nested: kvpress passes)
        sliding = sliding_layers(text_config)
        mode: dict[str, Any] = {}
        layer_class: type[PiKVLayer] = PiKVLayer
        if max_cache_len is not None:
            layer_class, mode = StaticPiKVLayer, {"max_cache_len": max_cache_len}
        elif placed is not None:
            layer_class, mode = PartitionedLayer, {"partition": placed}
        layers = [
            layer_class(
                i,
                make_placement(router, num_shards, i, tap),
                page_size,
                shard_groups,
                track_stats,
                read,
                self.backend,
                is_sliding=sliding[i],
                sliding_window=getattr(text_config, "sliding_window", None),
                attention_module=modules[i],
                forward=self._forward,
                **mode,
            )
            for i in range(n_layers)
        ]
        super().__init__(layers=layers)
        self._model = weakref.ref(model) if is_model else None
        self.router = router
        self.num_shards = num_shards
        self.page_size = page_size
        self.read = read
        self.partition = placed

    def detach(self) -> None:
        """Give the model back the attention implementation it had before this cache attached it, so caches other
        than PiKVCache see exactly the computation they would without pikv_hf (also on leaving a ``with`` block).
        The stored tokens stay; :meth:`attach` makes the model read them with the ``"pikv"`` attention again."""
        model = None if self._model is None else self._model()
        if model is not None:
            detach(model)

    def attach(self) -> None:
        """Switch the model this cache was built on (back) to the ``"pikv"`` attention."""
        model = None if self._model is None else self._model()
        if model is None:
            raise RuntimeError(
                "this PiKVCache was built from a config (or its model is gone): call pikv_hf.attach(model)"
            )
        attach(model)

    @property
    def max_cache_len(self) -> int | None:
        """Positions a reserved cache (``max_cache_len=N``) holds, None for a cache that grows."""
        lengths = [layer.max_cache_len for layer in self.layers]
        return None if None in lengths else max(lengths)

    def check_dense_reads(self, custom_mask: bool, attention_weights: bool) -> None:
        viewless = next((layer for layer in self.layers if not layer.has_view), None)
        if viewless is not None:
            what = "a custom 4-D attention_mask" if custom_mask else "output_attentions"
            raise viewless.refusal(f"{what} (read over a dense keys / values view)")

    def begin_forward(self, attention_mask: torch.Tensor | None, new_tokens: int, pikv: bool) -> None:
        """Called by the decoder's forward hook before the layers run: the padding among the ``new_tokens`` (the
        last columns of the 2-D ``attention_mask``; left padding takes no slot) and whether the forward runs the
        ``"pikv"`` attention (else ``update`` returns tensors). A one-token forward (a decode step) is read for
        padding only until every row has had a real token (``rows_started``): a chunked prefill of left-padded rows
        may bring a row's padding one token at a time, a decode step never does, and reading the mask would make
        every decode step wait for the device."""
        present = None
        if attention_mask is not None and attention_mask.dim() == 2 and (new_tokens > 1 or not self.rows_started):
            self._check_mask_history(attention_mask, new_tokens)
            mask = attention_mask[:, -new_tokens:].to(torch.bool)
            if not bool(mask.all()):
                present = mask
        # left padding precedes each row's first real token: a forward bringing one in every row ends it (once it
        # ends without an error: a forward that fails stores nothing, or is undone)
        started = self.rows_started or present is None or bool(present.any(-1).all())
        f = self._forward
        self._forwards.append(ForwardState(f.active, f.pikv, f.present, f.rows_started))
        f.active, f.pikv, f.present, f.positions, f.rows_started = True, pikv, present, None, started

    def _check_mask_history(self, attention_mask: torch.Tensor, new_tokens: int) -> None:
        """``ValueError`` (before the forward changes anything) if a 2-D ``attention_mask`` of one column per position
        seen and new hides a position this cache already holds a token of: the cache reads padding from the new
        columns only, and would attend to that token where a DynamicCache masks it (e.g. a second turn of a batch
        whose mask zeroes the first turn's tokens after a row's end of sequence)."""
        layer = next((la for la in self.layers if la.store is not None), None)
        if layer is None or not layer.seen or attention_mask.shape[1] != layer.seen + new_tokens:
            return
        old = attention_mask[:, : layer.seen].to(device=layer.store.device, dtype=torch.bool)
        # zeros at a row's left padding (before its first real token) hide nothing it holds: no stores to scan
        padding = torch.arange(layer.seen, device=old.device) < layer.row_start.unsqueeze(-1)
        if bool((old | padding).all()):
            return
        hidden = layer.held_positions(layer.seen) & ~old
        if bool(hidden.any()):
            row, pos = (int(i) for i in hidden.nonzero()[0])
            raise ValueError(
                f"attention_mask is 0 at position {pos} of row {row}, which this PiKVCache already holds a token of: "
                f"the cache reads padding from the new columns of the mask only (the last {new_tokens}), so it would "
                "attend to that token where a DynamicCache masks it; start a new cache for this context, or pass 1 "
                "for the positions the cache holds"
            )

    def forward_running(self) -> bool:
        return self._forward.active

    def end_forward(self, failed: bool = False) -> None:
        outer = self._forwards.pop() if self._forwards else ForwardState()
        f = self._forward
        if not failed:
            self.rows_started = f.rows_started
        f.active, f.pikv, f.present, f.positions = outer.active, outer.pikv, outer.present, None
        f.rows_started = outer.rows_started
        if not f.active:  # the outermost forward ended: its temporaries go (LayerEdits.end_forward)
            for layer in self.layers:
                layer.end_forward()

    def enable_stats(self) -> None:
        """Track per-slot attention statistics in every layer from now on (presses that score from them turn this
        on when they first see the cache)."""
        for layer in self.layers:
            layer.enable_stats()

    def __enter__(self) -> PiKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def set_attention(self, attention: str | ReadConfig = "exact", **read_options: Any) -> None:
        """Switch every layer's decode-time reads (arguments as in the constructor).

        Stored tokens are kept; selectors and routing statistics start fresh. Raises before changing anything. On a
        cache partitioned over ranks it is collective: every rank calls it with the same settings (checked, as when
        the caches were built; a rank that does not call it leaves the others waiting until the plan's timeout).
        """
        read = ReadConfig.build(attention, num_shards=self.num_shards, num_layers=len(self.layers), **read_options)
        if self.partition is not None:
            self.partition.check_read(read)
        for layer in self.layers:
            reason = make_policy(read, layer.layer_idx).measures_recall() if layer.tiers else None
            if reason is not None:
                raise ValueError(
                    f"layer {layer.layer_idx} holds tokens in tiers ({', '.join(layer.tiers)}) and {reason} measures "
                    "recall against exact attention over the hot store alone: use measure_recall=False and a selector "
                    "that does not learn"
                )
        self.read = read
        for layer in self.layers:
            layer.set_read(read)

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[PagedKV, PagedKV] | tuple[torch.Tensor, torch.Tensor]:
        try:
            index = operator.index(layer_idx)  # an int, numpy integer or 0-d integer tensor, as DynamicCache takes
        except TypeError:
            raise TypeError(f"layer_idx must be an integer, got {type(layer_idx).__name__} {layer_idx!r}") from None
        if isinstance(layer_idx, bool) or not 0 <= index < len(self.layers):
            raise IndexError(f"layer_idx must be in [0, {len(self.layers)}), got {layer_idx!r}")
        return self.layers[index].update(key_states, value_states, cache_kwargs)

    def _rows(self, name: str, index: torch.Tensor) -> None:
        """A layer's row check (the batch is every layer's), once for every layer (before any layer changes)."""
        next((la for la in self.layers if la.store is not None), self.layers[0])._check_rows(name, index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rows("beam_idx", beam_idx)
        for layer in self.layers:
            layer._index_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rows("indices", indices)
        for layer in self.layers:
            layer._select_rows(indices)

    def crop(self, max_length: int) -> None:
        if not isinstance(max_length, int) or isinstance(max_length, bool):
            raise TypeError(f"max_length must be an int (a position, negative: from the end), got {max_length!r}")
        super().crop(max_length)
        self.rows_started = False  # the next one-token forward is read for padding again (once)

    def fork(self) -> PiKVCache:
        """An independent copy of everything stored (pages, router and selector state, statistics).

        The copy shares only the model's expert tap, so several continuations (e.g. one per attention mode) can
        be decoded from one prefill. Its gather workspace starts empty. ``copy.deepcopy(cache)`` is the same.
        """
        return copy.deepcopy(self)

    def __deepcopy__(self, memo: dict) -> PiKVCache:
        """:meth:`fork`: a copy of everything but what serves the model and the process: the expert tap (hooked on the
        model's routers: a copied tap is never called again, and placing by it would read stale experts), the
        partition plan (its process group) and the backend (a new one, its workspace empty)."""
        for layer in self.layers:
            tap = getattr(layer.placement, "tap", None)
            if tap is not None:
                memo.setdefault(id(tap), tap)
        memo.setdefault(id(self.partition), self.partition)
        memo.setdefault(id(self.backend), make_backend(self.backend.name))
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        for name, value in self.__dict__.items():
            copied.__dict__[name] = copy.deepcopy(value, memo)
        return copied

    def __iter__(self):
        """``(keys, values, None)`` per layer, as ``DynamicCache`` iterates (the views are position-ordered copies)."""
        for layer in self.layers:
            yield layer.keys, layer.values, None

    def tokens_per_shard(self) -> torch.Tensor:
        """``[L, S]`` valid tokens per shard and layer, summed over batch rows and KV heads."""
        return torch.stack([layer.tokens_per_shard().sum(dim=(0, 1)) for layer in self.layers])

    def resident_tokens(self) -> torch.Tensor:
        """``[L, B, H_kv]`` tokens held per layer, batch row and KV head outside the offload tier (what decode reads
        when it reads everything)."""
        return torch.stack([layer.resident_tokens() for layer in self.layers])

    def routing_stats(self) -> dict:
        """What the decode steps of a routed / Quest cache read since it was built or last ``reset()`` (the counters
        live on the device; this reads them back).

        Returns
        -------
        dict
            ``"per_layer"``: one dict per layer (:meth:`pikv_hf.read.ReadStats.as_dict`: fractions of tokens and
            pages read, ``kv_read_vs_dense``, ``page_fill``, recall, and counts per *layer*-step: ``layer_steps``,
            ``sparse_layer_steps``, ``bytes_fetched_per_layer_step``). ``"overall"``: the same over all layers
            (layer-steps summed), plus ``decode_steps`` (forwards of one new token: the most layer-steps of any
            layer) and ``bytes_fetched_per_decode_step`` (offloaded bytes one decode step reads back, summed over
            layers). An ``"exact"`` cache records nothing: steps 0, read fractions 1.0.
        """
        total = ReadStats()
        for layer in self.layers:
            total = total.merged(layer.read_stats)
        per_layer = [layer.read_stats.as_dict() for layer in self.layers]
        overall = total.as_dict()
        decode_steps = max((la["layer_steps"] for la in per_layer), default=0)
        fetched = total.counts()["bytes_fetched"]
        overall.update(decode_steps=decode_steps, bytes_fetched_per_decode_step=fetched / max(1, decode_steps))
        return {"overall": overall, "per_layer": per_layer}

    def kv_nbytes(self) -> int:
        """Bytes allocated for keys and values across layers (measured on the tensors held)."""
        return sum(layer.kv_nbytes() for layer in self.layers)

    def offloaded_nbytes(self) -> int:
        """Key/value bytes moved to offload tiers (CPU memory or memory-mapped files) across layers."""
        return sum(layer.offloaded_nbytes() for layer in self.layers)

    def meta_nbytes(self) -> int:
        """Bytes allocated for positions, valid bits, statistics, page tables and shard sums across layers."""
        return sum(layer.meta_nbytes() for layer in self.layers)

    def held_nbytes(self) -> int:
        """Bytes of every tensor storage the cache references, each storage once: K/V (resident and offloaded),
        metadata, placement and read state, and the backend's workspace (measured by walking the cache's attributes,
        ``pikv_hf.memory``)."""
        return held_nbytes(self)

    def workspace_nbytes(self) -> int:
        """Bytes of the attention backend's CPU scratch: gathers and code conversion buffers (shared by the layers; not
        part of the stored KV)."""
        return self.backend.workspace_nbytes()
