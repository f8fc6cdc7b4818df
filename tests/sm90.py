"""Compile a Triton kernel for sm_90 without a GPU. Imported by the scripts that ``helpers.run_without_interpreter``
runs (the interpreter's kernels cannot be compiled), so it needs nothing but triton."""

from __future__ import annotations

import os
import subprocess
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_sm90(kernel: Any, types: dict[str, str], const: dict[str, Any], default: str = "i32", **options: Any):
    """``kernel`` (a ``triton.jit`` function) compiled for sm_90 by the CUDA front end, its pointers specialised as
    16-byte aligned, as a launch on a GPU specialises the tensors torch allocates (the loads of a tile then vectorise
    as they would there).

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
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
    src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 64), options=options)


def cuobjdump(compiled: Any, flag: str) -> str:
    """What the ``cuobjdump`` that triton ships prints for ``flag`` (``-sass``, ``--dump-resource-usage``) on the
    cubin of a kernel compiled by :func:`compile_sm90`."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def registers(compiled: Any) -> tuple[int, int]:
    """``(registers per thread, stack bytes per thread)`` of a kernel compiled by :func:`compile_sm90`, read from its
    cubin (stack bytes above 0: registers spilled). Registers bound how many programs an SM holds (65536 per SM: 4
    warps at 64 registers a thread fit 8 programs, at 255 only 2)."""
    out = cuobjdump(compiled, "--dump-resource-usage")
    usage = dict(item.split(":", 1) for line in out.splitlines() if "REG:" in line for item in line.split())
    return int(usage["REG"]), int(usage["STACK"])
