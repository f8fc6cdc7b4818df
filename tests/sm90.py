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

_F32, _F16, _BF16, _I64, _I32, _U8 = "*fp32", "*fp16", "*bf16", "*i64", "*i32", "*u8"
_SCALES = dict.fromkeys(("ks_ptr", "kz_ptr", "vs_ptr", "vz_ptr"), _F16)  # a 2/4/8-bit page's scales and zeros
_PLAN = dict.fromkeys(("table_ptr", "start_ptr", "len_ptr", "row_start_ptr", "qpos_ptr"), _I64)
_SPLIT = {"q_ptr": _BF16, "k_ptr": _BF16, "v_ptr": _BF16, **_SCALES, "pos_ptr": _I32, "valid_ptr": _U8, **_PLAN,
          "full_ptr": _U8, "o_ptr": _F32, "lse_ptr": _F32, "count_ptr": _I32, "qk_scale": "fp32"}  # fmt: skip
_SPECIAL = dict.fromkeys(("slot_ptr", "spos_ptr", "reach_ptr", "qpos_ptr", "start_ptr"), _I64)  # sink / window pages

# Triton type of every pointer and float parameter of each kernel (``module.function``), at an 8B model's dtypes
# (bfloat16 queries and KV); parameters not named are ``i32``
ARG_TYPES: dict[str, dict[str, str]] = {
    "decode._split_kernel_fn": _SPLIT,
    "decode._merge_kernel": {**dict.fromkeys(("o_part_ptr", "lse_part_ptr", "sinks_ptr", "o_ptr", "lse_ptr"), _F32),
                             "count_ptr": _I32, "attended_ptr": _I64},
    "decode_quant._split_q4_kernel_fn": {**{k: t for k, t in _SPLIT.items() if k not in ("k_ptr", "v_ptr")},
                                         "kq_ptr": _U8, "vq_ptr": _U8},
    "dequant._dequant_kernel": {"kq_ptr": _U8, "vq_ptr": _U8, **_SCALES, "k_out_ptr": _BF16, "v_out_ptr": _BF16},
    "append._append_one_kernel": {
        **dict.fromkeys(("shard_ptr", "row_start_ptr", "pos_ptr", "open_page_ptr", "open_fill_ptr", "n_pages_ptr",
                         "start_ptr", "cap_ptr", "count_ptr", "slot_ptr", "ring_slot_ptr", "ring_pos_ptr"), _I64),
        **dict.fromkeys(("key_ptr", "value_ptr", "key_pool_ptr", "value_pool_ptr", "bias_pool_ptr", "page_min_ptr",
                         "page_max_ptr"), _BF16),
        **dict.fromkeys(("sum_ptr", "sq_ptr", "min_ptr", "max_ptr"), _F32),
        "pos_pool_ptr": _I32, "valid_pool_ptr": "*i1", "page_shard_ptr": "*i16",
    },
    "merge._merge_kernel": dict.fromkeys(("o1_ptr", "lse1_ptr", "o2_ptr", "lse2_ptr", "o_ptr", "lse_ptr"), _F32),
    "quest._group_kernel": {"score_ptr": _F32, "n_pages_ptr": _I64, "out_ptr": _I64, "len_ptr": _I32,
                            "fraction": "fp32"},
    "quest._select_kernel": {"score_ptr": _F32, "n_pages_ptr": _I64, "out_ptr": _I64, "len_ptr": _I32,
                             "fraction": "fp32"},
    "quest._scores_kernel": {"q_ptr": _BF16, "kmin_ptr": _BF16, "kmax_ptr": _BF16, "valid_ptr": _U8, **_SPECIAL,
                             "out_ptr": _F32},
    "route_select._route_select_kernel": {"q_ptr": _BF16, "sum_ptr": _F32, "sq_ptr": _F32, "n_ptr": _I64,
                                          "score_ptr": _F32, "logit_ptr": _F32, "out_ptr": _U8, "target": "fp32",
                                          "scale": "fp32"},
    "routed_plan._routed_plan_kernel": {"chosen_ptr": _U8, "shard_ptr": "*i16", **_SPECIAL, "pages_ptr": _I64,
                                        "full_ptr": _U8, "len_ptr": _I32},
    "place_key._place_key_kernel": {"k_ptr": _F32, "c_ptr": _F32, "n_ptr": _I64, "norm_ptr": _F32, "out_ptr": _I64},
}  # fmt: skip
CODES = {"k_ptr": _U8, "v_ptr": _U8}  # the split kernel's K / V over 2/4/8-bit codes


def kernel_key(kernel: Any) -> str:
    """``module.function`` of a ``triton.jit`` kernel (its key in :data:`ARG_TYPES`)."""
    fn = kernel
    while hasattr(fn, "fn"):
        fn = fn.fn
    return f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}"


def compile_sm90(kernel: Any, const: dict[str, Any], types: dict[str, str] | None = None, **options: Any):
    """``kernel`` (a ``triton.jit`` function) compiled for sm_90 by the CUDA front end, its pointers specialised as
    16-byte aligned, as a launch on a GPU specialises the tensors torch allocates (the loads of a tile then vectorise
    as they would there).

    Parameters
    ----------
    kernel : triton.runtime.JITFunction
        The kernel, with its parameter types in :data:`ARG_TYPES`; its parameters named in ``const`` are constexprs
        of those values.
    types : dict, optional
        Triton types overriding the table's (``CODES``: the split kernel over codes).
    options
        Compile options (``num_warps``, ``num_stages``, ``maxnreg``).

    Returns
    -------
    triton.compiler.CompiledKernel
        The compiled kernel (``metadata.shared``: bytes of shared memory, ``metadata.num_warps``).
    """
    key = kernel_key(kernel)
    table = ARG_TYPES[key] | (types or {})
    names = kernel.arg_names
    untyped = [n for n in names if n.endswith("_ptr") and n not in const and n not in table]
    if untyped:
        raise KeyError(f"ARG_TYPES[{key!r}] has no type for the pointers {untyped}")
    sig = {n: "constexpr" if n in const else table.get(n, "i32") for n in names}
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
