"""The cache of every point for one context: one prefill, recorded (``PrefillRecord``) and replayed per press.

With ``--cache pikv`` the context is prefilled once into an exact ``PiKVCache`` and each point decodes from a
``fork()`` of it (``pikv_decoders``); with ``--cache dynamic`` each point gets a copy of the recorded DynamicCache.
A press compresses its copy by replaying the recorded prefill hooks (``replayable``); a kvpress press whose
compression is not in its prefill hook runs kvpress's own prefill. A compression point (``compression_point``) also
measures its bytes, kept tokens and reconstruction error (see :mod:`pikv_hf.eval.compression`).
"""

from __future__ import annotations

from pikv_hf.eval.config import PIKV_MODES, EvalConfig, build_press
from pikv_hf.eval.generation import prefill
from pikv_hf.eval.pikv_presses import ROUTED_SUFFIX


class PrefillRecord:
    """An uncompressed prefill of one context, recorded so that several presses can compress the same context.

    kvpress applies a press through a forward hook on every attention layer, called after the layer has attended to
    the full context: it compresses that layer's cache entries, and the layer's output (hence every later layer's
    input) is unchanged. So the hook calls of one uncompressed prefill, replayed on a copy of its cache, give exactly
    the cache that ``with press(model): model.model(context)`` gives, at the cost of one prefill for all presses.
    Only presses that use kvpress's default ``forward_hook`` are replayed (:func:`replayable`); others run the real
    flow.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Causal LM whose ``model.model.layers[i].self_attn`` are the attention modules.
    context_ids : torch.Tensor
        ``[1, n]`` context token ids.
    """

    def __init__(self, model, context_ids, cache=None):
        import torch
        from transformers import DynamicCache

        self.model = model
        self.calls: list[tuple] = []
        handles = []

        def hook(module, args, kwargs, output):
            self.calls.append((module, args, dict(kwargs), output))

        for layer in model.model.layers:
            handles.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
        try:
            self.cache = DynamicCache() if cache is None else cache
            with torch.no_grad():
                model.model(input_ids=context_ids, past_key_values=self.cache)
        finally:
            for handle in handles:
                handle.remove()

    def exact_kv(self) -> list[tuple]:
        """The context's uncompressed ``(keys, values)`` per layer, ``[B, H, T, D]``."""
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    def compressed_cache(self, press=None):
        """A fresh copy of the recorded cache (a ``DynamicCache``, or a ``fork()`` of a ``PiKVCache``) holding the
        context's KV, compressed by ``press`` (a plain copy when None)."""
        import torch
        from transformers import DynamicCache

        from pikv_hf import PiKVCache

        if isinstance(self.cache, PiKVCache):
            kv = self.cache.fork()
        else:
            kv = DynamicCache()
            for i, (keys, values) in enumerate(self.exact_kv()):
                kv.update(keys.clone(), values.clone(), i)
        if press is not None:
            # entering the press's context does its set-up (post_init_from_model, layer.self_attn.rotary_emb); its
            # hooks stay idle because no forward runs inside
            with torch.no_grad(), press(self.model):
                for module, args, kwargs, output in self.calls:
                    press.forward_hook(module, args, {**kwargs, "past_key_values": kv}, output)
        return kv


def replayable(press) -> bool:
    """Whether ``press`` compresses through kvpress's default prefill hook (so :class:`PrefillRecord` applies)."""
    from kvpress import BasePress, DecodingPress, PrefillDecodingPress, ScorerPress

    if getattr(press, "replays_prefill", False):  # PiKV presses whose hooks read only their arguments
        return True
    return (
        press is not None
        and type(press).forward_hook in (BasePress.forward_hook, ScorerPress.forward_hook)  # kvpress_compat's
        and not isinstance(press, (DecodingPress, PrefillDecodingPress))
    )


class PointCaches:
    """The cache of every point for one context: one recorded prefill (a DynamicCache, or with ``--cache pikv`` an
    exact PiKVCache) serves all of them.

    ``make(press, ratio)`` returns ``(cache, press, info)``: the point's cache, the press to keep active while
    decoding (compressors; None otherwise) and the row fields measured on the cache (compression points; their
    reconstruction error only with ``errors``). kvpress presses whose hooks cannot be replayed run their own prefill.
    """

    def __init__(self, model, config: EvalConfig, context_ids, heads: str | None = None, errors: bool = True):
        self.model, self.config, self.context_ids, self.errors = model, config, context_ids, errors
        self.heads = heads  # DuoAttention's calibrated heads (pikv_duo_attention points)
        self._recorded: PrefillRecord | None = None
        self._decoders = None

    def make(self, press_name: str, ratio: float):
        from pikv_hf.eval import compression

        model, ctx = self.model, self.context_ids
        for layer in model.model.layers:  # key masks a head-wise press left for another point's cache
            layer.self_attn.masked_key_indices = None
        if self.config.cache == "pikv":
            self._decoders = self._decoders or pikv_decoders(model, self.config, ctx, self.heads, self.errors)
            return self._decoders(press_name, ratio)
        if compression.is_compression(press_name):
            self._recorded = self._recorded or PrefillRecord(model, ctx)
            return compression_point(model, self._recorded, press_name, self.errors)
        press = build_press(press_name, ratio, self.heads)
        if press is None or replayable(press):
            self._recorded = self._recorded or PrefillRecord(model, ctx)
            return self._recorded.compressed_cache(press), None, {}
        return prefill(model, ctx, press), None, {}


def pikv_decoders(model, config: EvalConfig, context_ids, heads: str | None = None, errors: bool = True):
    """Prefill the context once into an exact ``PiKVCache``; return ``make(press, ratio) -> (cache, press, info)``.

    Each call forks the prefilled cache (:class:`PrefillRecord` with the PiKVCache). A press (kvpress's or pikv_hf's)
    compresses the fork by replaying the recorded prefill hooks; ``none``, ``pikv_routed`` and ``pikv_quest`` set the
    decode attention (``EvalConfig.point_read``); an ``*_offload_routed`` press reads routed over both tiers; a
    compression point is :func:`compression_point` of the recording (its press stays active while decoding).
    """
    from pikv_hf import PiKVCache
    from pikv_hf.eval import compression
    from pikv_hf.eval.pikv_presses import routed_read

    def fresh() -> PiKVCache:
        return PiKVCache(model, router=config.router, num_shards=config.num_shards, page_size=config.page_size)

    record = PrefillRecord(model, context_ids, fresh())

    def make(press_name: str, ratio: float):
        if compression.is_compression(press_name):
            return compression_point(model, record, press_name, errors)
        if press_name == "none" or press_name in PIKV_MODES:
            cache = record.compressed_cache()
            cache.set_attention(config.point_read(press_name, ratio, cache.num_shards))
            return cache, None, {}
        press = build_press(press_name, ratio, heads)
        if not replayable(press):  # a press with its own prefill (several passes): run it on a cache of its own
            return prefill(model, context_ids, press, fresh()), None, {}
        cache = record.compressed_cache(press)
        if press_name.endswith(ROUTED_SUFFIX):
            cache.set_attention(routed_read(config.read, cache.num_shards))
        return cache, None, {}

    return make


def compression_point(model, record: PrefillRecord, spec: str, errors: bool = True):
    """``(cache, press, info)`` of a compression point: the recorded context's cache compressed by the spec's press
    (or a QuantizedCache of its exact KV), and the row fields measured on it (see :mod:`pikv_hf.eval.compression`;
    the reconstruction error, which costs a round trip of every layer, only with ``errors``)."""
    from pikv_hf import PiKVCache
    from pikv_hf.eval import compression

    press = compression.build(spec)
    if press is None:
        kv = compression.quantized_cache(spec, model, record.exact_kv())
    else:
        kv = record.compressed_cache(press)
    info = {
        "kv_bytes": compression.kv_bytes(kv),
        "simulated": not isinstance(kv, PiKVCache) and press is not None,
        "query_agnostic": True,
        "kept_per_kv_head": [round(x, 2) for x in compression.kept_per_kv_head(kv)],
        "reconstruction_error": compression.reconstruction_error(press, record.exact_kv()) if errors else None,
    }
    return kv, press, info
