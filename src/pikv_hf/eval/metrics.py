"""LongBench metrics (Bai et al., 2024, "LongBench: A Bilingual, Multitask Benchmark for Long Context Understanding").

Written from the benchmark's published definitions; every function returns a score in [0, 1] for one prediction
against one reference (LongBench takes the maximum over a sample's references and reports 100 x the mean).

* ``qa_f1``: token F1 after SQuAD normalisation (lower case, no punctuation, no articles a/an/the, single spaces).
* ``qa_f1_zh``: token F1 over jieba words, each lower-cased with punctuation (ASCII and CJK) and spaces removed.
* ``rouge_l`` / ``rouge_l_zh``: ROUGE-L F1 (longest common subsequence of tokens). English uses the tokenizer of
  ``rouge-score`` (the package HF ``evaluate``'s rouge metric wraps; ``evaluate.load("rouge")`` needs the hub);
  Chinese uses jieba words.
* ``classification``: the classes named in the prediction, minus those that are strict substrings of the reference;
  ``1 / #matches`` if the reference is among them, else 0.
* ``retrieval`` / ``retrieval_zh``: the reference paragraph id (``Paragraph N`` / ``段落N``); the fraction of numbers
  in the prediction equal to it.
* ``count``: the fraction of numbers in the prediction equal to the reference count.
* ``code_sim``: first prediction line without a code fence, ``#`` or ``//``, compared with the reference by the
  normalised Indel similarity ``2 * LCS_chars / (len_a + len_b)`` (``rapidfuzz.fuzz.ratio`` / 100).

Not bit-comparable with the official scripts' published numbers on the ROUGE datasets (gov_report, qmsum,
multi_news, samsum, vcsum, dureader): LongBench's ``eval.py`` scores them with the ``rouge`` 1.0.1 package, which is
case-sensitive, keeps punctuation on words, counts distinct words and scores 0 on any exception ("Paris" against
"paris": 1.0 here, 0.0 there; "the cat the cat" against "the cat": 0.667 here, 1.0 there). ``code_sim`` differs by
at most 0.005 per sample (``fuzzywuzzy`` rounds to whole percents), and ``classification`` where the official loop
skips a class it deletes while iterating (two matched classes in a row, both substrings of the reference). Compare
presses with each other under this harness, not with published LongBench tables.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable

CJK_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀"
    "｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, drop ASCII punctuation and the articles a/an/the, collapse spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def normalize_zh_answer(text: str) -> str:
    """Chinese normalisation: lower case, drop ASCII and CJK punctuation, drop all whitespace."""
    punctuation = set(string.punctuation) | set(CJK_PUNCTUATION)
    text = "".join(ch for ch in text.lower() if ch not in punctuation)
    return "".join(text.split())


def token_f1(prediction_tokens: list[str], reference_tokens: list[str]) -> float:
    """F1 of the multiset overlap of two token lists (0 when either is empty or nothing overlaps)."""
    common = Counter(prediction_tokens) & Counter(reference_tokens)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(prediction_tokens)
    recall = overlap / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, reference: str, **_: object) -> float:
    """Token F1 between normalised English prediction and reference."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def _zh_tokens(text: str) -> list[str]:
    import jieba

    return [t for t in (normalize_zh_answer(w) for w in jieba.cut(text, cut_all=False)) if t]


def qa_f1_zh(prediction: str, reference: str, **_: object) -> float:
    """Token F1 over normalised jieba words (Chinese)."""
    return token_f1(_zh_tokens(prediction), _zh_tokens(reference))


class _WordTokenizer:
    """Tokenizer object for ``rouge_score``: jieba words, whitespace dropped."""

    def tokenize(self, text: str) -> list[str]:
        import jieba

        return [w for w in (t.strip() for t in jieba.cut(text, cut_all=False)) if w]


def rouge_l(prediction: str, reference: str, **_: object) -> float:
    """ROUGE-L F1 with the ``rouge-score`` tokenizer (lower case, alphanumeric tokens, no stemming)."""
    from rouge_score import rouge_scorer

    if not prediction.strip() or not reference.strip():
        return 0.0
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False).score(reference, prediction)["rougeL"].fmeasure


def rouge_l_zh(prediction: str, reference: str, **_: object) -> float:
    """ROUGE-L F1 over jieba words (Chinese)."""
    from rouge_score import rouge_scorer

    if not prediction.strip() or not reference.strip():
        return 0.0
    scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=_WordTokenizer())
    return scorer.score(reference, prediction)["rougeL"].fmeasure


def classification(prediction: str, reference: str, all_classes: list[str] | None = None, **_: object) -> float:
    """LongBench classification score (see module docstring); ``all_classes`` is required."""
    if not all_classes:
        raise ValueError("all_classes must be a non-empty list for the classification metric")
    matches = [c for c in all_classes if c in prediction]
    matches = [c for c in matches if not (c in reference and c != reference)]
    return 1.0 / len(matches) if reference in matches else 0.0


def _fraction_equal(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


def retrieval(prediction: str, reference: str, **_: object) -> float:
    """Fraction of numbers in the prediction equal to the id in the reference ``Paragraph N``."""
    found = re.findall(r"Paragraph (\d+)", reference)
    if not found:
        raise ValueError(f"reference must contain 'Paragraph N', got {reference!r}")
    return _fraction_equal(prediction, found[0])


def retrieval_zh(prediction: str, reference: str, **_: object) -> float:
    """Fraction of numbers in the prediction equal to the id in the reference ``段落N``."""
    found = re.findall(r"段落(\d+)", reference)
    if not found:
        raise ValueError(f"reference must contain '段落N', got {reference!r}")
    return _fraction_equal(prediction, found[0])


def count(prediction: str, reference: str | int, **_: object) -> float:
    """Fraction of numbers in the prediction equal to the reference count."""
    return _fraction_equal(prediction, str(reference))


def code_sim(prediction: str, reference: str, **_: object) -> float:
    """Indel similarity of the first plain code line of the prediction with the reference line."""
    from rapidfuzz import fuzz

    line = next(
        (ln for ln in prediction.lstrip("\n").split("\n") if "`" not in ln and "#" not in ln and "//" not in ln), ""
    )
    return fuzz.ratio(line, reference) / 100.0


METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1,
    "qa_f1_zh": qa_f1_zh,
    "rouge_l": rouge_l,
    "rouge_l_zh": rouge_l_zh,
    "classification": classification,
    "retrieval": retrieval,
    "retrieval_zh": retrieval_zh,
    "count": count,
    "code_sim": code_sim,
}
