"""Sparse upcycling: a dense Llama-family model becomes a ``MixtralForCausalLM`` with the same function.

Every expert is a copy of the layer's dense FFN and Mixtral renormalises the top-k routing weights to sum to one, so
the MoE computes exactly the dense model (Komatsuzaki et al., 2023, "Sparse Upcycling"). The router is not random:
each layer's router rows are the centroids of a spherical k-means over that layer's MLP-input hidden states (the
output of ``post_attention_layernorm``, which is what Mixtral's router reads) on real text. Centroids have unit norm,
so ``argmax_e <x, c_e> = argmax_e cos(x, c_e)``: a token goes to the expert of its nearest centroid, and expert
choice groups similar tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import MixtralForCausalLM, PreTrainedModel

SUPPORTED_MODEL_TYPES = ("llama", "mistral")


def spherical_kmeans(x: torch.Tensor, k: int, iters: int = 50, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Spherical k-means (cosine similarity) with k-means++ seeding and Lloyd iterations.

    Parameters
    ----------
    x : torch.Tensor
        Points ``[N, D]`` (any norm; they are normalised).
    k : int
        Number of clusters, ``1 <= k <= N``.
    iters : int
        Maximum number of Lloyd iterations (stops earlier when the assignment is stable).
    seed : int
        Seed of the k-means++ draws.

    Returns
    -------
    tuple of torch.Tensor
        ``(centroids [k, D], assignment [N])``: unit-norm centroids, each the normalised mean of its points, and
        each point's cluster ``argmax_j <x_i/|x_i|, c_j>``.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [N, D], got shape {tuple(x.shape)}")
    if not 1 <= k <= x.shape[0]:
        raise ValueError(f"k must be in [1, N={x.shape[0]}], got {k}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    xs = torch.nn.functional.normalize(x.double(), dim=-1)
    gen = torch.Generator().manual_seed(seed)
    first = int(torch.randint(xs.shape[0], (1,), generator=gen))
    centroids = [xs[first]]
    dist = 1.0 - xs @ xs[first]
    for _ in range(1, k):
        weights = dist.clamp_min(0)
        if float(weights.sum()) <= 0:
            weights = torch.ones_like(weights)
        nxt = int(torch.multinomial(weights, 1, generator=gen))
        centroids.append(xs[nxt])
        dist = torch.minimum(dist, 1.0 - xs @ xs[nxt])
    cent = torch.stack(centroids)
    assign = (xs @ cent.T).argmax(dim=-1)
    for _ in range(iters):
        sums = torch.zeros_like(cent).index_add_(0, assign, xs)
        counts = torch.bincount(assign, minlength=k)
        for j in torch.nonzero(counts == 0).flatten().tolist():
            # an empty cluster takes the point farthest from its own centroid
            far = int((xs * cent[assign]).sum(-1).argmin())
            sums[j] = xs[far]
            assign[far] = j
        cent = torch.nn.functional.normalize(sums, dim=-1)
        new_assign = (xs @ cent.T).argmax(dim=-1)
        if torch.equal(new_assign, assign):
            break
        assign = new_assign
    return cent.to(x.dtype), assign


@torch.no_grad()
def collect_mlp_inputs(model: PreTrainedModel, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Run the model on ``input_ids`` and return each layer's MLP input (the router's input in Mixtral).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A decoder whose layers are ``model.model.layers[i]`` with an ``mlp`` submodule.
    input_ids : torch.Tensor
        Token ids ``[B, S]``.

    Returns
    -------
    list of torch.Tensor
        One ``[B * S, hidden]`` tensor per layer.
    """
    captured: list[torch.Tensor | None] = [None] * len(model.model.layers)
    handles = []
    for i, layer in enumerate(model.model.layers):

        def hook(module, args, i=i):
            captured[i] = args[0].reshape(-1, args[0].shape[-1]).detach().clone()

        handles.append(layer.mlp.register_forward_pre_hook(hook))
    try:
        model(input_ids=input_ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return captured  # type: ignore[return-value]


def _check_dense(model: PreTrainedModel) -> None:
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model must be one of {SUPPORTED_MODEL_TYPES} (dense, Llama-family), got {config.model_type!r}"
        )
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ValueError("model with attention_bias/mlp_bias cannot be upcycled to Mixtral (no biases there)")


def upcycle_to_moe(
    model: PreTrainedModel,
    num_experts: int,
    top_k: int,
    calibration_ids: torch.Tensor,
    kmeans_iters: int = 50,
    seed: int = 0,
) -> MixtralForCausalLM:
    """Turn a dense Llama-family model into a ``MixtralForCausalLM`` computing the same function.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Dense ``LlamaForCausalLM`` (or Mistral) without attention or MLP biases.
    num_experts : int
        Experts per layer, >= 2.
    top_k : int
        Experts per token, ``1 <= top_k <= num_experts``.
    calibration_ids : torch.Tensor
        Token ids ``[B, S]`` of real text; ``B * S >= num_experts``. Each layer's router rows become the spherical
        k-means centroids of that layer's MLP inputs on these tokens.
    kmeans_iters : int
        Maximum Lloyd iterations per layer.
    seed : int
        Seed of the k-means++ initialisation.

    Returns
    -------
    transformers.MixtralForCausalLM
        The upcycled model (eval mode, same dtype); ``config.pikv_upcycled_from`` records the source model type.
    """
    from transformers import MixtralConfig, MixtralForCausalLM

    _check_dense(model)
    if num_experts < 2:
        raise ValueError(f"num_experts must be >= 2, got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    if calibration_ids.dim() != 2 or calibration_ids.numel() < num_experts:
        raise ValueError(
            f"calibration_ids must be [B, S] with B*S >= num_experts={num_experts}, got {tuple(calibration_ids.shape)}"
        )
    c = model.config
    moe_config = MixtralConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=dict(c.rope_parameters),
        tie_word_embeddings=c.tie_word_embeddings,
        sliding_window=None,
        attention_dropout=0.0,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id,
    )
    moe_config.pikv_upcycled_from = c.model_type
    dtype = next(model.parameters()).dtype
    hidden = collect_mlp_inputs(model, calibration_ids.to(next(model.parameters()).device))

    moe = MixtralForCausalLM(moe_config).to(dtype)
    dense_state = model.state_dict()
    new_state = {}
    for key in moe.state_dict():
        if ".mlp." not in key:
            new_state[key] = dense_state[key]
    for i in range(c.num_hidden_layers):
        prefix = f"model.layers.{i}.mlp."
        gate_up = torch.cat([dense_state[prefix + "gate_proj.weight"], dense_state[prefix + "up_proj.weight"]], dim=0)
        new_state[prefix + "experts.gate_up_proj"] = gate_up.unsqueeze(0).repeat(num_experts, 1, 1)
        new_state[prefix + "experts.down_proj"] = (
            dense_state[prefix + "down_proj.weight"].unsqueeze(0).repeat(num_experts, 1, 1)
        )
        centroids, _ = spherical_kmeans(hidden[i].float(), num_experts, iters=kmeans_iters, seed=seed + i)
        new_state[prefix + "gate.weight"] = centroids.to(dtype)
    missing, unexpected = moe.load_state_dict(new_state, strict=False)
    missing = [m for m in missing if not (c.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"upcycling left missing={missing} unexpected={unexpected} parameters")
    if c.tie_word_embeddings:
        moe.tie_weights()
    moe.generation_config = model.generation_config
    moe.to(next(model.parameters()).device)
    moe.eval()
    return moe
