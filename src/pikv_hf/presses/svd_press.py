"""``SVDPress``: Truncated SVD of keys and values (rank r per layer and KV head, calibrated on real text)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pikv_hf.presses.projection_base import FittedProjectionPress


@dataclass
class SVDPress(FittedProjectionPress):
    """Truncated SVD per layer and KV head, calibrated on real text: the top-``rank`` right singular vectors
    ``V_r`` of the recorded ``[T, D]`` keys (values) give ``c = x V_r`` and ``x^ = c V_r^T``; at full rank the
    map is lossless.

    Fit it with ``python -m pikv_hf.codecs.fit --method svd --rank R`` (``make fit-projections``).
    Parameters: ``rank``, ``path``, ``window`` (see :class:`FittedProjectionPress`).
    """

    method: ClassVar[str] = "svd"
