"""``DistillPress``: A projection distilled to preserve attention distributions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pikv_hf.presses.projection_base import FittedProjectionPress


@dataclass
class DistillPress(FittedProjectionPress):
    """A projection trained offline to preserve attention (the PiKV paper's distillation): started from the
    truncated SVD and trained on real text to minimise the KL divergence between the full and the compressed
    causal attention distributions plus the relative error of the attention outputs.

    Fit it with ``python -m pikv_hf.codecs.fit --method distill --rank R`` (``make fit-projections``).
    Parameters: ``rank``, ``path``, ``window`` (see :class:`FittedProjectionPress`).
    """

    method: ClassVar[str] = "distill"
