"""The model's own queries, recomputed from a layer's input, and the attention statistics schedulers score with.

kvpress presses that recompute queries skip ``q_norm`` on Qwen3-MoE and OLMoE and so score with wrong queries.
:func:`model_queries` follows each supported attention module's own query path: ``q_proj``, then ``q_norm`` over the
whole projection (OLMoE) or per head (Qwen3, Qwen3-MoE), then the model file's own ``apply_rotary_pos_emb`` with the
layer's ``position_embeddings``. Models whose query path differs (DeepSeek's low-rank MLA queries) are refused with
a clear error rather than scored wrongly.

:func:`attention_statistics` then computes, for the queries of a prefill, what a cache with ``track_stats`` counts
during attention: per key, the attention probability it received summed over queries (H2O's accumulated attention),
the number of queries that *hit* it (gave it more than a uniform share of their mass) and the position of the last
query that did (LRU's recency).
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from pikv_hf.checks import calling_press

_SCORE_BUDGET_BYTES = 128 * 2**20  # fp32 probability bytes per query chunk (at most)
_SCORE_HIDDEN_RATIO = 4  # ... and at most this many fp32 copies of the layer input (below an MLP's activations)


def check_query_path(module: nn.Module) -> None:
    """``ValueError`` unless :func:`model_queries` follows this attention module's query path."""
    if not hasattr(module, "q_proj") or hasattr(module, "kv_a_proj_with_mqa") or hasattr(module, "q_a_proj"):
        raise ValueError(
            f"{type(module).__name__}: pikv_hf recomputes queries through q_proj (+ q_norm) and RoPE; this attention's "
            "query path (e.g. DeepSeek's multi-head latent attention) is not supported by query-scoring presses"
        )


def model_queries(
    module: nn.Module, hidden_states: torch.Tensor, kwargs: dict, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """``[B, Hq, q, D]`` post-RoPE queries of ``module`` for ``hidden_states`` (``[B, q, hidden]``).

    ``kwargs`` are the attention module's forward keyword arguments: their ``position_embeddings = (cos, sin)`` are
    used when they cover the ``q`` rows; otherwise (e.g. hidden states buffered over decode steps) the rotary
    embedding is recomputed at ``positions`` (``[q]``) with ``module.rotary_emb``, which kvpress's press context sets.
    """
    name = type(module).__name__
    check_query_path(module)
    b, q, _ = hidden_states.shape
    head_dim = module.head_dim
    states = module.q_proj(hidden_states)
    norm = getattr(module, "q_norm", None)
    per_head = norm is not None and norm.weight.numel() == head_dim
    if norm is not None and not per_head:  # OLMoE normalises the whole projection
        states = norm(states)
    states = states.view(b, q, -1, head_dim)
    if per_head:  # Qwen3 normalises each head
        states = norm(states)
    states = states.transpose(1, 2)
    cos, sin = kwargs["position_embeddings"]
    if cos.shape[-2] != q:
        rotary = getattr(module, "rotary_emb", None)
        if rotary is None or positions is None:
            raise ValueError(f"{name}: queries of {q} rows need their positions and module.rotary_emb to be rotated")
        cos, sin = rotary(states, positions.view(1, -1).expand(b, -1))
    rotate = sys.modules[type(module).__module__].apply_rotary_pos_emb
    return rotate(states, states, cos, sin)[0]


@dataclass
class AttentionStatistics:
    """Per key of a prefill (``[B, H, T]``, KV heads): accumulated probability, hits and the last hitting query."""

    mass: torch.Tensor
    hits: torch.Tensor | None  # None when only the mass was asked for
    last_hit: torch.Tensor | None  # position of the last query that hit the key; -1 if none


_MEMO: dict[int, dict] = {}  # id(hidden states) -> {(module, keys shape): statistics}, dropped with the tensor


@dataclass
class KeyLayout:
    """Where keys sit and which queries count, for :func:`attention_statistics` over a PiKVCache view: key positions
    ``pos`` and ``valid`` (``[B, H, T]``), the queries' positions ``query_pos`` (``[q]``) and ``query_ok`` (``[B, q]``,
    False for left padding, or None). Without one (:meth:`dense`) the queries are the last ``q`` keys' tokens."""

    pos: torch.Tensor
    valid: torch.Tensor
    query_pos: torch.Tensor
    query_ok: torch.Tensor | None = None

    @classmethod
    def dense(cls, t: int, n: int, kwargs: dict, device: torch.device) -> KeyLayout:
        """The layout of ``t`` position-ordered keys (a ``DynamicCache`` layer) whose last ``n`` are the tokens of the
        ``n`` queries: those at their true positions, the last ``n`` up to the forward's ``cache_position`` (the
        decode steps a buffer of hidden states spans, or the prefill itself); an earlier key ``j`` is read as
        position ``j``, before every query (a cache cut earlier keeps no positions: only the order and the
        queries' own keys count). ``ValueError`` when a press before this one removed some of the queries' own
        keys (``t < n``): where they were is not known."""
        if t < n:
            raise ValueError(
                f"{calling_press(innermost=True)}: the layer holds {t} keys for the {n} queries it scores, so a press "
                "before it removed some of those queries' own tokens, whose positions a DynamicCache does not keep; "
                "put it first in a ComposedPress, or use a PiKVCache, which keeps every token's position"
            )
        cache_position = kwargs.get("cache_position")
        last = t - 1 if cache_position is None else int(cache_position.reshape(-1)[-1])
        query_pos = torch.arange(last - n + 1, last + 1, device=device)
        pos = torch.cat([torch.arange(t - n, device=device), query_pos])
        return cls(pos.expand(1, 1, t), torch.ones(1, 1, t, dtype=torch.bool, device=device), query_pos)

    @classmethod
    def of(cls, layer, view) -> KeyLayout:
        """The layout of a PiKVCache layer's ``view`` for the queries of its latest update (the forward's padding)."""
        return cls(view.pos, view.valid, layer.last_positions, layer.forward.present)


def attention_statistics(
    module: nn.Module,
    hidden_states: torch.Tensor,
    keys: torch.Tensor,
    kwargs: dict,
    with_hits: bool = True,
    layout: KeyLayout | None = None,
) -> AttentionStatistics:
    """Causal attention statistics of the queries of ``hidden_states`` (``[B, q, hidden]``: the whole prefill, or
    hidden states buffered over decode steps) over ``keys`` (``[B, H, T, D]``, position-ordered): a query sees the
    keys at or before its position (within the window on sliding layers); a key is *hit* by it when the probability
    the query's ``G`` rows give it, summed, exceeds ``G`` over the number of keys the query sees. Attention sinks
    (GPT-OSS ``s_aux``) are not modelled. With a ``layout`` (a PiKVCache view) positions come from it, and padding
    queries or entries take no part: a row of a padded batch gets the statistics it gets alone.

    ``with_hits=False`` computes the mass alone (H2O), about half the work; ``hits`` and ``last_hit`` are then None.
    The result is remembered for these very ``hidden_states`` (a weak reference: it goes with them), so presses
    replayed on one recorded prefill (several presses and ratios) compute it once per layer.
    """
    if id(hidden_states) not in _MEMO:
        _MEMO[id(hidden_states)] = {}
        weakref.finalize(hidden_states, _MEMO.pop, id(hidden_states), None)
    memo = _MEMO[id(hidden_states)]
    key = (id(module), tuple(keys.shape), layout is None)
    if key not in memo or (with_hits and memo[key].hits is None):
        memo[key] = _attention_statistics(module, hidden_states, keys, kwargs, with_hits, layout)
    return memo[key]


def _attention_statistics(
    module: nn.Module,
    hidden_states: torch.Tensor,
    keys: torch.Tensor,
    kwargs: dict,
    with_hits: bool,
    layout: KeyLayout | None,
) -> AttentionStatistics:
    b, h, t, _ = keys.shape
    n = hidden_states.shape[1]
    device = keys.device
    if layout is None:
        layout = KeyLayout.dense(t, n, kwargs, device)
    queries = model_queries(module, hidden_states, kwargs, layout.query_pos)  # [B, Hq, q, D]
    hq, d = queries.shape[1], queries.shape[3]
    g = hq // h
    scale = getattr(module, "scaling", d**-0.5)
    window = getattr(module, "sliding_window", None)
    mass = torch.zeros(b, h, t, device=device)
    hits = torch.zeros(b, h, t, dtype=torch.int64, device=device)
    last = torch.full((b, h, t), -1, dtype=torch.int64, device=device)
    query_ok = torch.ones(b, n, dtype=torch.bool, device=device) if layout.query_ok is None else layout.query_ok
    # query chunks bound the [B, Hq, chunk, keys] scores (by a fixed budget and by the size of the layer's input, so
    # that they stay below the activations the model's own forward makes); a chunk scores only the keys its last
    # query can see (keys are position-ordered, so those are a prefix of every row)
    budget = min(_SCORE_BUDGET_BYTES, _SCORE_HIDDEN_RATIO * hidden_states.numel() * 4)
    chunk = min(max(1, budget // max(1, b * hq * t * 4)), max(64, -(-n // 8)))
    keys32 = keys.float()
    queries = queries.float() * scale  # scaled before the product: the scores are made once, not scaled into a copy
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        qpos = layout.query_pos[start:stop].view(1, 1, -1, 1)
        end = int(((layout.pos <= qpos.max()) & layout.valid).sum(-1).max())
        lo = _seen_by_all(layout, qpos, query_ok[:, start:stop], window, end)
        kpos = layout.pos[:, :, None, lo:end]  # [B, H, 1, end - lo]: the keys some query of the chunk does not see
        visible = (kpos <= qpos) & layout.valid[:, :, None, lo:end] & query_ok[:, None, start:stop, None]
        if window:
            visible &= kpos > qpos - window
        seen = visible.sum(-1, keepdim=True) + lo if with_hits else None  # [B, H, q, 1] keys each query sees
        qc = queries[:, :, start:stop].reshape(b, h, g, stop - start, d)
        # one score-sized float tensor per chunk: the product, masked (past the keys every query sees), exponentiated
        # in place
        prob = torch.einsum("bhgqd,bhkd->bhgqk", qc, keys32[:, :, :end])
        prob[..., lo:end].masked_fill_(visible.logical_not_().unsqueeze(2), float("-inf"))
        del visible
        top = prob.amax(-1, keepdim=True)
        total = prob.sub_(top.masked_fill_(torch.isneginf(top), 0.0)).exp_().sum(-1)  # [B, H, G, q]; 0: sees nothing
        inverse = total.reciprocal_().masked_fill_(torch.isinf(total), 0.0)
        if with_hits:
            summed = prob.mul_(inverse.unsqueeze(-1)).sum(2)  # [B, H, q, end], probabilities summed over G
            mass[..., :end] += summed.sum(2)
            hit = summed > g / seen.float()
            hits[..., :end] += hit.sum(2)
            last[..., :end] = torch.maximum(last[..., :end], torch.where(hit, qpos, -1).amax(2))
        else:  # the normalisation folded into the sum over the queries
            mass[..., :end] += torch.einsum("bhgqk,bhgq->bhk", prob, inverse)
        del prob  # before the next chunk's scores exist
    if not with_hits:
        return AttentionStatistics(mass=mass, hits=None, last_hit=None)
    return AttentionStatistics(mass=mass, hits=hits, last_hit=last)


def _seen_by_all(
    layout: KeyLayout, qpos: torch.Tensor, query_ok: torch.Tensor, window: int | None, end: int
) -> int:
    """How many leading keys (of every row and head) every query of a chunk sees (positions ``qpos`` ``[1, 1, q,
    1]``, ``query_ok`` ``[B, q]``): those need no mask. 0 when a query of the chunk takes no part."""
    if not bool(query_ok.all()):
        return 0
    pos = layout.pos[..., :end]
    every = layout.valid[..., :end] & (pos <= qpos.min())
    if window:
        every &= pos > qpos.max() - window
    return int(every.flatten(0, 1).all(0).cumprod(0).sum())
