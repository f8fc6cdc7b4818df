"""Shared helpers of the test-suite: reference runs with DynamicCache and comparisons."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from pikv_hf import PiKVCache
from pikv_hf.tiny import TINY_ARCHS, tiny_model

ROUTERS = ("round_robin", "expert", "key_cluster")
ARCH_ROUTER_CASES = [(a, r) for a in TINY_ARCHS for r in ROUTERS if not (r == "expert" and a == "llama")]
TOL = 1e-4
TESTS = Path(__file__).resolve().parent
# where kernel tests launch the Triton kernels: the GPU when there is one, else the CPU (``TRITON_INTERPRET=1``)
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

_MODELS: dict[tuple[str, str], torch.nn.Module] = {}


def model_pair(arch: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(reference model on SDPA/eager, identical-weight model that PiKVCache switches to pikv), built once."""
    for role in ("ref", "pikv"):
        if (arch, role) not in _MODELS:
            _MODELS[arch, role] = tiny_model(arch, seed=0)
    return _MODELS[arch, "ref"], _MODELS[arch, "pikv"]


def prompt(length: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (batch, length), generator=g)


def generate(model, ids, cache, **kwargs):
    kwargs.setdefault("max_new_tokens", 8)
    kwargs.setdefault("do_sample", False)
    kwargs.setdefault("min_new_tokens", kwargs["max_new_tokens"])  # no early EOS: rows keep equal lengths
    return model.generate(
        ids, past_key_values=cache, output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kwargs
    )


def greedy_logits(model, ids, mask, cache, steps: int, before_step=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill logits ``[B, T, V]`` and those of ``steps`` greedy decode steps ``[steps, B, V]`` (a plain forward
    loop; ``before_step(i)`` runs before decode step ``i``)."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        prefill, decoded = out.logits, []
        for i in range(steps):
            if before_step is not None:
                before_step(i)
            nxt = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            out = model(input_ids=nxt, attention_mask=mask, past_key_values=cache, use_cache=True)
            decoded.append(out.logits[:, -1])
    return prefill, torch.stack(decoded)


def free_port() -> int:
    """A free TCP port on the loopback interface (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def max_logit_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def pikv(model, router: str = "round_robin", **kwargs) -> PiKVCache:
    kwargs.setdefault("page_size", 8)
    return PiKVCache(model, router=router, **kwargs)


def byte_tokenizer():
    """A byte-level tokenizer over the tiny models' 256-token vocabulary (offline; for kvpress's pipeline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<", eos_token=">")


def slot_shard(store) -> torch.Tensor:
    """``[B, H, W * P]`` shard of every frame slot of a store."""
    return store.frame("shard").repeat_interleave(store.page_size, dim=-1)


def shard_of_positions(store, n: int) -> torch.Tensor:
    """``[B, H, n]`` shard holding the token of each position (-1 where none is stored), read back from the store."""
    valid, pos, shard = store.frame("valid"), store.frame("pos").long(), slot_shard(store).long()
    out = torch.full((store.batch, store.heads, n), -1, dtype=torch.int64)
    for bi in range(store.batch):
        for hi in range(store.heads):
            out[bi, hi, pos[bi, hi][valid[bi, hi]]] = shard[bi, hi][valid[bi, hi]]
    return out


def run_without_interpreter(code: str) -> str:
    """Stdout of the Python ``code`` run in a subprocess without ``TRITON_INTERPRET``, so that its kernels compile for
    a GPU target (``sm90.compile_sm90``; ``src`` and ``tests`` first on its path). Skips the test without triton,
    fails it with the end of the subprocess's stderr when that exits non-zero."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(TESTS.parent / "src"), str(TESTS), env.get("PYTHONPATH"))))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def run_benchmark(script: str, *args: str, timeout: float = 600) -> None:
    """Run ``benchmarks/<script>`` with ``args`` from the repository root in a subprocess (``src`` first on its path),
    failing the test with the end of its stderr when it exits non-zero."""
    path = os.pathsep.join(filter(None, (str(TESTS.parent / "src"), os.environ.get("PYTHONPATH"))))
    env = {**os.environ, "PYTHONPATH": path}
    command = [sys.executable, f"benchmarks/{script}", *args]
    done = subprocess.run(command, cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]


def on_kernel_device(args):
    """``args`` (a tuple or list, nested lists too) with every tensor moved to :data:`KERNEL_DEVICE`."""
    return type(args)(
        a.to(KERNEL_DEVICE) if isinstance(a, torch.Tensor) else on_kernel_device(a) if isinstance(a, list | tuple)
        else a
        for a in args
    )  # fmt: skip


# one case per architecture for the generate scenarios: the model's own routing where it has one
SCENARIO_CASES = [(a, "key_cluster" if a == "llama" else "expert") for a in TINY_ARCHS]


__all__ = [
    "ARCH_ROUTER_CASES",
    "KERNEL_DEVICE",
    "byte_tokenizer",
    "SCENARIO_CASES",
    "DynamicCache",
    "free_port",
    "TOL",
    "generate",
    "greedy_logits",
    "max_logit_diff",
    "model_pair",
    "on_kernel_device",
    "pikv",
    "prompt",
    "run_benchmark",
    "run_without_interpreter",
    "shard_of_positions",
    "slot_shard",
]
