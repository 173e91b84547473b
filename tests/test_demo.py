"""`hybrid-kv demo`: the README's first command until the scheduler simulation exists."""

import subprocess
import sys

from hybrid_kv.cli import main
from hybrid_kv.demo import run_demo


def test_demo_hits_the_shared_prefix_and_evicts_in_lru_order() -> None:
    lines: list[str] = []
    counts = run_demo(echo=lines.append)
    assert counts == {"hit_blocks": 3, "evicted": 1, "cached": 3}
    assert any("prefix hit of 3 blocks [1, 2, 3]" in line for line in lines)


def test_demo_command_runs_and_rejects_a_too_small_pool(capsys) -> None:
    assert main(["demo"]) == 0
    assert "evicts 1 cached block" in capsys.readouterr().out
    for blocks in ("3", "-1", str(2**31), "99999999999999999999"):
        assert main(["demo", "--num-blocks", blocks]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert f"--num-blocks must be in 10..2147483647 for the demo, got {blocks}" in captured.err
    for size in ("0", "-5", str(2**20 + 1), "99999999999999999999"):
        assert main(["demo", "--block-size", size]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert f"--block-size must be in 1..1048576, got {size}" in captured.err


def test_module_entry_point_runs_the_demo() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hybrid_kv", "demo"], capture_output=True, text=True, check=True
    )
    assert "request B shares" in out.stdout
