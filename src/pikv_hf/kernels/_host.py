"""Host-side checks and sizes shared by the kernel wrappers: every check reads shapes, dtypes and strides only (no
host sync), except :func:`check_pages_in_range`, which reads the ids and is skipped on asynchronous paths."""

from __future__ import annotations

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def expect(
    name: str,
    t: torch.Tensor,
    shape: tuple[int | None, ...],
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    contiguous: bool = True,
) -> None:
    """Raise unless ``t`` has ``shape`` (None: any size), one of ``dtypes``, lives on ``device`` and (by default) is
    contiguous, i.e. has exactly the strides a kernel indexes it with."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(s is not None and s != got for s, got in zip(shape, t.shape, strict=True)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {want}; got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must be {' or '.join(str(d) for d in dtypes)}; got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous; got strides {t.stride()} for shape {list(t.shape)}")


def check_pages_in_range(pages: torch.Tensor, num_pages: int, what: str = "page ids") -> None:
    """Raise if an entry of ``pages`` is outside ``[-1, num_pages)`` (reads the tensor: a host sync on CUDA)."""
    if pages.numel() and bool(((pages < -1) | (pages >= num_pages)).any()):
        lo, hi = int(pages.min()), int(pages.max())
        raise IndexError(f"{what} must be in [-1, {num_pages}) (-1: none); got min {lo}, max {hi}")
