"""The evaluation loop on a tiny random Llama: presses, resume, outputs, PiKVCache branch, bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.tiny_assets import save_tiny_model_dir, tiny_llama

from pikv_hf import PiKVCache
from pikv_hf.cli import main as cli_main
from pikv_hf.eval import generation, runner, summary
from pikv_hf.eval import points as eval_points
from pikv_hf.eval.config import EvalConfig, build_press, press_names
from pikv_hf.eval.generation import prefill
from pikv_hf.eval.points import PrefillRecord
from pikv_hf.eval.runner import run_eval

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]


def _ruler_config(model_dir: str, out: Path, **kw) -> EvalConfig:
    base = dict(
        suite="ruler",
        model=model_dir,
        presses=["none", "knorm", "streaming_llm"],
        ratios=[0.25, 0.5],
        out=str(out),
        samples=2,
        lengths=[512],
        tasks="niah_single_number,variable_tracking",
    )
    base.update(kw)
    return EvalConfig(**base)


def test_ruler_run_writes_predictions_metrics_plot_and_compresses(model_dir, tmp_path):
    out = tmp_path / "run"
    metrics = run_eval(_ruler_config(model_dir, out), progress=False)
    rows = _rows(out)
    assert len(rows) == 2 * 2 * (1 + 2 * 2) and metrics["complete"] and metrics["n_rows"] == 20
    for row in rows:
        # kvpress keeps int(n * (1 - ratio)) context tokens per head
        assert row["kept_context_tokens"] == int(row["context_tokens"] * (1 - row["ratio"]))
        assert 0.0 <= row["score"] <= 1.0 and row["input_tokens"] <= 512
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["query_aware"] is False and saved["seed"] == 0
    assert saved["versions"]["kvpress"] == "0.5.5" and "commit" in saved["git"]
    assert saved["arguments"]["presses"] == ["none", "knorm", "streaming_llm"]
    points = {(p["press"], p["ratio"]): p for p in saved["per_point"]}
    assert set(points) == {
        ("none", 0.0),
        ("knorm", 0.25),
        ("knorm", 0.5),
        ("streaming_llm", 0.25),
        ("streaming_llm", 0.5),
    }
    for (press, ratio), point in points.items():
        mine = [r["score"] for r in rows if r["press"] == press and r["ratio"] == ratio]
        assert point["n"] == 4 and point["score"] == pytest.approx(100 * sum(mine) / len(mine))
    png = (out / "score_vs_ratio.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_interrupted_run_resumes_without_redoing_finished_samples(model_dir, tmp_path, monkeypatch):
    out = tmp_path / "run"
    config = _ruler_config(model_dir, out, presses=["none", "knorm"], ratios=[0.5], tasks="niah_single_number")
    run_eval(config, progress=False)
    lines = (out / "predictions.jsonl").read_text().splitlines(keepends=True)
    assert len(lines) == 4
    # simulate a crash: two finished rows and a torn third line
    (out / "predictions.jsonl").write_text("".join(lines[:2]) + lines[2][:17])
    calls = []
    original = generation.answer_from_cache

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(generation, "answer_from_cache", counting)
    monkeypatch.setattr(runner, "git_commit", lambda: {"commit": "later", "dirty": False})  # resumed at other code
    run_eval(config, progress=False)
    assert len(calls) == 2
    new_lines = (out / "predictions.jsonl").read_text().splitlines(keepends=True)
    assert new_lines[:2] == lines[:2] and len(new_lines) == 4
    assert {json.loads(x)["key"] for x in new_lines} == {json.loads(x)["key"] for x in lines}
    metrics = run_eval(config, progress=False)
    assert len(calls) == 2  # nothing left to do
    assert metrics["complete"] and metrics["model_info"]["model_type"] == "llama"  # kept from the earlier run
    # each row names the code that answered it (metrics.json named the latest session's only)
    first = json.loads(lines[0])["git"]
    assert metrics["git"]["commit"] == "later" and metrics["row_commits"] == {first: 2, "later": 2}


def test_every_listed_kvpress_press_builds_with_the_ratio():
    names = press_names()
    assert "CriticalKVPress" not in names.values() and names["snapkv"] == "SnapKVPress"
    for name in set(names.values()):
        assert build_press(name, 0.25).compression_ratio == 0.25


@pytest.mark.parametrize("name", ["snapkv", "knorm", "streaming_llm", "expected_attention", "tova"])
def test_replayed_prefill_equals_kvpress_own_flow(name):
    model = tiny_llama(vocab_size=300, seed=3)
    ids = torch.randint(0, 300, (1, 150), generator=torch.Generator().manual_seed(1))
    replayed = PrefillRecord(model, ids).compressed_cache(build_press(name, 0.5))
    real = prefill(model, ids, build_press(name, 0.5))
    for a, b in zip(replayed.layers, real.layers, strict=True):
        assert a.keys.shape[-2] == int(150 * 0.5)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_longbench_run_on_the_jsonl_fixture(model_dir, tmp_path):
    out = tmp_path / "lb"
    metrics = run_eval(
        EvalConfig(
            suite="longbench",
            model=model_dir,
            presses=["none"],
            ratios=[0.5],
            out=str(out),
            samples=5,
            lengths=[512],
            tasks="hotpotqa,trec,passage_count,lcc",
            longbench_dir=str(FIXTURES / "longbench"),
        ),
        progress=False,
    )
    rows = _rows(out)
    assert sorted((r["task"], r["index"]) for r in rows) == [
        ("hotpotqa", 0),
        ("hotpotqa", 1),
        ("lcc", 0),
        ("passage_count", 0),
        ("trec", 0),
    ]
    assert metrics["complete"] and {t["task"]: t["n"] for t in metrics["per_task"]}["hotpotqa"] == 2


def test_pikv_cache_branch_matches_dynamic_cache(model_dir, tmp_path):
    common = dict(presses=["none"], tasks="niah_single_number", samples=2)
    run_eval(_ruler_config(model_dir, tmp_path / "dyn", **common), progress=False)
    # a fresh process: importing kvpress wraps every registered attention function, and its wrapper cannot take
    # PiKVCache's paged keys (reported to the cache's owner); the CLI imports kvpress only when a press is asked for
    cmd = [
        sys.executable,
        "-m",
        "pikv_hf.cli",
        "eval",
        "--suite",
        "ruler",
        "--model",
        model_dir,
        "--cache",
        "pikv",
        "--router",
        "round_robin",
        "--press",
        "none",
        "pikv_routed",
        "pikv_quest",
        "--ratio",
        "0",
        "0.75",
        "--samples",
        "2",
        "--length",
        "512",
        "--tasks",
        "niah_single_number",
        "--no-progress",
        "--out",
        str(tmp_path / "pikv"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    dyn = [r["prediction"] for r in _rows(tmp_path / "dyn")]
    rows = _rows(tmp_path / "pikv")
    by_point = {(p, r): [row for row in rows if (row["press"], row["ratio"]) == (p, r)] for p, r in _points(rows)}
    # exact mode, and routed / Quest reading every page (ratio 0), answer exactly as DynamicCache does
    for point in [("none", 0.0), ("pikv_routed", 0.0), ("pikv_quest", 0.0)]:
        assert [r["prediction"] for r in by_point[point]] == dyn and any(dyn), point
    for point in [("pikv_routed", 0.0), ("pikv_quest", 0.0)]:
        assert all(r["fraction_pages_read"] == 1.0 for r in by_point[point])
    # skipping 3/4: Quest reads ceil(pages / 4) per step (sink and window pages included), routed 2 of 8 shards
    # plus the sink and window pages
    assert all(0.25 <= r["fraction_pages_read"] < 0.3 for r in by_point[("pikv_quest", 0.75)])
    assert all(r["fraction_tokens_attended"] < 0.6 for r in by_point[("pikv_routed", 0.75)])
    metrics = json.loads((tmp_path / "pikv" / "metrics.json").read_text())
    assert metrics["query_aware"] is True and metrics["complete"]


def _points(rows):
    return sorted({(r["press"], r["ratio"]) for r in rows})


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--suite", "nope"], "suite must be one of"),
        (["--suite", "ruler", "--press", "nope"], "press must be 'none', one of"),
        (["--suite", "ruler", "--model", "no/such/dir"], "model must be one of"),
        (["--suite", "ruler", "--press", "knorm", "--ratio", "1.0"], r"ratio must be in \[0, 1\), got 1.0"),
        (["--suite", "ruler", "--press", "knorm", "--ratio", "-0.1"], r"ratio must be in \[0, 1\)"),
        (["--suite", "ruler", "--press", "snapkvv", "--cache", "pikv"], "press must be 'none', one of"),
        (["--suite", "ruler", "--press", "pikv_routed"], "reads a PiKVCache at decode time: it needs --cache pikv"),
        (["--suite", "ruler", "--press", "pikv_h2o_offload_routed"], "it needs --cache pikv"),
        (
            ["--suite", "ruler", "--cache", "pikv", "--press", "pikv_routed", "--ratio", "0.3"],
            "must skip a whole number of the 8 shards",
        ),
        (["--suite", "ruler", "--cache", "pikv", "--press", "pikv_routed", "--selector", "x"], "selector must be"),
        (["--suite", "ruler", "--cache", "pikv", "--press", "pikv_routed", "--window", "0"], "window must be"),
        (["--suite", "ruler", "--cache", "pikv", "--press", "pikv_quest", "--n-sink", "-1"], "n_sink must be"),
        (
            ["--suite", "ruler", "--cache", "pikv", "--press", "pikv_routed", "--mass-target", "1.5"],
            r"mass_target must be None or a number in \(0, 1\]",
        ),
        (["--suite", "ruler", "--cache", "paged"], "cache must be one of"),
        # both keyed "0.25": one point answered, the other silently missing
        (["--suite", "ruler", "--press", "knorm", "--ratio", "0.25", "0.2500001"], "one point to 6 significant"),
        # a named model's layers are known before it loads (this was a traceback after writing run_config.json)
        (
            ["--suite", "ruler", "--cache", "pikv", "--press", "pikv_routed", "--dense-layers", "31"],
            r"dense_layers must be an integer in \[0, 30\], got 31",
        ),
        # PiKVCache options with the DynamicCache flow were ignored
        (["--suite", "ruler", "--num-shards", "4"], "num_shards configure a PiKVCache: they need cache 'pikv'"),
        (["--suite", "ruler", "--page-size", "8", "--router", "key_cluster"], "router, page_size configure"),
        (["--suite", "ruler", "--window", "8"], "the read options .* configure a PiKVCache"),
        (["--suite", "ruler", "--samples", "0"], "samples must be >= 1"),
        (["--suite", "ruler", "--tasks", "nope"], "unknown RULER task 'nope'"),
        (["--suite", "ruler", "--tasks", ""], "unknown RULER task ''"),
        (["--suite", "ruler", "--model", ""], "model must be one of .* got ''"),
        (["--suite", "ruler", "--model", str(FIXTURES)], "has no readable config.json"),
        (["--suite", "ruler", "--model", str(FIXTURES / "longbench")], "holds no weights"),
        (["--suite", "ruler", "--seed", str(2**64)], r"seed must be an integer in \[0, 2\*\*63\)"),
        (["--suite", "ruler", "--cache", "pikv", "--num-shards", "40000"], "num_shards must be at most 32767"),
        (["--suite", "ruler", "--press", "quant@bits=4,bits=2"], "bits is set twice"),
        (["--suite", "ruler", "--press", "quantized_cache@q_group_size=0"], "q_group_size must be an integer >= 1"),
        (
            ["--suite", "longbench", "--longbench-dir", str(FIXTURES / "longbench_broken"), "--tasks", "hotpotqa"],
            r"missing field\(s\) \['answers'\]",
        ),
    ],
)
def test_bad_input_fails_clearly_before_writing(tmp_path, capsys, args, message):
    out = tmp_path / "never"
    assert cli_main(["eval", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pikv-hf eval: error: ")
    assert re.search(message, err[0])
    assert not out.exists()


def test_routed_ratio_of_a_path_model_is_checked_before_it_loads(model_dir, tmp_path, capsys):
    """A PATH model's shard count comes from its config.json: a ratio that skips no whole number of shards was a
    traceback after the model loaded and the 'none' rows were written."""
    out = tmp_path / "never"
    args = ["--model", model_dir, "--cache", "pikv", "--press", "none", "pikv_routed", "--ratio", "0.3"]
    assert cli_main(["eval", "--suite", "ruler", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "must skip a whole number of the 8 shards" in err[0] and not out.exists()


def test_a_context_no_longer_than_a_press_query_window_is_refused_before_any_answer(model_dir, tmp_path, capsys):
    """SnapKV scores with its last 64 queries and asserts on a shorter context: the fixture's lcc row (62 tokens)
    crashed the run with kvpress's AssertionError after other rows were written."""
    out = tmp_path / "run"
    args = ["--suite", "longbench", "--model", model_dir, "--tasks", "hotpotqa,lcc", "--longbench-dir",
            str(FIXTURES / "longbench"), "--samples", "1", "--length", "512", "--press", "none", "snapkv"]  # fmt: skip
    assert cli_main(["eval", *args, "--no-progress", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("pikv-hf eval: error: lcc sample 0 at length 512: the context has 62 tokens")
    predictions = out / "predictions.jsonl"
    assert "window_size 64" in err[-1] and not (predictions.is_file() and predictions.read_text().strip())


def test_output_directory_of_another_configuration_is_refused(model_dir, tmp_path):
    out = tmp_path / "run"
    config = _ruler_config(model_dir, out, presses=["none"], tasks="niah_single_number", samples=1)
    run_eval(config, progress=False)
    with pytest.raises(ValueError, match="holds results of another configuration"):
        run_eval(_ruler_config(model_dir, out, presses=["none"], tasks="niah_single_number", samples=1, seed=1))


def test_presses_inside_pikv_cache_answer_as_on_dynamic_cache(model_dir, tmp_path):
    # one prefill per sample, every press replayed on a fork: the same kept tokens, so the same answers
    common = dict(
        presses=["snapkv", "pikv_h2o", "pikv_streaming_llm"], ratios=[0.5], tasks="niah_single_number", samples=2
    )
    dyn = run_eval(_ruler_config(model_dir, tmp_path / "dyn", **common), progress=False)
    pikv = run_eval(_ruler_config(model_dir, tmp_path / "pikv", cache="pikv", **common), progress=False)
    rows = {(r["press"], r["index"]): r for r in _rows(tmp_path / "pikv")}
    for row in _rows(tmp_path / "dyn"):
        twin = rows[row["press"], row["index"]]
        assert twin["prediction"] == row["prediction"]
        assert twin["kept_context_tokens"] == row["kept_context_tokens"]  # resident tokens per layer and KV head
    assert dyn["complete"] and pikv["complete"]


def test_a_press_with_passes_of_its_own_prefills_a_pikv_cache_of_its_own(tmp_path, monkeypatch):
    # KVzip reconstructs the context in extra forward passes after the prefill: replaying one recorded prefill's
    # hooks cannot run it, so the harness runs kvpress's prefill with the press into a fresh PiKVCache
    model = tiny_llama(vocab_size=300, seed=3)
    ids = torch.randint(0, 300, (1, 150), generator=torch.Generator().manual_seed(1))
    config = _ruler_config("unused", tmp_path, cache="pikv", presses=["kvzip", "snapkv"], ratios=[0.5])
    calls = []
    monkeypatch.setattr(eval_points, "prefill", lambda m, c, press, cache: calls.append((press, cache)) or cache)
    make = eval_points.pikv_decoders(model, config, ids)
    cache, _, _ = make("kvzip", 0.5)
    ((press, into),) = calls
    assert type(press).__name__ == "KVzipPress" and press.compression_ratio == 0.5 and into is cache
    assert isinstance(cache, PiKVCache) and cache.get_seq_length() == 0  # not the recorded prefill's fork
    replayed, _, _ = make("snapkv", 0.5)
    assert len(calls) == 1 and replayed.layers[0].keys.shape[-2] == 75  # SnapKV replays the recorded hooks


def test_longbench_end_to_end_through_the_command_line(model_dir, tmp_path, capsys):
    # every dataset family of the fixture, with its own metric, through `pikv-hf eval` into a PiKVCache
    from pikv_hf.eval import longbench

    datasets = sorted(p.stem for p in (FIXTURES / "longbench").glob("*.jsonl"))
    out = tmp_path / "lb"
    args = ["eval", "--suite", "longbench", "--longbench-dir", str(FIXTURES / "longbench"), "--model", model_dir]
    args += ["--tasks", ",".join(datasets), "--cache", "pikv", "--press", "none", "pikv_h2o", "--ratio", "0.5"]
    assert cli_main([*args, "--samples", "1", "--length", "512", "--no-progress", "--out", str(out)]) == 0
    assert "complete=True" in capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    assert sorted(t["task"] for t in metrics["per_task"] if t["press"] == "none") == datasets
    metric_names = {longbench.DATASET_METRIC[longbench.base_dataset(d)] for d in datasets}
    assert metric_names == set(longbench.DATASET_METRIC.values())  # the fixture exercises every metric
    records = {d: longbench.load_dataset_rows(d, str(FIXTURES / "longbench"))[0] for d in datasets}
    for row in _rows(out):
        record = records[row["task"]]
        expected = longbench.score_example(row["task"], row["prediction"], record["answers"], record["all_classes"])
        assert row["score"] == pytest.approx(expected)
        if row["press"] == "pikv_h2o":
            assert row["kept_context_tokens"] == pytest.approx(
                row["context_tokens"] - row["context_tokens"] // 2, abs=1
            )


def test_protocol_names_query_aware_and_agnostic_points():
    def protocol(presses, cache="pikv"):
        return summary.protocol(
            EvalConfig(suite="ruler", model="smollm2", presses=presses, ratios=[0.5], out="x", cache=cache)
        )

    assert protocol(["none", "pikv_h2o", "snapkv"])["query_aware"] is False
    assert protocol(["none", "pikv_routed"])["query_aware"] is True
    mixed = protocol(["none", "pikv_h2o", "pikv_quest", "pikv_h2o_offload_routed"])
    assert mixed["query_aware"] == "mixed"
    assert mixed["query_aware_presses"] == ["pikv_quest", "pikv_h2o_offload_routed"]
    assert mixed["protocol"].startswith("mixed. pikv_quest, pikv_h2o_offload_routed: query-aware")


def test_a_changed_read_or_perplexity_setting_does_not_reuse_old_rows(tmp_path):
    """--sparse-from is part of the output fingerprint (a resumed run mixed two read protocols), and perplexity rows
    are reused only for the same context and scored lengths (a changed --perplexity-context reused the old rows)."""
    import json

    from pikv_hf.config import ReadConfig
    from pikv_hf.eval.config import EvalConfig
    from pikv_hf.eval.results import PERPLEXITY
    from pikv_hf.eval.runner import _perplexity_rows

    base = dict(suite="ruler", model="smollm2", presses=["none"], ratios=[0.5], out=str(tmp_path), cache="pikv")
    assert EvalConfig(**base).fingerprint() != EvalConfig(**base, read=ReadConfig(sparse_from=8192)).fingerprint()
    row = {"press": "none", "ratio": 0.0, "context_tokens": 512, "tokens": 255, "nll": 3.0, "perplexity": 20.0855}
    (tmp_path / PERPLEXITY).write_text(json.dumps(row) + "\n")

    def load():
        raise RuntimeError("rows recomputed")

    same = EvalConfig(**base, perplexity_context=512, perplexity_tokens=256)
    assert _perplexity_rows(same, [("none", 0.0)], tmp_path / PERPLEXITY, load) == [row]
    for context, tokens in ((4096, 256), (512, 64)):
        other = dict(perplexity_context=context, perplexity_tokens=tokens)
        with pytest.raises(RuntimeError, match="rows recomputed"):
            _perplexity_rows(EvalConfig(**base, **other), [("none", 0.0)], tmp_path / PERPLEXITY, load)


def test_a_last_row_that_lost_its_newline_is_kept_and_the_next_row_starts_a_line(tmp_path):
    """A whole last row without its newline (an interrupted write) is read and gets the newline back, so the next
    appended row starts its own line (the two once shared a line: a later resume dropped both and every row after)."""
    import json

    from pikv_hf.eval.results import append_row, read_predictions

    path = tmp_path / "predictions.jsonl"
    path.write_text(json.dumps({"key": "a"}) + "\n" + json.dumps({"key": "b"}))
    assert [r["key"] for r in read_predictions(path)] == ["a", "b"]
    with path.open("a", encoding="utf-8") as handle:
        append_row(handle, {"key": "c"})
    assert [r["key"] for r in read_predictions(path)] == ["a", "b", "c"]


def test_a_damaged_row_before_the_last_is_refused_and_nothing_is_cut(tmp_path):
    """Only a torn last line is dropped: a damaged line followed by results raises naming the file and line, and the
    file keeps every byte (it was cut at the damaged line, deleting the valid rows after it)."""
    import json

    from pikv_hf.eval.results import read_predictions

    path = tmp_path / "predictions.jsonl"
    text = json.dumps({"key": "a"}) + "\n" + '{"key": "b", "pred' + "\n" + json.dumps({"key": "c"}) + "\n"
    path.write_text(text)
    with pytest.raises(ValueError, match="line 2 of .*predictions.jsonl is damaged"):
        read_predictions(path)
    assert path.read_text() == text
    path.write_text(json.dumps({"key": "a"}) + "\n" + json.dumps([1, 2]) + "\n")
    with pytest.raises(ValueError, match="line 2 of .* is no result row"):
        read_predictions(path)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda out: (out / "metrics.json").write_text("{bad"), "metrics.json is not a readable JSON file"),
        (lambda out: (out / "metrics.json").write_text("[1]"), "metrics.json holds list, not a JSON object"),
        (lambda out: (out / "run_config.json").write_text("{bad"), "run_config.json is not a readable JSON file"),
        (lambda out: (out / "predictions.jsonl").write_text('{"no_key": 1}\n'), "is no result row"),
        (lambda out: out.rmdir() or out.write_text("a file"), "out: cannot create the directory"),
    ],
)
def test_an_out_directory_with_damaged_files_is_one_error_line(tmp_path, capsys, damage, message):
    out = tmp_path / "run"
    out.mkdir()
    damage(out)
    assert cli_main(["eval", "--suite", "ruler", "--tasks", "niah_single_number", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pikv-hf eval: error: out: ") and message in err[0]

