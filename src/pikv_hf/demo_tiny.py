"""``pikv-hf demo --tiny``: DynamicCache vs PiKVCache on an embedded tiny MoE model built from a config."""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache

from pikv_hf.cache import PiKVCache
from pikv_hf.tiny import TINY_ARCHS, tiny_model

# A small but not trivial model: 4 layers, 8 experts (top-2) for MoE archs, 8 query / 2 KV heads of dim 32.
DEMO_OVERRIDES = dict(
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=1024,
)


def greedy_decode(model, ids: torch.Tensor, cache, new_tokens: int) -> tuple[torch.Tensor, list, float, float]:
    """Prefill ``ids`` then decode greedily; returns (tokens, per-step logits, prefill s, mean decode s/token)."""
    steps = []
    with torch.no_grad():
        t0 = time.perf_counter()
        logits = model(ids, past_key_values=cache).logits[:, -1]
        prefill = time.perf_counter() - t0
        tokens = [logits.argmax(-1, keepdim=True)]
        all_logits = [logits]
        for _ in range(new_tokens - 1):
            t0 = time.perf_counter()
            logits = model(tokens[-1], past_key_values=cache).logits[:, -1]
            steps.append(time.perf_counter() - t0)
            tokens.append(logits.argmax(-1, keepdim=True))
            all_logits.append(logits)
    return torch.cat(tokens, 1), all_logits, prefill, sum(steps) / max(1, len(steps))


def run_tiny_demo(args: argparse.Namespace) -> int:
    overrides = dict(DEMO_OVERRIDES)
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if key in TINY_ARCHS[args.arch]:
            overrides[key] = 8
    ref = tiny_model(args.arch, seed=args.seed, **overrides)
    model = tiny_model(args.arch, seed=args.seed, **overrides)
    cfg = model.config
    print(
        f"model: tiny {args.arch} from config (seed {args.seed}), {cfg.num_hidden_layers} layers, "
        f"{cfg.num_attention_heads} query / {cfg.num_key_value_heads} KV heads, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, fp32, CPU, "
        f"{torch.get_num_threads()} thread(s)"
    )
    ids = torch.randint(3, cfg.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(args.seed))

    warm = ids[:, :8]  # first forwards pay one-time initialisation; keep it out of both timings
    greedy_decode(ref, warm, DynamicCache(), 2)
    greedy_decode(model, warm, PiKVCache(model, router=args.router), 2)

    dyn = DynamicCache()
    tok_ref, logits_ref, pre_ref, dec_ref = greedy_decode(ref, ids, dyn, args.new_tokens)
    cache = PiKVCache(model, router=args.router)
    tok, logits, pre, dec = greedy_decode(model, ids, cache, args.new_tokens)

    same = torch.equal(tok_ref, tok)
    diff = max((a - b).abs().max().item() for a, b in zip(logits_ref, logits, strict=True))
    gen_ref = ref.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    gen = model.generate(
        ids,
        past_key_values=PiKVCache(model, router=args.router),
        max_new_tokens=args.new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    same_generate = torch.equal(gen_ref, gen)
    dyn_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in dyn.layers)

    print(
        f"prompt {args.prompt_len} tokens, {args.new_tokens} greedy new tokens, router={args.router}, "
        f"{cache.num_shards} shards, page size {cache.page_size}"
    )
    print(f"identical output (forward loop): {same}; identical output (model.generate): {same_generate}")
    print(f"max |logit difference| over prefill + {args.new_tokens - 1} decode steps: {diff:.2e}")
    print(
        f"KV bytes: DynamicCache {dyn_bytes:,}  PiKVCache {cache.kv_nbytes():,} "
        f"({cache.kv_nbytes() / dyn_bytes:.2f}x: partly filled pages of {cache.num_shards} shards, allocated bytes) "
        f"+ {cache.meta_nbytes():,} for positions/valid bits/statistics/page tables"
    )
    print("tokens per shard per layer (summed over KV heads):")
    for i, row in enumerate(cache.tokens_per_shard().tolist()):
        placement = cache.layers[i].placement
        how = "round-robin fallback" if getattr(placement, "source", 0) is None else args.router
        print(f"  layer {i}: {row}  ({how})")
    print(f"prefill: DynamicCache {pre_ref * 1e3:.1f} ms, PiKVCache {pre * 1e3:.1f} ms")
    print(
        f"decode per token: DynamicCache {dec_ref * 1e3:.2f} ms, PiKVCache {dec * 1e3:.2f} ms "
        f"(tiny model: per-step overhead dominates; see benchmarks/bench_cache.py for realistic sizes)"
    )
    return 0 if same and same_generate and diff < 1e-4 else 1
