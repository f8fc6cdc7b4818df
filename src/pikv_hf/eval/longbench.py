"""LongBench harness: data loading (hub or local JSONL), the official per-task prompts, truncation and metrics.

Facts taken from LongBench (Bai et al., 2024; github.com/THUDM/LongBench, ``config/dataset2prompt.json``,
``dataset2maxlen.json`` and ``eval.py``): the prompt template of each dataset, the maximum answer length, the metric
of each dataset, that the few-shot datasets (trec, triviaqa, samsum, lsht, lcc, repobench-p) are prompted without a
chat template, that trec/triviaqa/samsum/lsht predictions are cut at their first line before scoring, that a
sample's score is the maximum over its references, and that an over-long prompt is truncated in the middle (the
first and last halves of ``max_length`` tokens are kept). ``{name}_e`` (LongBench-E) datasets use the same settings.

Query-agnostic split: the prompt is cut right after the context; the context part is prefilled (and compressed)
first, the rest (question and answer cue) is asked afterwards. Middle truncation removes tokens from the middle of
the context, so that the prompt text (without chat scaffolding) has at most ``max_length`` tokens.

Local data: a directory with one ``{dataset}.jsonl`` per dataset in the official format (fields ``input``,
``context``, ``answers`` (list), ``length``, ``dataset``, ``language``, ``all_classes``, ``_id``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pikv_hf.eval.haystack import LengthError
from pikv_hf.eval.metrics import METRICS

PROMPTS = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the "
    "question asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: "
    "{context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if "
    "possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "qasper": "You are given a scientific article and a question. Answer the question as concisely as you can, using "
    "a single phrase or sentence if possible. If the question cannot be answered based on the information in the "
    'article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". '
    "Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as "
    "concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based "
    'on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", '
    '"no", or "unanswerable". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:',
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following "
    "question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: "
    "{input}\nAnswer:",
    "multifieldqa_zh": "阅读以下文字并用中文简短回答：\n\n{context}\n\n"
    "现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。"
    "\n\n问题：{input}\n回答：",
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
    "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
    "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "musique": "Answer the question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
    "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n"
    "请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
    "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query "
    "in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting "
    "transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}"
    "\n\nNow, write a one-page summary of all the news.\n\nSummary:",
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n"
    "{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any "
    "other words. The following are some examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n"
    "{input}",
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please "
    "carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. "
    "In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final "
    "count of unique paragraphs after removing duplicates. The output format should only contain the number, such "
    "as 1, 2, 3, and so on.\n\nThe final answer is: ",
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which "
    "paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the "
    'number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph '
    '2", etc.\n\nThe answer is: ',
    "passage_retrieval_zh": "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}"
    "\n\n下面是一个摘要\n\n{input}"
    '\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：',
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

MAX_NEW_TOKENS = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "multifieldqa_zh": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "dureader": 128,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "vcsum": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "lsht": 64,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32,
    "lcc": 64,
    "repobench-p": 64,
}

DATASET_METRIC = {
    "narrativeqa": "qa_f1",
    "qasper": "qa_f1",
    "multifieldqa_en": "qa_f1",
    "multifieldqa_zh": "qa_f1_zh",
    "hotpotqa": "qa_f1",
    "2wikimqa": "qa_f1",
    "musique": "qa_f1",
    "dureader": "rouge_l_zh",
    "gov_report": "rouge_l",
    "qmsum": "rouge_l",
    "multi_news": "rouge_l",
    "vcsum": "rouge_l_zh",
    "trec": "classification",
    "triviaqa": "qa_f1",
    "samsum": "rouge_l",
    "lsht": "classification",
    "passage_retrieval_en": "retrieval",
    "passage_count": "count",
    "passage_retrieval_zh": "retrieval_zh",
    "lcc": "code_sim",
    "repobench-p": "code_sim",
}

NO_CHAT_TEMPLATE = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")
FIRST_LINE_ONLY = ("trec", "triviaqa", "samsum", "lsht")
HUB_DATA_ZIP = "hf://datasets/THUDM/LongBench/data.zip"
REQUIRED_FIELDS = ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id")
LONGBENCH_E = (
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "gov_report",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)
DATASETS = tuple(PROMPTS) + tuple(f"{d}_e" for d in LONGBENCH_E)


def base_dataset(name: str) -> str:
    """The LongBench dataset a (possibly LongBench-E ``_e``) name uses the settings of."""
    if name not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {name!r}")
    return name[:-2] if name.endswith("_e") else name


def resolve_datasets(spec: str) -> list[str]:
    """Expand ``all`` or a comma-separated list of dataset names.

    Parameters
    ----------
    spec : str
        ``all`` (the 21 LongBench datasets) or names such as ``hotpotqa,trec``.

    Returns
    -------
    list of str
        Dataset names.
    """
    names = list(PROMPTS) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise ValueError("tasks must name at least one LongBench dataset")
    for name in names:
        base_dataset(name)
    return names


def validate_row(row: dict, where: str, name: str | None = None) -> dict:
    """Check that a row has the official fields with the right types, and what dataset ``name``'s metric reads:
    class names for classification (trec, lsht), a ``Paragraph N`` (``段落N``) reference for retrieval.

    Parameters
    ----------
    row : dict
        One JSON record.
    where : str
        File and line, for the error message.
    name : str, optional
        Dataset name (its metric's needs are checked when given).

    Returns
    -------
    dict
        The row.
    """
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a LongBench row must be a JSON object, got {type(row).__name__}")
    missing = [f for f in REQUIRED_FIELDS if f not in row]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}; a LongBench row needs {list(REQUIRED_FIELDS)}")
    if not isinstance(row["answers"], list) or not row["answers"]:
        raise ValueError(f"{where}: field 'answers' must be a non-empty list, got {row['answers']!r}")
    if not isinstance(row["context"], str) or not isinstance(row["input"], str):
        raise ValueError(f"{where}: fields 'context' and 'input' must be strings")
    if row["all_classes"] is not None and not isinstance(row["all_classes"], list):
        raise ValueError(f"{where}: field 'all_classes' must be a list or null, got {row['all_classes']!r}")
    metric = DATASET_METRIC.get(base_dataset(name)) if name is not None else None
    if metric == "classification" and not (row["all_classes"] and all(isinstance(c, str) for c in row["all_classes"])):
        classes = row["all_classes"]
        raise ValueError(f"{where}: {name} is scored by class: 'all_classes' must list class names, got {classes!r}")
    marker = {"retrieval": r"Paragraph (\d+)", "retrieval_zh": r"段落(\d+)"}.get(metric)
    if marker is not None and not all(re.search(marker, str(a)) for a in row["answers"]):
        shown = marker.replace(r"(\d+)", "N")
        raise ValueError(f"{where}: every answer of {name} must name its paragraph ('{shown}'), got {row['answers']!r}")
    return row


def load_dataset_rows(name: str, local_dir: str | None = None) -> list[dict]:
    """Rows of one LongBench dataset, from ``local_dir/{name}.jsonl`` or from the hub (``THUDM/LongBench``).

    Parameters
    ----------
    name : str
        Dataset name (see :data:`DATASETS`).
    local_dir : str, optional
        Directory of official-format JSONL files; when None, ``datasets.load_dataset`` is used.

    Returns
    -------
    list of dict
        Validated rows.
    """
    base_dataset(name)
    if local_dir is not None:
        path = Path(local_dir) / f"{name}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"longbench_dir: {path} not found (expected one {{dataset}}.jsonl per dataset)")
        rows = []
        try:
            lines = path.read_text(encoding="utf-8").split("\n")  # not splitlines: U+2028 may sit in a string
        except UnicodeDecodeError as err:
            raise ValueError(f"longbench_dir: {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
        for lineno, line in enumerate(lines, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{lineno}: invalid JSON ({err})") from err
                rows.append(validate_row(row, f"{path}:{lineno}", name))
        if not rows:
            raise ValueError(f"longbench_dir: {path} holds no rows")
        return rows
    import datasets

    errors = []
    data = None
    # the loading script of the dataset (datasets < 4), then the JSONL inside its data.zip (datasets 4 runs no scripts)
    for args, kwargs in (
        (("THUDM/LongBench", name), {"split": "test"}),
        (("json",), {"data_files": f"zip://data/{name}.jsonl::{HUB_DATA_ZIP}", "split": "train"}),
    ):
        try:
            data = datasets.load_dataset(*args, **kwargs)
            break
        except Exception as err:  # no hub, no script support: try the next way, then say what to do instead
            errors.append(f"{type(err).__name__}: {err}")
    if data is None:
        raise RuntimeError(
            f"could not load THUDM/LongBench/{name} through datasets ({'; '.join(errors)}); pass --longbench-dir with "
            "official-format {dataset}.jsonl files"
        )
    return [validate_row(dict(row), f"THUDM/LongBench/{name}[{i}]", name) for i, row in enumerate(data)]


def build_example(row: dict, name: str, builder, max_length: int) -> dict:
    """Prompt parts, token ids and generation budget of one row.

    Parameters
    ----------
    row : dict
        A validated LongBench row.
    name : str
        Dataset name.
    builder : pikv_hf.eval.generation.PromptBuilder
        Tokenizer wrapper that builds the context/question ids.
    max_length : int
        Maximum prompt length in tokens (without chat scaffolding); the context is cut in the middle beyond it
        (``LengthError`` when the prompt does not fit without any context).

    Returns
    -------
    dict
        ``record`` (answers, classes, id, truncation), ``ids`` (context ids, question ids), ``max_new_tokens``.
    """
    base = base_dataset(name)
    head, tail = PROMPTS[base].split("{context}")
    question = tail.replace("{input}", row["input"])
    tokenizer = builder.tokenizer
    context_tokens = tokenizer.encode(row["context"], add_special_tokens=False)
    overflow = builder.count(head) + len(context_tokens) + builder.count(question) - max_length
    removed = 0
    context = row["context"]
    while overflow > 0 and removed < len(context_tokens):
        # the two halves are decoded and joined: encoded again, the joint can take more tokens than the parts (a
        # word cut at the seam), so the cut grows until the prompt text fits
        removed = min(removed + overflow, len(context_tokens))
        keep = len(context_tokens) - removed
        left = keep // 2
        context = tokenizer.decode(context_tokens[:left]) + tokenizer.decode(context_tokens[left + removed :])
        overflow = builder.count(head + context) + builder.count(question) - max_length
    if overflow > 0:  # the prompt's own text (instructions, question) does not fit, even without the context
        fixed = builder.count(head) + builder.count(question)
        raise LengthError(
            f"length={max_length} is too short for {name} row {row['_id']!r}: its prompt without the context takes "
            f"{fixed} tokens"
        )
    ids = builder.build(head + context, question, "", chat=base not in NO_CHAT_TEMPLATE, separator="")
    record = {
        "answers": [str(a) for a in row["answers"]],
        "all_classes": row["all_classes"],
        "_id": row["_id"],
        "truncated_tokens": removed,
    }
    return {"record": record, "ids": ids, "max_new_tokens": MAX_NEW_TOKENS[base]}


def score_example(name: str, prediction: str, answers: list[str], all_classes: list[str] | None = None) -> float:
    """LongBench score of one prediction in [0, 1]: the best match over the references.

    Parameters
    ----------
    name : str
        Dataset name.
    prediction : str
        Generated text.
    answers : list of str
        References.
    all_classes : list of str, optional
        Class names (classification datasets).

    Returns
    -------
    float
        ``max_r metric(prediction, r)``.
    """
    base = base_dataset(name)
    if base in FIRST_LINE_ONLY:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = METRICS[DATASET_METRIC[base]]
    return max(metric(prediction, answer, all_classes=all_classes) for answer in answers)
