"""What the compressor presses share: a residual window of recent full-precision tokens, the older tokens held by a
codec that stores them compressed, and the reports (reconstruction error, bytes per token).

A compressor press is a kvpress ``PrefillDecodingPress`` (so kvpress's pipeline keeps its hook on during decoding)
whose hook runs after every attention layer, at prefill and at decode steps:

* on a ``PiKVCache`` it moves the layer's tokens older than the last ``window`` positions (and past the first
  ``n_sink``, by default none) from the hot store into the
  layer's ``"compressed"`` tier, a ``PagedStore`` whose codec stores them compressed (pages of
  :attr:`CompressorPress.page_size` tokens): at prefill end all of them, during decoding whenever at least a page of
  them has gathered. ``cache.kv_nbytes()`` falls by what the codec saves; attention reads both stores and merges
  them exactly (the tier's pages decoded on read);
* on any other cache (``DynamicCache``) it simulates that, as kvpress presses do: the keys and values of the same
  tokens, in consecutive pages of ``page_size``, are replaced by their reconstruction ``D(E(x))``, so results can be
  compared with kvpress's presses. Tokens past the last whole page stay exact there (as KIVI's residual).

The prefill's own attention reads full-precision keys (the hook runs after it), as in KIVI. Compression stacks
after eviction: ``kvpress.ComposedPress([StreamingLLMPress(0.5), QuantPress(bits=4)])`` evicts, then compresses
what is kept (a selection of a layer that already holds a compressed tier is refused: evict first). A layer's tier
holds its tokens through one codec: on a ``PiKVCache`` a second compressor of another kind or settings (two composed,
or another one after the first) is refused before it moves a token (``CompressorPress.origin``); on a
``DynamicCache`` the simulation applies both.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from kvpress.presses.base_press import BasePress
from kvpress.presses.decoding_press import DecodingPress
from kvpress.presses.prefill_decoding_press import PrefillDecodingPress
from torch import nn

from pikv_hf.cache import PiKVCache
from pikv_hf.checks import check_int_at_least
from pikv_hf.codecs.base import Codec, PageBatch
from pikv_hf.layer import PiKVLayer
from pikv_hf.presses.base import PiKVPress, prefilling, refuse_compiled_decode
from pikv_hf.view import dense_view

TIER = "compressed"


def kv_head_dims(model: nn.Module) -> tuple[int, int]:
    """``(Dk, Dv)``: the channels of the keys and of the values ``model`` stores per KV head. Multi-head latent
    attention (DeepSeek-V2/V3) stores ``qk_nope_head_dim + qk_rope_head_dim`` key and ``v_head_dim`` value channels
    (its ``head_dim`` is the rotary part only); other models ``head_dim`` for both."""
    cfg = model.config.get_text_config()
    if getattr(cfg, "qk_rope_head_dim", None) and getattr(cfg, "v_head_dim", None):
        return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return d, d


def roundtrip(codec: Codec, keys: torch.Tensor, values: torch.Tensor, page_size: int) -> tuple[torch.Tensor, ...]:
    """``D(E(x))`` of ``[B, H, T, Dk]`` keys and ``[B, H, T, Dv]`` values through ``codec``, in pages of ``page_size``
    consecutive tokens of each (row, head) (the last one partly filled), fields cast to their stored dtypes."""
    b, h, t, dk = keys.shape
    dv = values.shape[-1]
    w = -(-t // page_size)
    pad = w * page_size - t
    pages = b * h * w

    def paged(x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (0, 0, 0, pad)).reshape(pages, page_size, x.shape[-1])

    valid = (torch.arange(w * page_size, device=keys.device) < t).expand(pages // w, -1).reshape(pages, page_size)
    heads = torch.arange(h, device=keys.device).repeat_interleave(w).repeat(b)
    specs = codec.fields(dk, dv, keys.dtype)
    old = {
        name: torch.full(
            (pages, *s.shape) if s.per_page else (pages, page_size, *s.shape), s.fill, dtype=s.dtype, device=keys.device
        )
        for name, s in specs.items()
    }
    if codec.page_level:
        fields = codec.encode_pages(PageBatch(paged(keys), paged(values), valid, valid, heads, old))
    else:
        fields = codec.encode(paged(keys).reshape(-1, dk), paged(values).reshape(-1, dv))
        fields = {name: x.view(pages, page_size, *x.shape[1:]) for name, x in fields.items()}
    k, v = codec.decode({name: x.to(specs[name].dtype) for name, x in fields.items()})
    return k.reshape(b, h, w * page_size, dk)[:, :, :t], v.reshape(b, h, w * page_size, dv)[:, :, :t]


def relative_error(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """``||x - x^|| / ||x||`` (Frobenius, float64)."""
    x = x.double()
    return float((x - x_hat.double()).norm() / x.norm().clamp(min=torch.finfo(torch.float64).tiny))


def cache_report(cache: PiKVCache) -> dict:
    """Bytes and tokens of every layer of a ``PiKVCache``, measured on the tensors it holds.

    Returns
    -------
    dict
        ``layers``: per layer ``tokens`` (per (row, KV head), mean), ``compressed_tokens`` (in the compressed tier),
        ``kv_bytes`` (``layer.kv_nbytes()``: every store on the device), ``empty_bytes`` (its share in slots that
        hold no token, ``layer.empty_nbytes()``: partly filled pages, headroom), ``compressed_bytes`` (the tier's) and
        ``bytes_per_token`` (``kv_bytes`` per sequence position seen and batch row, all KV heads: the figure a
        ``DynamicCache`` holds as ``2 * H * D * itemsize``, so eviction lowers it too); ``kv_bytes`` and
        ``bytes_per_token`` over all layers.
    """
    layers = []
    for layer in cache.layers:
        st = layer.store
        if st is None:
            continue
        rows_heads = st.batch * st.heads
        tier = layer.tiers.get(TIER)
        tokens = int(layer.tokens_per_shard().sum()) / rows_heads
        kv = layer.kv_nbytes()
        layers.append(
            {
                "tokens": tokens,
                "compressed_tokens": 0 if tier is None else int(tier.tokens_per_shard().sum()) / rows_heads,
                "kv_bytes": kv,
                "empty_bytes": layer.empty_nbytes(),
                "compressed_bytes": 0 if tier is None else tier.kv_nbytes(),
                "bytes_per_token": kv / max(layer.get_seq_length(), 1) / st.batch,
            }
        )
    total = sum(la["kv_bytes"] for la in layers)
    return {"layers": layers, "kv_bytes": total, "bytes_per_token": sum(la["bytes_per_token"] for la in layers)}


@dataclass
class CompressorPress(PiKVPress, PrefillDecodingPress):
    """Base of the compressor presses (module docstring): subclasses set :attr:`page_size` and build each layer's
    codec (:meth:`build_codec`).

    Parameters
    ----------
    window : int
        Most recent positions kept in full precision (KIVI's residual), >= 0.
    n_sink : int
        First positions kept in full precision too (attention sinks, whose large keys would otherwise set the key
        range of their page), >= 0; default 0 (KIVI).
    """

    prefilling_press: BasePress | None = field(default=None, init=False, repr=False)
    decoding_press: DecodingPress | None = field(default=None, init=False, repr=False)
    window: int = 128
    n_sink: int = 0
    # tokens are held compressed, not removed: what kvpress's ComposedPress multiplies into its ratio
    compression_ratio: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()
        self._codecs: dict[int, Codec] = {}  # DynamicCache simulation: per layer, since its prefill
        self._simulated: dict[int, int] = {}  # DynamicCache simulation: tokens reconstructed per layer

    # ------------------------------------------------------------------ what a compressor defines
    @property
    def page_size(self) -> int:
        """Tokens per compressed page: KIVI's token group of keys, the block of block PCA; 16 for per-token codecs,
        whose pages only group a KV head's tokens (the projection codecs' 2-byte head id per page)."""
        return 16

    def check(self) -> None:
        """Validate the press's own fields (``ValueError`` naming the parameter)."""

    def validate(self) -> None:
        super().validate()
        check_int_at_least("window", self.window, 0)
        check_int_at_least("n_sink", self.n_sink, 0)
        self.check()

    def setup(self, model: nn.Module) -> None:
        """Checks against the model and loading of fitted artefacts (``post_init_from_model``)."""

    def build_codec(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> Codec:
        """The codec of layer ``layer_idx``; ``keys`` / ``values`` (``[B, H, n, D]``, zeros where not compressed) are
        the first tokens it will hold."""
        raise NotImplementedError

    # ------------------------------------------------------------------ kvpress protocol
    def post_init_from_model(self, model: nn.Module) -> None:
        self.setup(model)  # the simulation's state is kept: kvpress's pipeline enters the press again to decode

    def forward_hook(self, module: nn.Module, input: list[torch.Tensor], kwargs: dict, output: list):
        cache = kwargs["past_key_values"]
        if not isinstance(cache, PiKVCache):  # kvpress's PrefillDecodingPress hook would look for inner presses
            self.simulate(cache.layers[module.layer_idx], module.layer_idx, prefilling(kwargs))
            return output
        return super().forward_hook(module, input, kwargs, output)

    def press_layer(self, module: nn.Module, layer: PiKVLayer, kwargs: dict, output: list) -> None:
        prefill = prefilling(kwargs)
        if not prefill:
            refuse_compiled_decode(self, "moves tokens into its compressed tier")
        self.compress_layer(layer, prefill)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        """kvpress's ``compress``: the keys and values with every whole page between the sinks and the window
        reconstructed."""
        s = min(self.n_sink, keys.shape[2])
        n = self._span(keys.shape[2], s)
        if n == 0:
            return keys, values
        k, v = keys[:, :, s : s + n], values[:, :, s : s + n]
        k_hat, v_hat = roundtrip(self.build_codec(module.layer_idx, k, v), k, v, self.page_size)
        cat = lambda x, x_hat: torch.cat([x[:, :, :s], x_hat, x[:, :, s + n :]], 2)  # noqa: E731
        return cat(keys, k_hat), cat(values, v_hat)

    # ------------------------------------------------------------------ the two caches
    def _span(self, length: int, done: int) -> int:
        """Whole pages of tokens in ``[done, length - window)``."""
        return max(0, (length - self.window - done) // self.page_size * self.page_size)

    def simulate(self, layer, layer_idx: int, prefilling: bool) -> None:
        """DynamicCache: reconstruct, in place, the whole pages of tokens that left the window since the last call."""
        if prefilling:
            self._simulated[layer_idx] = self.n_sink
            self._codecs.pop(layer_idx, None)
        done = self._simulated.get(layer_idx, self.n_sink)
        keys, values = layer.keys, layer.values
        n = self._span(keys.shape[2], done)
        if n == 0:
            return
        span = slice(done, done + n)
        if layer_idx not in self._codecs:  # built from the first tokens compressed, kept for the decode steps
            self._codecs[layer_idx] = self.build_codec(layer_idx, keys[:, :, span], values[:, :, span])
        codec = self._codecs[layer_idx]
        k_hat, v_hat = roundtrip(codec, keys[:, :, span], values[:, :, span], self.page_size)
        keys[:, :, span] = k_hat.to(keys.dtype)
        values[:, :, span] = v_hat.to(values.dtype)
        self._simulated[layer_idx] = done + n

    def origin(self) -> str:
        """What the codecs this press builds are, for :attr:`Codec.origin`: the press and its fields but the window and
        sinks (presses equal in these share a layer's compressed tier, e.g. one at prefill and another at decode)."""
        kept = (f for f in fields(self) if f.repr and f.name not in ("window", "n_sink"))
        return f"{type(self).__name__}(" + ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in kept) + ")"

    def compress_layer(self, layer: PiKVLayer, prefilling: bool) -> None:
        """PiKVCache: move the hot store's tokens older than the window into the compressed tier (at prefill, or once
        a page of them has gathered in a row: each row of a batch moves when it would alone). A layer has one
        compressed tier, its tokens all through one codec: a press of another :meth:`origin` (two compressors
        composed) is refused before it moves anything."""
        if layer.store is None:
            return
        if not layer.has_view:
            raise RuntimeError(
                f"{type(self).__name__}: layer {layer.layer_idx} keeps its shards in partitions (distributed); "
                "compressed tiers are not supported there"
            )
        tier = layer.tiers.get(TIER)
        if tier is not None and tier.codec.origin != self.origin():
            raise ValueError(
                f"{self.origin()}: layer {layer.layer_idx} of this PiKVCache already holds tokens compressed by "
                f"{tier.codec.origin or type(tier.codec).__name__}, and a layer's compressed tier has one codec: "
                "compose at most one compressor press per cache (an eviction press before it is fine)"
            )
        view = layer.view_index()
        old = view.valid & (view.pos < layer.seen - self.window) & (view.rel_pos >= self.n_sink)
        if not prefilling:  # rows with less than a page pending keep their old tokens for a later step
            old &= (old.sum(-1).amax(-1) >= self.page_size).view(-1, 1, 1)
        if not old.any():
            return
        codec = None
        if TIER not in layer.tiers:  # built from the first tokens it will hold (zeros elsewhere)
            # the hot store alone, in view_index's order: an offload tier may hold tokens too (evict, then compress)
            hot = dense_view([layer.store], layer.row_start)
            mask = ~old.unsqueeze(-1)
            codec = self.build_codec(layer.layer_idx, hot.keys.masked_fill(mask, 0), hot.values.masked_fill(mask, 0))
            codec.origin = self.origin()
        layer.move_to_tier(TIER, view, ~old, codec=codec, page_size=self.page_size)

    # ------------------------------------------------------------------ reports
    def reconstruction_error(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int = 0) -> dict[str, float]:
        """``||K - D(E(K))|| / ||K||`` and the same for values, of ``[B, H, T, D]`` tensors through layer
        ``layer_idx``'s codec, in pages of ``page_size`` consecutive tokens."""
        k_hat, v_hat = roundtrip(self.build_codec(layer_idx, keys, values), keys, values, self.page_size)
        return {"keys": relative_error(keys, k_hat), "values": relative_error(values, v_hat)}

    def report(self, cache: PiKVCache) -> dict:
        """:func:`cache_report` of a ``PiKVCache`` this press compressed."""
        return cache_report(cache)
