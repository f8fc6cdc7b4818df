"""Expert placement: a token's KV goes to the shard of the expert the model's own MoE router chose for it.

A layer's attention (and so its cache ``update``) runs before that layer's MoE router, so layer ``L`` uses the
top-1 expert chosen for the same token at the closest MoE layer before ``L`` in the same forward pass, captured
by forward hooks (``ExpertTap``). Layer 0, and layers with no MoE layer before them (e.g. DeepSeek's first dense
layers), fall back to round-robin pages.
"""

from __future__ import annotations

import torch
from torch import nn

from pikv_hf.routing.base import Placement, PlacementContext
from pikv_hf.routing.hash import RoundRobinPlacement

_NUM_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def num_experts_of(config) -> int | None:
    """Number of routed experts declared by a (text) config, or None for a dense model."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in _NUM_EXPERT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a causal LM (``model.model.layers`` for every supported family)."""
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (expected `.model.layers`)")
    return layers


class ExpertTap:
    """Forward hooks that record, per MoE layer, the top-1 expert of every token of the current forward.

    transformers 5.x calls each layer's fused experts module as ``experts(hidden [T, D], top_k_index [T, k],
    top_k_weights [T, k])`` (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, GPT-OSS, PhiMoE); the top-1 expert is the
    selected index with the largest router logit, read from the layer's router module (``gate`` / ``router``, whose
    output or first output is the logits ``[T, E]``) when it runs as a module, else the index with the largest weight
    (DeepSeek-V2 applies its gate's weight directly; its weights grow with the logits). The weights alone can
    mislead: PhiMoE's sparsemixer can weigh its second choice 1.0 and its first (the logits' argmax) 0.5.
    GraniteMoE has no experts module; its ``router`` returns the logits ``[T, E]`` as last output, and the top-1
    expert is their argmax. A pre-hook on layer 0 clears the previous forward's record.
    """

    def __init__(self, model: nn.Module) -> None:
        layers = decoder_layers(model)
        self.top1: dict[int, torch.Tensor] = {}
        self._logits: dict[int, torch.Tensor] = {}  # router logits of the current forward, per MoE layer
        self._handles = [layers[0].register_forward_pre_hook(lambda *_: self._clear())]
        self.moe_layers: list[int] = []
        for idx, layer in enumerate(layers):
            if self._hook_layer(idx, layer):
                self.moe_layers.append(idx)

    def _clear(self) -> None:
        self.top1.clear()
        self._logits.clear()

    def _hook_layer(self, idx: int, layer: nn.Module) -> bool:
        modules = dict(layer.named_modules())
        for name, module in modules.items():
            if name.split(".")[-1] == "experts" and not isinstance(module, nn.ModuleList):
                self._handles.append(module.register_forward_pre_hook(self._experts_hook(idx), with_kwargs=True))
                for gate_name, gate in modules.items():
                    if gate_name.split(".")[-1] in ("gate", "router"):
                        self._handles.append(gate.register_forward_hook(self._logits_hook(idx)))
                return True
        for name, module in modules.items():
            if name.split(".")[-1] == "router":
                self._handles.append(module.register_forward_hook(self._router_hook(idx)))
                return True
        return False

    def _experts_hook(self, idx: int):
        def hook(module, args, kwargs):
            values = list(args[1:3]) + [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
            index, weights = values[0], values[1]
            logits = self._logits.pop(idx, None)
            if logits is not None and logits.dim() >= 2 and logits.numel() // logits.shape[-1] == index.shape[0]:
                weights = logits.reshape(index.shape[0], -1).gather(-1, index)  # the selected experts' logits
            self.top1[idx] = index.gather(-1, weights.argmax(-1, keepdim=True)).squeeze(-1)

        return hook

    def _logits_hook(self, idx: int):
        def hook(module, args, output):
            logits = output[0] if isinstance(output, tuple) else output
            if isinstance(logits, torch.Tensor) and logits.is_floating_point():
                self._logits[idx] = logits

        return hook

    def _router_hook(self, idx: int):
        def hook(module, args, output):
            logits = output[-1] if isinstance(output, tuple) else output
            self.top1[idx] = logits.argmax(-1)

        return hook

    def source_layer(self, layer_idx: int) -> int | None:
        """The closest MoE layer strictly before ``layer_idx``, or None."""
        earlier = [i for i in self.moe_layers if i < layer_idx]
        return earlier[-1] if earlier else None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class ExpertPlacement(Placement):
    """Shard = top-1 expert (mod ``S``) chosen for the token at the previous MoE layer; see the module docstring.

    ``fallback_tokens`` counts tokens placed by the round-robin fallback (layer 0, no earlier MoE layer, or no
    capture for this forward, e.g. when ``update`` is called outside a model forward).
    """

    name = "expert"

    def __init__(self, num_shards: int, tap: ExpertTap, layer_idx: int) -> None:
        super().__init__(num_shards)
        self.tap = tap
        self.source = tap.source_layer(layer_idx)
        self._fallback = RoundRobinPlacement(num_shards)
        self.fallback_tokens = 0

    def place(self, ctx: PlacementContext) -> torch.Tensor:
        b, h, q, _ = ctx.keys.shape
        top1 = self.tap.top1.get(self.source) if self.source is not None else None
        if top1 is None or top1.numel() != b * q:
            self.fallback_tokens += b * q
            return self._fallback.place(ctx)
        shard = (top1.to(ctx.keys.device).view(b, 1, q) % self.num_shards).long()
        return shard.expand(b, h, q)
