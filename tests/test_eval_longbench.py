"""LongBench metrics against hand-computed values, fixture loading, prompts, truncation and bad input."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from pikv_hf.eval import longbench
from pikv_hf.eval.metrics import (
    classification,
    code_sim,
    count,
    normalize_answer,
    qa_f1,
    qa_f1_zh,
    retrieval,
    retrieval_zh,
    rouge_l,
    rouge_l_zh,
)

FIXTURES = Path(__file__).parent / "fixtures"


def test_qa_f1_hand_computed():
    assert normalize_answer("The  Eiffel Tower, Paris!") == "eiffel tower paris"
    # pred tokens {eiffel, tower, paris}, ref {eiffel, tower}: P = 2/3, R = 1 -> F1 = 0.8
    assert qa_f1("The Eiffel Tower, Paris", "Eiffel Tower") == pytest.approx(0.8)
    assert qa_f1("London", "Paris") == 0.0
    assert qa_f1("", "Paris") == 0.0
    # repeated tokens count once per occurrence: pred {a1 x2}, ref {x1}: P = 1/3, R = 1 -> 0.5
    assert qa_f1("a1 x2 x2", "x2") == pytest.approx(0.5)


def test_qa_f1_zh_hand_computed():
    # jieba: 北京/是/中国/的/首都 vs 北京 -> P = 1/5, R = 1 -> F1 = 1/3
    assert qa_f1_zh("北京是中国的首都。", "北京") == pytest.approx(1 / 3)


def test_rouge_l_hand_computed():
    # LCS(the cat sat on the mat, the cat lay on the mat) = 5 tokens of 6 and 6 -> F = 5/6
    assert rouge_l("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(5 / 6)
    assert rouge_l("", "anything") == 0.0
    # 北京/是/中国/的/首都 vs 北京/是/首都: LCS 3, P = 3/5, R = 1 -> F = 0.75
    assert rouge_l_zh("北京是中国的首都", "北京是首都") == pytest.approx(0.75)


def test_classification_hand_computed():
    classes = ["Entity", "Location", "Number", "Number of people"]
    assert classification("Location", "Location", all_classes=classes) == 1.0
    assert classification("Location or Entity", "Location", all_classes=classes) == 0.5
    assert classification("Number", "Number of people", all_classes=classes) == 0.0
    assert classification("Number of people", "Number of people", all_classes=classes) == 1.0
    with pytest.raises(ValueError, match="all_classes must be a non-empty list"):
        classification("x", "y", all_classes=None)


def test_retrieval_count_and_code_hand_computed():
    assert retrieval("Paragraph 12, or maybe 3", "Paragraph 12") == 0.5
    assert retrieval("no idea", "Paragraph 12") == 0.0
    assert retrieval_zh("段落5", "段落5") == 1.0
    assert count("There are 7 unique paragraphs out of 9", 7) == 0.5
    # first line without ``` / # / //: "x = foo(a, b)" vs "x = foo(a, c)": Indel distance 2 over 26 chars
    assert code_sim("```python\n# call\nx = foo(a, b)\n```", "x = foo(a, c)") == pytest.approx(1 - 2 / 26)


def test_fixture_rows_score_as_hand_computed():
    rows = {name: longbench.load_dataset_rows(name, str(FIXTURES / "longbench")) for name in ("hotpotqa", "trec")}
    hot = rows["hotpotqa"]
    assert longbench.score_example("hotpotqa", "Paris, France", hot[0]["answers"]) == pytest.approx(2 / 3)
    # best reference wins: "in 1889" normalises to "in 1889" -> F1 with "completed in 1889" = 2*(2/3*1)/(5/3) = 0.8
    assert longbench.score_example("hotpotqa", "completed in 1889", hot[1]["answers"]) == pytest.approx(0.8)
    trec = rows["trec"][0]
    # only the first line counts for trec
    assert longbench.score_example("trec", "\nLocation\nEntity", trec["answers"], trec["all_classes"]) == 1.0
    assert longbench.score_example("trec", "Location Entity", trec["answers"], trec["all_classes"]) == 0.5


def test_prompt_split_and_middle_truncation():
    from pikv_hf.eval.generation import PromptBuilder

    class Builder(PromptBuilder):
        def __init__(self):
            self.has_template = False
            self.head, self.tail = "", "\n"

        def count(self, text):
            return len(text.split())

        def build(self, context, question, answer_prefix, chat=True, separator="\n\n"):
            return context, question

    class Tok:  # word tokens that carry their leading whitespace, like byte-level BPE
        def encode(self, text, add_special_tokens=False):
            return re.findall(r"\s*\S+", text)

        def decode(self, tokens):
            return "".join(tokens)

    builder = Builder()
    builder.tokenizer = Tok()
    row = longbench.load_dataset_rows("hotpotqa", str(FIXTURES / "longbench"))[0]
    full = longbench.PROMPTS["hotpotqa"].replace("{context}", row["context"]).replace("{input}", row["input"])
    example = longbench.build_example(row, "hotpotqa", builder, max_length=10_000)
    context, question = example["ids"]
    assert context + question == full
    assert question.startswith("\n\nAnswer the question") and question.endswith(f"Question: {row['input']}\nAnswer:")
    assert example["max_new_tokens"] == 32 and example["record"]["truncated_tokens"] == 0
    # truncation keeps the first and last halves of the context words
    n_context = len(row["context"].split())
    budget = len(full.split()) - 10
    example = longbench.build_example(row, "hotpotqa", builder, max_length=budget)
    context, _ = example["ids"]
    kept = context.split()[len(longbench.PROMPTS["hotpotqa"].split("{context}")[0].split()) :]
    words = row["context"].split()
    assert example["record"]["truncated_tokens"] == 10
    assert kept == words[: (n_context - 10) // 2] + words[n_context - (n_context - 10 - (n_context - 10) // 2) :]


def test_bad_input_is_reported_clearly():
    with pytest.raises(ValueError, match=r"missing field\(s\) \['answers'\]"):
        longbench.load_dataset_rows("hotpotqa", str(FIXTURES / "longbench_broken"))
    with pytest.raises(FileNotFoundError, match="longbench_dir: .*narrativeqa.jsonl not found"):
        longbench.load_dataset_rows("narrativeqa", str(FIXTURES / "longbench"))
    with pytest.raises(ValueError, match="dataset must be one of"):
        longbench.resolve_datasets("hotpotqa,nope")
    assert longbench.base_dataset("hotpotqa_e") == "hotpotqa"
    assert len(longbench.resolve_datasets("all")) == 21


@pytest.mark.parametrize(
    ("name", "fields", "message"),
    [
        ("trec", {"all_classes": None}, "trec is scored by class: 'all_classes' must list class names, got None"),
        ("lsht", {"all_classes": []}, "must list class names, got \\[\\]"),
        ("passage_retrieval_en", {"answers": ["the third one"]}, "must name its paragraph \\('Paragraph N'\\)"),
        ("passage_retrieval_zh", {"answers": ["Paragraph 3"]}, "must name its paragraph \\('段落N'\\)"),
    ],
)
def test_rows_the_metric_cannot_score_are_refused_when_loaded(tmp_path, name, fields, message):
    """The scorer raised on such rows after the model had answered the first of them (a traceback mid-run)."""
    row = {"input": "q", "context": "c", "answers": ["Paragraph 3", "段落3"], "length": 1, "dataset": name,
           "language": "en", "all_classes": ["a", "b"], "_id": "x", **fields}  # fmt: skip
    (tmp_path / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=message):
        longbench.load_dataset_rows(name, str(tmp_path))


def test_hub_failure_names_the_local_alternative(monkeypatch):
    import datasets

    tried = []

    def offline(*args, **kwargs):
        tried.append(args[0])
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match="could not load THUDM/LongBench/hotpotqa .*--longbench-dir"):
        longbench.load_dataset_rows("hotpotqa")
    assert tried == ["THUDM/LongBench", "json"]


def test_middle_truncation_fits_when_the_seam_takes_more_tokens():
    """Decoded and joined, the two kept halves can encode to more tokens than the halves did (a greedy tokenizer
    reads ``ab`` + ``cde`` as ``abc d e``): the prompt text must still fit in ``max_length`` (it was over by up to
    one token per seam)."""
    from pikv_hf.eval.generation import PromptBuilder

    class Tok:  # greedy longest match over a tiny vocabulary
        def encode(self, text, add_special_tokens=False):
            return re.findall(r"abc|cde|ab|.", text, flags=re.S)

        def decode(self, tokens):
            return "".join(tokens)

    class Builder(PromptBuilder):
        def __init__(self):
            self.tokenizer, self.has_template = Tok(), False

        def count(self, text):
            return len(self.tokenizer.encode(text))

        def build(self, context, question, answer_prefix, chat=True, separator="\n\n"):
            return context, separator + question + answer_prefix

    builder, rng, over = Builder(), random.Random(0), 0
    row = longbench.load_dataset_rows("hotpotqa", str(FIXTURES / "longbench"))[0]
    head, tail = longbench.PROMPTS["hotpotqa"].split("{context}")
    for _ in range(300):
        context = "".join(rng.choice(["ab", "cde", "c", "de", "x"]) for _ in range(rng.randint(5, 60)))
        question = tail.replace("{input}", row["input"])
        fixed = builder.count(head) + builder.count(question)
        max_length = fixed + rng.randint(1, len(Tok().encode(context)))
        example = longbench.build_example({**row, "context": context}, "hotpotqa", builder, max_length)
        prompt, asked = example["ids"]
        assert builder.count(prompt) + builder.count(asked) <= max_length
        over += builder.count(prompt) + builder.count(asked) == max_length
    assert over > 0  # the cut is no larger than needed: many prompts fill the budget exactly


def test_a_length_below_the_prompts_own_text_is_refused():
    """The whole context was cut and the prompt still ran over max_length, scored under that length with no
    context at all."""
    from pikv_hf.eval.haystack import LengthError

    class Tok:
        def encode(self, text, add_special_tokens=False):
            return text.split()

        def decode(self, tokens):
            return " ".join(tokens)

    class Builder:
        tokenizer = Tok()

        def count(self, text):
            return len(text.split())

        def build(self, context, question, answer_prefix, chat=True, separator="\n\n"):
            return context, question

    row = longbench.load_dataset_rows("hotpotqa", str(FIXTURES / "longbench"))[0]
    head, tail = longbench.PROMPTS["hotpotqa"].split("{context}")
    fixed = len(head.split()) + len(tail.replace("{input}", row["input"]).split())
    longbench.build_example(row, "hotpotqa", Builder(), max_length=fixed)  # fits with no context
    with pytest.raises(LengthError, match=f"length={fixed - 1} is too short for hotpotqa .* takes {fixed} tokens"):
        longbench.build_example(row, "hotpotqa", Builder(), max_length=fixed - 1)



def test_a_tokenizer_without_a_chat_template_gets_its_bos_and_the_answer_on_its_own_line():
    """A base model (``--model PATH`` without a chat template): the question ran on into the answer prefix
    ("...text?The special magic number ... is") and the text had no BOS, though ``reserve()`` counted both."""
    from pikv_hf.eval.generation import PromptBuilder

    class Tok:  # characters as tokens; BOS (id 0) added at a text's start when special tokens are asked for
        chat_template, bos_token = None, "<s>"

        def encode(self, text, add_special_tokens=False):
            return [0] * add_special_tokens + [ord(c) for c in text]

    builder = PromptBuilder(Tok())
    assert builder.reserve() == len("<s>") + len("\n") + len("\n\n")
    ctx, qst = builder.build("essay", "Which number?", "The number is")
    assert ctx[0].tolist() == [0, *map(ord, "essay")]
    assert "".join(map(chr, qst[0].tolist())) == "\n\nWhich number?\nThe number is"
    _, raw = builder.build("essay", "Which number?", " Answer:", chat=False)  # plain text asked for: as written
    assert "".join(map(chr, raw[0].tolist())) == "\n\nWhich number? Answer:"
