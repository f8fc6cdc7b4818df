"""Compile a Triton kernel for sm_90 without a GPU. Imported by the scripts that ``helpers.run_without_interpreter``
runs (the interpreter's kernels cannot be compiled), so it needs nothing but triton."""

from __future__ import annotations

from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_sm90(kernel: Any, types: dict[str, str], const: dict[str, Any], default: str = "i32", **options: Any):
    """``kernel`` (a ``triton.jit`` function) compiled for sm_90 by the CUDA front end.

    Parameters
    ----------
    kernel : triton.runtime.JITFunction
        The kernel; its parameters named in ``const`` are constexprs of those values.
    types : dict
        Triton type of the other parameters (``"*bf16"``, ``"i32"``, ...); ``default`` for those it does not name.
    options
        Compile options (``num_warps``, ``num_stages``).

    Returns
    -------
    triton.compiler.CompiledKernel
        The compiled kernel (``metadata.shared``: bytes of shared memory, ``metadata.num_warps``).
    """
    names = kernel.arg_names
    sig = {n: "constexpr" if n in const else types.get(n, default) for n in names}
    src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 64), options=options)
