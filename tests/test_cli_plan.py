"""`hybrid-kv plan`: table, JSON, plot, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hybrid_kv.cli import main


def test_plan_prints_our_plan_beside_vllms(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "gemma-3-27b", "--memory", "40GiB", "--reference-len", "1024"])
    out = capsys.readouterr().out
    assert code == 0
    assert "min-waste (chosen)" in out and "vllm 0.33" in out
    waste_row = next(line for line in out.splitlines() if line.startswith("waste"))
    assert "4.62%" in waste_row and "11.43%" in waste_row
    for label in ("groups", "block sizes", "page size", "num_blocks", "max concurrency"):
        assert any(line.startswith(label) for line in out.splitlines()), label


def test_plan_json_holds_both_plans(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "bamba-9b", "--memory", "16GiB", "--max-model-len", "8192", "--json"])
    document = json.loads(capsys.readouterr().out)
    assert code == 0
    assert document["plan"]["strategy"] == "min-waste"
    assert document["vllm"]["strategy"] == "vllm"
    assert {g["block_size"] for g in document["vllm"]["groups"]} == {528}
    assert document["plan"]["max_model_len"] == 8192


def test_plan_with_vllm_strategy_prints_one_column(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "gpt-oss-20b", "--memory", "8GiB", "--strategy", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "vllm (chosen)" in out and "vllm 0.33" not in out


def test_plan_draws_the_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "layout.png"
    assert main(["plan", "jamba-mini-1.5", "--memory", "40GiB", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(path) in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "nope-7b", "--memory", "40GiB"], "unknown model 'nope-7b'"),
        (["plan", "gemma-3-27b", "--memory", "forty"], "bad memory size 'forty'"),
        (["plan", "llama-3.1-8b", "--memory", "1GiB"], "needs"),
        (["plan", "llama-3.1-8b", "--memory", "1GiB", "--block-size", "24"], "multiple"),
        (["plan", "llama-3.1-8b", "--memory", "1GiB", "--dtype", "int2"], "unknown dtype"),
    ],
)
def test_errors_are_one_line_with_exit_code_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("hybrid-kv plan: error:")


def test_config_missing_fields_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 128}))
    assert main(["plan", str(path), "--memory", "1GiB"]) == 2
    assert "missing 'num_hidden_layers'" in capsys.readouterr().err


def test_python_dash_m_runs_the_cli() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hybrid_kv", "plan", "gemma-2-9b", "--memory", "20GiB", "--json"],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["plan"]["groups"][0]["kind"] == "sliding_window"
