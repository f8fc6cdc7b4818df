"""Argument checks shared by the cache, the placements and the evaluation config (one message format)."""

from __future__ import annotations


def check_int_at_least(name: str, value: object, low: int) -> None:
    """Raise ``ValueError("<name> must be an integer >= <low>, got <value>")`` unless ``value`` is such an int."""
    if not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
