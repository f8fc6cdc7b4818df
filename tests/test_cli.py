"""``pikv-hf demo`` end to end: its exit code asserts identical outputs and logits within 1e-4."""

import pytest

from pikv_hf.cli import main


def test_demo_runs_and_reports_exactness(capsys):
    assert main(["demo", "--prompt-len", "40", "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "identical output (forward loop): True; identical output (model.generate): True" in out
    assert "tokens per shard per layer" in out and "KV bytes: DynamicCache" in out


def test_demo_rejects_unknown_arch(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--arch", "gpt5"])
    assert "invalid choice: 'gpt5'" in capsys.readouterr().err
