"""``LoRAPlusPress``: LoRA++: the learned projection with biases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pikv_hf.presses.projection_base import FittedProjectionPress


@dataclass
class LoRAPlusPress(FittedProjectionPress):
    """LoRA++: the LoRA projection with biases on both maps (``c = x A + a``, ``x^ = c B + b``), its up
    matrix trained at 16x the learning rate (LoRA+, Hayou et al. 2024).

    Fit it with ``python -m pikv_hf.codecs.fit --method lora_plus --rank R`` (``make fit-projections``).
    Parameters: ``rank``, ``path``, ``window`` (see :class:`FittedProjectionPress`).
    """

    method: ClassVar[str] = "lora_plus"
