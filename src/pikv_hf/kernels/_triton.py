"""Triton, imported once and optionally: kernels are defined whether or not it is installed, and launching one
without it raises a clear error (``pip install pikv_hf[kernels]``), so the torch references next to them work
everywhere.

Interpret mode (``TRITON_INTERPRET=1``) is fixed when a kernel is *decorated*, i.e. when its module is first
imported: set it before importing ``pikv_hf.kernels`` (the test-suite's ``conftest.py`` does) to run the kernels
on CPU tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # optional dependency: the references and the torch backend do not need it
    triton = tl = InterpretedFunction = None  # kernel modules use postponed annotations: ``tl`` is read only at launch

HAVE_TRITON = triton is not None


class _MissingTriton:
    """Stands in for a kernel when triton is not installed; launching it raises."""

    def __init__(self, fn: Callable) -> None:
        self.__name__ = fn.__name__

    def __getitem__(self, grid: Any) -> Callable:
        raise RuntimeError(
            f"kernel {self.__name__} needs triton, which is not installed (pip install pikv_hf[kernels])"
        )


def jit(fn: Callable) -> Any:
    """``triton.jit`` when triton is installed, else a stand-in that raises when launched."""
    return triton.jit(fn) if HAVE_TRITON else _MissingTriton(fn)


def eager_direct(op: Any, cuda: Callable, cpu: Callable, traced: Callable | None = None) -> Callable:
    """``op`` (a torch custom operator) as library code calls it.

    - Eager code calls the implementation for the tensors' device directly (``cuda``: the Triton kernel's launcher,
      ``cpu``: the operator's CPU implementation), because the dispatcher's path through a Python custom operator
      costs more host time per call (about 0.2 ms on this project's CPU) than a small reference computes.
    - Code under a dispatch mode (fake tensors; ``benchmarks/count_ops.py``, which counts each operator as the one
      kernel launch it is on CUDA) calls the operator.
    - Traced code (``torch.compile``) calls ``traced`` when given, else the operator where
      :func:`traced_as_operator` says so (CUDA) and the CPU implementation elsewhere (inductor compiles it with the
      step).
    """

    def call(*args: Any) -> Any:
        t = next((a for a in _tensors(args) if isinstance(a, torch.Tensor)), None)
        if torch.compiler.is_compiling():
            if traced is not None:
                return traced(*args)
            return op(*args) if t is None or traced_as_operator(t) else cpu(*args)
        if t is not None and runs_eagerly(t):
            return (cuda if t.is_cuda else cpu)(*args)
        return op(*args)

    return call


def _tensors(args: tuple) -> Iterator[Any]:
    """``args`` with the items of list and tuple arguments (a ``Tensor[]`` of an operator's schema) in their place."""
    for a in args:
        if isinstance(a, list | tuple):
            yield from a
        else:
            yield a


def traced_as_operator(t: torch.Tensor) -> bool:
    """Whether traced code (``torch.compile``) calls an operator at ``t``'s device as the opaque operator rather than
    its torch reference, which inductor compiles with the step: on CUDA, where the operator is one kernel launch and
    inductor's code for in-place scatters into the state (graph inputs) copied the whole tensors (an H100 profile of
    compiled steps: every layer's K/V pool twice per step); not on the CPU, where inductor writes in place and the
    dispatcher's path through a Python custom operator costs host time per call (a compiled SmolLM2 routed step at
    8192 tokens: 118.5 ms through the operators, 98.3 ms with their references compiled in)."""
    return t.is_cuda


def runs_eagerly(t: torch.Tensor) -> bool:
    """Whether code handling ``t`` runs eagerly: not traced, under no dispatch mode, on a plain tensor (so a host
    path may read values back and take data-dependent shapes on the CPU)."""
    return not torch.compiler.is_compiling() and not torch._C._len_torch_dispatch_stack() and type(t) is torch.Tensor


def interpreted(kernel: Any) -> bool:
    """Whether ``kernel`` was decorated in interpret mode (it then runs on CPU tensors)."""
    return InterpretedFunction is not None and isinstance(kernel, InterpretedFunction)


def check_launchable(kernel: Any, device: torch.device) -> None:
    """Raise before launch if ``kernel`` cannot run on tensors of ``device``."""
    if not HAVE_TRITON:
        raise RuntimeError("the Triton kernels need triton, which is not installed (pip install pikv_hf[kernels])")
    if device.type != "cuda" and not interpreted(kernel):
        raise RuntimeError(
            f"Triton kernels run on CUDA tensors, got {device}; for CPU set TRITON_INTERPRET=1 before pikv_hf.kernels "
            "is first imported (correctness only, slow) or use the torch reference"
        )
