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
    assert main(["demo", "--num-blocks", "3"]) == 2
    assert "at least 10" in capsys.readouterr().err
    for size in ("0", "-5"):
        assert main(["demo", "--block-size", size]) == 2
        assert f"--block-size must be at least 1, got {size}" in capsys.readouterr().err


def test_module_entry_point_runs_the_demo() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hybrid_kv", "demo"], capture_output=True, text=True, check=True
    )
    assert "request B shares" in out.stdout
