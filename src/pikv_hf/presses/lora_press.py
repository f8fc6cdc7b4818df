"""``LoRAPress``: LoRA-style learned down / up projection of keys and values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pikv_hf.presses.projection_base import FittedProjectionPress


@dataclass
class LoRAPress(FittedProjectionPress):
    """A learned down / up projection per layer and KV head (Hu et al. 2021's ``x A B`` factorisation),
    fitted offline on recorded keys and values: ``c = x A``, ``x^ = c B``.

    Fit it with ``python -m pikv_hf.codecs.fit --method lora --rank R`` (``make fit-projections``).
    Parameters: ``rank``, ``path``, ``window`` (see :class:`FittedProjectionPress`).
    """

    method: ClassVar[str] = "lora"
