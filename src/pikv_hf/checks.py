"""Argument checks shared by the cache, the placements and the evaluation config (one message format), and the name
of the kvpress press whose hook is running, for error messages."""

from __future__ import annotations

import inspect


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


def calling_press() -> str:
    """The class name of the outermost kvpress press whose hook is running (for error messages), or ``"code"``."""
    from kvpress import BasePress  # only when an error is being raised

    name = "code"
    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, BasePress):
            name = type(owner).__name__
        frame = frame.f_back
    return name
