"""``pikv-hf demo --tiny`` end to end (its exit code asserts identical outputs and logits within 1e-4), and the
command line's answer to bad arguments: one ``pikv-hf CMD: error:`` line, exit status 2, nothing run."""

import dataclasses

import pytest

from pikv_hf.cli import main
from pikv_hf.config import ReadConfig


def test_tiny_demo_runs_and_reports_exactness(capsys):
    assert main(["demo", "--tiny", "--prompt-len", "40", "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "identical output (forward loop): True; identical output (model.generate): True" in out
    assert "tokens per shard per layer" in out and "KV bytes: DynamicCache" in out


def test_tiny_demo_of_a_dense_arch_places_tokens_by_key_cluster(capsys):
    """The default router of the tiny demo, expert, needs experts: a dense arch gets key_cluster (it raised)."""
    assert main(["demo", "--tiny", "--arch", "llama", "--prompt-len", "24", "--new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "router=key_cluster" in out and "identical output (model.generate): True" in out


def test_demo_rejects_unknown_arch(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--tiny", "--arch", "gpt5"])
    assert exit_info.value.code == 2
    assert "pikv-hf demo: error: argument --arch: invalid choice: 'gpt5'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ratio", "1.0"], "ratio must be a number in [0, 1), got 1.0"),
        (["--ratio", "-0.1"], "ratio must be a number in [0, 1), got -0.1"),
        (["--ratio", "-inf"], "ratio must be a number in [0, 1), got -inf"),  # a value, not an unknown option
        (["--context", "100"], "context must be an integer >= 512, got 100"),
        (["--sample", "-1"], "sample must be an integer >= 0, got -1"),
        (["--tiny", "--new-tokens", "1"], "new_tokens must be an integer >= 2, got 1"),
        (["--tiny", "--prompt-len", "4090", "--new-tokens", "8"],
         "prompt_len + new_tokens must be at most 4096 (the tiny model's positions), got 4090 + 8"),
        (["--tiny", "--moe"], "--moe: an option of the real-model demo (SmolLM2 upcycled); --tiny takes --arch"),
        (["--tiny", "--arch", "llama", "--router", "expert"],
         "--router expert: the tiny llama model has no experts (key_cluster places tokens by key similarity)"),
        (["--tiny", "--seed", str(2**70)], f"seed must be an integer in [0, 2**63), got {2**70}"),
    ],
)
def test_demo_bad_values_are_one_error_line(capsys, args, message):
    assert main(["demo", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"pikv-hf demo: error: {message}\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mass-target", "2"], "mass_target must be None or a number in (0, 1], got 2.0"),
        (["--selector", "nosuch"],
         "selector must be one of topk, topk_balanced, cache_aware, eplb, adaptive, hierarchical; got 'nosuch'"),
    ],
)  # fmt: skip
def test_eval_read_options_are_checked_without_a_sparse_press(tmp_path, capsys, args, message):
    """The read options are refused when out of range even if no evaluated press reads them (they once ran the
    whole evaluation and were ignored)."""
    assert main(["eval", "--suite", "ruler", "--out", str(tmp_path / "run"), *args]) == 2
    assert capsys.readouterr().err == f"pikv-hf eval: error: {message}\n"
    assert not (tmp_path / "run").exists()


def test_cli_subprocess_prints_no_traceback(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "pikv_hf.cli", "eval", "--suite", "ruler", "--samples", "0", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr == "pikv-hf eval: error: samples must be >= 1, got 0\n"
    assert not any(tmp_path.iterdir())


def test_real_model_demo_answers_the_planted_fact_three_ways(capsys):
    # the offline SmolLM2: full, routed and Quest + 4-bit caches all give the planted number (exit status 0 says so)
    assert main(["demo", "--context", "1024"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.endswith("[ok]")]
    assert [row.split()[0] for row in rows] == ["full", "routed", "quest"]
    full, routed, quest = (float(row.split("MiB")[0].split()[-1]) for row in rows)
    assert routed >= full * 0.95 and quest < 0.4 * full  # routing stores everything; 4-bit pages hold much less


def test_eval_expert_router_on_a_dense_model_is_one_error_line(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["eval", "--suite", "ruler", "--cache", "pikv", "--router", "expert", "--model", "smollm2"]
    assert main([*args, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        "pikv-hf eval: error: router 'expert' places tokens by the model's MoE routing and model 'smollm2' has no "
        "experts: use --router key_cluster (placement by key similarity) or round_robin\n"
    )
    assert not out.exists()


def _tiny_eval(model_dir: str, out, *extra: str) -> list[str]:
    return ["eval", "--suite", "ruler", "--model", model_dir, "--tasks", "niah_single_number", "--samples", "1",
            "--length", "512", "--press", "none", "--out", str(out), *extra]  # fmt: skip


def test_eval_progress_bar_follows_tqdm_disable_and_a_failed_run_leaves_out_reusable(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from fixtures.tiny_assets import save_tiny_model_dir

    from pikv_hf.eval.config import EvalConfig
    from pikv_hf.eval.results import PREDICTIONS, RUN_CONFIG, prepare_out

    (tmp_path / "tiny").mkdir()
    model_dir = str(save_tiny_model_dir(tmp_path / "tiny"))
    out = tmp_path / "run"
    # a run of another configuration that stopped before its first answer (as one whose model failed to load)
    prepare_out(EvalConfig(suite="ruler", model=model_dir, presses=["none"], ratios=[0.5], out=str(out), seed=7))
    assert (out / RUN_CONFIG).is_file() and not (out / PREDICTIONS).exists()
    env = {**os.environ, "TQDM_DISABLE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pikv_hf.cli", *_tiny_eval(model_dir, out)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert "answer" not in proc.stderr and "it/s" not in proc.stderr  # no progress bar
    assert len((out / PREDICTIONS).read_text().splitlines()) == 1
    assert json.loads((out / RUN_CONFIG).read_text())["seed"] == 0
    # once it holds results, another configuration is refused
    assert main(_tiny_eval(model_dir, out, "--seed", "3")) == 2


def test_eval_sparse_from_help_states_what_eval_reads(capsys):
    from pikv_hf.cli import build_parser
    from pikv_hf.eval.config import EvalConfig

    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "until this many positions per row (default: 0, sparse from the first step)" in help_text
    args = build_parser().parse_args(["eval", "--suite", "ruler", "--cache", "pikv", "--out", "x"])
    config = EvalConfig(suite="ruler", model="smollm2", presses=["pikv_quest"], ratios=[0.5], out="x", cache="pikv")
    read = ReadConfig(**ReadConfig.from_arguments(args))
    for press in ("pikv_quest", "pikv_routed"):
        assert dataclasses.replace(config, read=read).point_read(press, 0.5, 8).sparse_threshold == 0


@pytest.mark.parametrize("option", [["--router", "expert"], ["--arch", "llama"], ["--new-tokens", "8"]])
def test_demo_tiny_options_without_tiny_are_refused(capsys, option):
    assert main(["demo", *option]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"pikv-hf demo: error: {option[0]}: option(s) of the tiny model only (add --tiny); the real-model demo places "
        "its routed way's tokens with key_cluster\n"
    )


@pytest.mark.parametrize(
    "option", [["--scheduler", "h2o"], ["--bits", "2"], ["--ratio", "0.9"], ["--sample", "7"], ["--context", "10"]]
)
def test_demo_real_model_options_with_tiny_are_refused(capsys, option):
    """The tiny demo reads none of them (they were accepted and ignored); their defaults are not given options."""
    assert main(["demo", "--tiny", *option]) == 2
    assert capsys.readouterr().err == (
        f"pikv-hf demo: error: {option[0]}: option(s) of the real-model demo only (drop --tiny); the tiny demo takes "
        "--arch, --router, --prompt-len, --new-tokens and --seed\n"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "pikv-hf: error: the following arguments are required: command"),
        (["demo", "--bits", "3"], "pikv-hf demo: error: argument --bits: invalid choice: "),
        (["demo", "--nosuch"], "pikv-hf demo: error: unrecognized arguments: --nosuch"),
        (["demo", "--tiny", "extra"], "pikv-hf demo: error: unrecognized arguments: extra"),
        (["eval", "--suite", "ruler", "--out", "x", "--num-shards", "abc"],
         "pikv-hf eval: error: argument --num-shards: invalid int value: 'abc'"),
        (["eval", "--suite", "ruler"], "pikv-hf eval: error: the following arguments are required: --out"),
        (["eval", "--suite", "ruler", "--out", "x", "--nosuch", "1"],
         "pikv-hf eval: error: unrecognized arguments: --nosuch 1"),
    ],
)  # fmt: skip
def test_argparse_errors_are_one_error_line_without_usage(capsys, args, message):
    """Errors argparse finds itself are one line naming the subcommand, like those of pikv_hf's checks (they printed
    the whole usage block first, and an unknown option of a subcommand was the top-level parser's)."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(message) and captured.err.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ratio", "-1e3"], "ratio must be in [0, 1), got -1000.0"),
        (["--cache", "pikv", "--press", "none", "pikv_quest", "--mass-target", "0.5"],
         "mass_target applies to routed reads only: it needs press pikv_routed or *_offload_routed, got "
         "['none', 'pikv_quest']"),
        (["--num-experts", "4"], "num_experts upcycle smollm2-moe: they need model 'smollm2-moe', got 'smollm2'"),
        (["--model", "smollm2", "--num-experts", "4", "--top-k", "1"],
         "num_experts, top_k upcycle smollm2-moe: they need model 'smollm2-moe', got 'smollm2'"),
        (["--perplexity-tokens", "100"],
         "perplexity_tokens is scored after perplexity_context tokens: it needs perplexity_context > 0 (0: no "
         "perplexity), got perplexity_tokens 100"),
        (["--longbench-dir", "."], "longbench_dir holds LongBench data: it needs suite 'longbench', got 'ruler'"),
    ],
)  # fmt: skip
def test_eval_options_the_run_would_ignore_are_refused(tmp_path, capsys, args, message):
    """Each of these options was accepted and then not read by the run; now refused before any model is loaded."""
    out = tmp_path / "run"
    assert main(["eval", "--suite", "ruler", "--out", str(out), *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"pikv-hf eval: error: {message}\n"
    assert not out.exists()


def test_demo_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for shown in ("document length in tokens (default: 3000)", "(default: quest)", "(default: 0.5)",
                  "tiny: placement router (default: expert; dense arch: key_cluster)",
                  "tiny: prompt tokens (default: 256)"):  # fmt: skip
        assert shown in help_text
    assert "default: None" not in help_text


def test_eval_length_a_task_cannot_be_built_at_is_one_error_line(tmp_path, capsys):
    """Found once the tokenizer counts the prompt (after the model loads), before any answer is written: a length
    beyond the essay corpus once ran with prompts that stopped growing, one too short gave a traceback; so did a
    compressor setting the model refuses and a perplexity context beyond the held-out text."""
    from fixtures.tiny_assets import save_tiny_model_dir

    (tmp_path / "tiny").mkdir()
    model_dir = str(save_tiny_model_dir(tmp_path / "tiny"))
    capsys.readouterr()  # the fixture's own progress output
    cases = (
        (["--length", "10000000"], "the essay corpus holds"),
        (["--length", "64"], "length=64 is too short"),
        # settings the loaded model refuses: they ran the points before them, then a traceback
        (["--press", "none", "fastv_crop@channels=1000"], "channels must be an integer in [1, head_dim = 16]"),
        (["--perplexity-context", "10000000"], "perplexity: the held-out text holds"),
    )
    for i, (extra, message) in enumerate(cases):
        out = tmp_path / f"run{i}"
        assert main(_tiny_eval(model_dir, out, *extra)) == 2
        err = capsys.readouterr().err
        assert err.startswith("pikv-hf eval: error: ") and message in err and err.count("\n") == 1
        assert not (out / "predictions.jsonl").exists()
