"""``pikv-hf demo --tiny`` end to end (its exit code asserts identical outputs and logits within 1e-4), and the
command line's answer to bad arguments: one ``pikv-hf CMD: error:`` line, exit status 2, nothing run."""

import pytest

from pikv_hf.cli import main


def test_tiny_demo_runs_and_reports_exactness(capsys):
    assert main(["demo", "--tiny", "--prompt-len", "40", "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "identical output (forward loop): True; identical output (model.generate): True" in out
    assert "tokens per shard per layer" in out and "KV bytes: DynamicCache" in out


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
        (["--context", "100"], "context must be an integer >= 512, got 100"),
        (["--sample", "-1"], "sample must be an integer >= 0, got -1"),
        (["--tiny", "--new-tokens", "1"], "new_tokens must be an integer >= 2, got 1"),
    ],
)
def test_demo_bad_values_are_one_error_line(capsys, args, message):
    assert main(["demo", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"pikv-hf demo: error: {message}\n"


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
