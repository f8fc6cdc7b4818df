"""Argument checks shared by the cache, the placements and the evaluation config (one message format)."""

from __future__ import annotations


def check_int_at_least(name: str, value: object, low: int) -> None:
    """Raise ``ValueError("<name> must be an integer >= <low>, got <value>")`` unless ``value`` is such an int."""
    if not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def check_ratio(name: str, value: object) -> None:
    """Raise ``ValueError("<name> must be a number in [0, 1), got <value>")`` unless ``value`` is such a number."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")


class CommandLineError(ValueError):
    """Bad input to a ``pikv-hf`` command, found before any work: printed as one ``pikv-hf CMD: error:`` line."""
