"""The RULER-style task families (see :mod:`pikv_hf.eval.ruler`): needle retrieval (``niah``), variable tracking,
the fact question, common-words and frequent-words extraction. Each generator draws from the ``rng`` it is given and
fills ``length`` tokens of prompt (less ``reserve``) from a :class:`~pikv_hf.eval.haystack.Haystack`."""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from pikv_hf.eval.haystack import Haystack, LengthError, insert_needles, word_list

NUM_MULTI = 4  # needles in multi-key / multi-value / multi-query tasks
VT_CHAIN = 5  # variables in the variable-tracking chain (4 hops)
CWE_COMMON = 10  # common words to report
CWE_FREQ_COMMON = 20  # occurrences of each common word (fewer, down to CWE_MIN_COMMON, when half the budget is less)
CWE_MIN_COMMON = 6
CWE_FREQ_UNCOMMON = 3  # occurrences of each uncommon word
FWE_TOP = 3  # frequent words to report
FWE_ALPHA = 2.0  # Zipf exponent of the frequent-words distribution
FWE_VOCAB = 200  # distinct coded words (fewer for short prompts: one per 16 budget tokens, at least 20)

NIAH_INSTRUCTION = (
    "Some special magic {kind}s are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind}s afterwards."
)
NIAH_NEEDLE = "One of the special magic {kind}s for {key} is: {value}."
VT_INSTRUCTION = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text. "
    "I will quiz you about the variables afterwards."
)
QA_INSTRUCTION = "Read the following text carefully. It contains a fact I will ask you about afterwards."

# (city, activity, keywords that a correct answer must contain)
QA_FACTS = (
    ("San Francisco", "eat a sandwich and sit in Dolores Park on a sunny day", ("sandwich", "Dolores Park")),
    ("Lisbon", "ride the yellow tram up to the castle at sunset", ("tram", "castle")),
    ("Kyoto", "walk through the bamboo grove before breakfast", ("bamboo",)),
    ("Oslo", "swim in the fjord next to the opera house", ("fjord", "opera")),
    ("Buenos Aires", "dance tango in a milonga after midnight", ("tango",)),
    ("Marrakesh", "drink mint tea on a rooftop above the souk", ("mint tea", "rooftop")),
    ("Reykjavik", "soak in a geothermal pool while it snows", ("geothermal", "pool")),
    ("Hanoi", "drink egg coffee by Hoan Kiem Lake at dawn", ("egg coffee", "Hoan Kiem")),  # not "pho": in "photos"
    ("Vienna", "hear a string quartet in a coffee house", ("string quartet", "coffee")),
    ("Cape Town", "hike up Lion's Head for the full moon", ("Lion's Head", "moon")),
    ("Montreal", "eat a bagel from a wood-fired oven", ("bagel",)),
    ("Istanbul", "take the ferry across the Bosphorus", ("ferry", "Bosphorus")),
    ("Edinburgh", "climb Arthur's Seat in the rain", ("Arthur's Seat",)),
    ("Seoul", "sing karaoke until the subway reopens", ("karaoke",)),
    ("Mexico City", "row a boat through the canals of Xochimilco", ("boat", "Xochimilco")),
    ("Helsinki", "sit in a sauna and jump into the sea", ("sauna",)),
)


@dataclass
class RulerSample:
    """One generated sample.

    Attributes
    ----------
    task, index, seed, length : identify the sample (``length`` is the target prompt length in tokens).
    context : str
        Text that is prefilled (and compressed) before the question.
    question : str
        The question, asked after the context.
    answer_prefix : str
        Text that starts the assistant's answer (RULER's answer prefix).
    answers : list of str
        Reference strings for the scoring rule.
    metric : str
        ``"string_match_all"`` or ``"string_match_part"``.
    needles : list of str
        Inserted needle sentences (empty for the extraction tasks).
    depths : list of float
        Stated depth of each needle (fraction of haystack tokens before it), same order as ``needles``.
    """

    task: str
    index: int
    seed: int
    length: int
    context: str
    question: str
    answer_prefix: str
    answers: list[str]
    metric: str
    needles: list[str] = field(default_factory=list)
    depths: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        """Return the sample as a JSON-serialisable dict."""
        return asdict(self)


def _key(rng: random.Random, words: tuple[str, ...]) -> str:
    return f"{rng.choice(words)}-{rng.choice(words)}"


def _distinct(rng: random.Random, make: Callable[[], str], n: int) -> list[str]:
    """``n`` values of ``make`` none of which holds another (answers are matched as substrings: an answer inside
    another word of the sample would score a wrong one)."""
    out: list[str] = []
    while len(out) < n:
        value = make()
        if not any(value in other or other in value for other in out):
            out.append(value)
    return out


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def niah(
    task: str, index: int, seed: int, length: int, haystack: Haystack, reserve: int, rng: random.Random
) -> RulerSample:
    words = word_list()
    kind = {"niah_single_word": "word", "niah_single_uuid": "uuid"}.get(task, "number")
    # answers are matched as substrings: a word answer never sits in the prompt's own text or inside a key, where a
    # prediction that only repeats the question would hold it ("word" in "special magic word", "element" in the key
    # "types-elementary")
    fixed_text = " ".join(
        [NIAH_INSTRUCTION.format(kind=kind), NIAH_NEEDLE.format(kind=kind, key="", value="")]
        + [part for t, n in (("niah_multiquery", 2), (task, 1)) for part in _niah_query(t, kind, [""] * n)]
    ).lower()

    def value(keys: list[str]) -> str:
        if kind == "word":
            word = rng.choice(words)
            while word in fixed_text or any(word in k for k in keys):
                word = rng.choice(words)
            # quoted: unquoted essay words read as part of the prose to a 135M model (2/6 vs 5/6 found at 2k)
            return f'"{word}"'
        if kind == "uuid":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        return _number(rng)

    if task == "niah_multikey":
        keys = _distinct(rng, lambda: _key(rng, words), NUM_MULTI)
        values = [value(keys) for _ in keys]
        target = rng.randrange(NUM_MULTI)
        needles = [NIAH_NEEDLE.format(kind=kind, key=k, value=v) for k, v in zip(keys, values, strict=True)]
        query_keys, answers = [keys[target]], [values[target]]
    elif task == "niah_multivalue":
        key = _key(rng, words)
        values = _distinct(rng, lambda: value([key]), NUM_MULTI)
        needles = [NIAH_NEEDLE.format(kind=kind, key=key, value=v) for v in values]
        query_keys, answers = [key], values
    elif task == "niah_multiquery":
        keys = _distinct(rng, lambda: _key(rng, words), NUM_MULTI)
        values = [value(keys) for _ in keys]
        needles = [NIAH_NEEDLE.format(kind=kind, key=k, value=v) for k, v in zip(keys, values, strict=True)]
        query_keys, answers = keys, values
    else:
        key = _key(rng, words)
        val = value([key])
        needles = [NIAH_NEEDLE.format(kind=kind, key=key, value=val)]
        query_keys, answers = [key], [val]
    answers = [a.strip('"') for a in answers]
    question, prefix = _niah_query(task, kind, query_keys)
    instruction = NIAH_INSTRUCTION.format(kind=kind)
    return _with_haystack(
        task, index, seed, length, haystack, reserve, rng, instruction, needles, question, prefix, answers
    )


def _niah_query(task: str, kind: str, query_keys: list[str]) -> tuple[str, str]:
    """The question and answer prefix of a NIAH sample asking for the values of ``query_keys``."""
    if len(query_keys) > 1:
        joined = ", ".join(query_keys[:-1]) + f", and {query_keys[-1]}"
        return (
            f"What are all the special magic {kind}s for {joined} mentioned in the provided text?",
            f"The special magic {kind}s for {joined} mentioned in the provided text are",
        )
    if task == "niah_multivalue":
        return (
            f"What are all the special magic {kind}s for {query_keys[0]} mentioned in the provided text?",
            f"The special magic {kind}s for {query_keys[0]} mentioned in the provided text are",
        )
    return (
        f"What is the special magic {kind} for {query_keys[0]} mentioned in the provided text?",
        f"The special magic {kind} for {query_keys[0]} mentioned in the provided text is",
    )


def _with_haystack(
    task: str,
    index: int,
    seed: int,
    length: int,
    haystack: Haystack,
    reserve: int,
    rng: random.Random,
    instruction: str,
    needles: list[str],
    question: str,
    prefix: str,
    answers: list[str],
    ordered: bool = False,
) -> RulerSample:
    count = haystack.count_tokens
    fixed = count(instruction + "\n") + count(question) + count(prefix) + sum(count(" " + n) for n in needles)
    budget = length - reserve - fixed
    if budget <= 0:
        raise LengthError(f"length={length} is too short for task {task!r} (needs more than {length - budget} tokens)")
    sentences, counts = haystack.take(rng, budget)
    depths = [rng.random() for _ in needles]
    if ordered:
        depths.sort()
    text, stated = insert_needles(sentences, counts, needles, depths)
    return RulerSample(
        task=task,
        index=index,
        seed=seed,
        length=length,
        context=instruction + "\n" + text,
        question=question,
        answer_prefix=prefix,
        answers=answers,
        metric="string_match_all",
        needles=needles,
        depths=stated,
    )


def variable_tracking(
    index: int, seed: int, length: int, haystack: Haystack, reserve: int, rng: random.Random
) -> RulerSample:
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    names = _distinct(rng, lambda: "".join(rng.choice(letters) for _ in range(5)), VT_CHAIN)
    value = str(rng.randint(10_000, 99_999))
    needles = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, VT_CHAIN)]
    question = f"Find all variables that are assigned the value {value} in the text above."
    prefix = (
        f"According to the chain of variable assignment in the text above, {VT_CHAIN} variables are assigned "
        f"the value {value}, they are:"
    )
    return _with_haystack(
        "variable_tracking",
        index,
        seed,
        length,
        haystack,
        reserve,
        rng,
        VT_INSTRUCTION,
        needles,
        question,
        prefix,
        names,
        ordered=True,
    )


def qa_fact(index: int, seed: int, length: int, haystack: Haystack, reserve: int, rng: random.Random) -> RulerSample:
    city, activity, keywords = QA_FACTS[rng.randrange(len(QA_FACTS))]
    needle = f"The best thing to do in {city} is to {activity}."
    question = f"What is the best thing to do in {city}?"
    prefix = f"The best thing to do in {city} is to"
    return _with_haystack(
        "qa_fact",
        index,
        seed,
        length,
        haystack,
        reserve,
        rng,
        QA_INSTRUCTION,
        [needle],
        question,
        prefix,
        list(keywords),
    )


def _fill_list(
    count: Callable[[str], int], budget: int, items: list[str], make_more: Callable[[], list[str]]
) -> list[str]:
    """Grow ``items`` with batches from ``make_more`` while the numbered list stays within ``budget`` tokens."""
    used = sum(count(f" {i + 1}. {w}") for i, w in enumerate(items))
    while True:
        batch = make_more()
        cost = sum(count(f" {len(items) + i + 1}. {w}") for i, w in enumerate(batch))
        if not batch or used + cost > budget:
            return items
        items = items + batch
        used += cost


def common_words(
    index: int, seed: int, length: int, haystack: Haystack, reserve: int, rng: random.Random
) -> RulerSample:
    count = haystack.count_tokens
    words = list(word_list())
    rng.shuffle(words)
    instruction = (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often."
    )
    question = f"What are the {CWE_COMMON} most common words in the above list?"
    prefix = f"The top {CWE_COMMON} words that appear most often in the list are:"
    # answers are matched as substrings: no answer sits inside another word of the list or in the prompt's own text
    fixed_text = f"{instruction} {question} {prefix}".lower()
    common: list[str] = []
    for w in words:
        if len(common) == CWE_COMMON:
            break
        if w not in fixed_text and not any(w in c or c in w for c in common):
            common.append(w)
    pool = iter(w for w in words if not any(c in w or w in c for c in common))
    fixed = count(instruction + "\n") + count(question) + count(prefix)
    budget = length - reserve - fixed
    # common words take at most half the budget: CWE_FREQ_COMMON occurrences each, fewer for short prompts
    cost = sum(count(f" {CWE_COMMON * CWE_FREQ_COMMON}. {w}") for w in common)  # one occurrence of each
    freq = min(CWE_FREQ_COMMON, budget // (2 * cost))
    if freq < CWE_MIN_COMMON:
        raise LengthError(f"length={length} is too short for task 'common_words'")
    base = [w for w in common for _ in range(freq)]

    def uncommon() -> list[str]:
        word = next(pool, None)
        if word is None:  # every word of the list is in already (a bare StopIteration before)
            raise LengthError(
                f"length={length} is beyond task 'common_words': its word list runs out before {budget} tokens"
            )
        return [word] * CWE_FREQ_UNCOMMON

    items = _fill_list(count, budget, base, uncommon)
    rng.shuffle(items)
    text = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
    return RulerSample(
        task="common_words",
        index=index,
        seed=seed,
        length=length,
        context=instruction + "\n" + text,
        question=question,
        answer_prefix=prefix,
        answers=common,
        metric="string_match_all",
    )


def zipf_counts(total: int, vocab: int, alpha: float) -> list[int]:
    """Occurrence counts ``round(total * r^-alpha / H)`` for ranks ``r = 1..vocab`` (at least 1 each).

    Parameters
    ----------
    total : int
        Approximate number of words.
    vocab : int
        Number of distinct words.
    alpha : float
        Zipf exponent.

    Returns
    -------
    list of int
        Counts by rank, non-increasing.
    """
    weights = [r ** (-alpha) for r in range(1, vocab + 1)]
    norm = sum(weights)
    return [max(1, round(total * w / norm)) for w in weights]


def frequent_words(
    index: int, seed: int, length: int, haystack: Haystack, reserve: int, rng: random.Random
) -> RulerSample:
    count = haystack.count_tokens
    letters = "abcdefghijklmnopqrstuvwxyz"
    instruction = (
        "Read the following coded text and track the frequency of each coded word. "
        "Find the three most frequently appeared coded words."
    )
    question = "Do not provide any explanation. What are the three most frequently appeared words in the coded text?"
    prefix = "Answer: According to the coded text above, the three most frequently appeared words are:"
    budget = length - reserve - count(instruction + "\n") - count(question) - count(prefix)
    n_vocab = max(20, min(FWE_VOCAB, budget // 16))
    fixed_text = f"{instruction} {question} {prefix}".lower()  # answers are matched as substrings: none sits in it

    def coded_word() -> str:
        while (word := "".join(rng.choice(letters) for _ in range(rng.randint(3, 5)))) in fixed_text:
            pass
        return word

    vocab = _distinct(rng, coded_word, n_vocab)
    costs = [count(" " + w) for w in vocab]

    def used(total: int) -> int:  # tokens of `total` Zipf-distributed words (grows with total)
        return sum(c * k for c, k in zip(zipf_counts(total, len(vocab), FWE_ALPHA), costs, strict=True))

    if used(len(vocab)) > budget:
        raise LengthError(f"length={length} is too short for task 'frequent_words'")
    lo, hi = len(vocab), max(len(vocab), budget)  # the most words that fit: used(lo) <= budget
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if used(mid) <= budget else (lo, mid - 1)
    counts = zipf_counts(lo, len(vocab), FWE_ALPHA)
    words = [w for w, c in zip(vocab, counts, strict=True) for _ in range(c)]
    if not counts[FWE_TOP - 1] > counts[FWE_TOP]:
        raise LengthError(f"length={length} is too short for task 'frequent_words' (top-{FWE_TOP} not distinct)")
    rng.shuffle(words)
    return RulerSample(
        task="frequent_words",
        index=index,
        seed=seed,
        length=length,
        context=instruction + "\n" + " ".join(words),
        question=question,
        answer_prefix=prefix,
        answers=vocab[:FWE_TOP],
        metric="string_match_all",
    )
