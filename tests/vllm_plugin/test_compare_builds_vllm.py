"""`benches/compare_builds_vllm.py`: two builds inside vLLM's scheduler, alternating turns; it
reports per-step ratios and refuses a run in which the two builds scheduled differently."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (see .ci/run)")

from bench_loader import load_bench  # noqa: E402
from hybrid_kv import _core  # noqa: E402

LIBRARY = _core.__file__
ARGS = ["--layout", "gemma3", "--size", "4", "--steps", "20", "--turn", "5"]


bench = load_bench("compare_builds_vllm.py")


def test_one_library_against_itself_reports_every_measure(capsys) -> None:
    assert bench.main([LIBRARY, LIBRARY, *ARGS]) == 0
    out = capsys.readouterr().out
    assert "gemma3, 4 running:" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    for measure in ("step", "manager", "allocate_slots"):
        cells = [c.strip() for c in rows[measure].strip("|").split("|")]
        q1, median, q3 = (float(x) for x in cells[3].split(" / "))
        assert 0 < q1 <= median <= q3
        faster, kept = (int(x) for x in cells[4].split("/"))
        assert 0 <= faster <= kept and kept > 0


def test_builds_that_schedule_differently_are_refused(monkeypatch) -> None:
    step = bench.Side.step

    def diverging(self: Any, size: int) -> bool:
        more = step(self, size)
        if self.name == "hkv_new" and self.decisions:
            self.decisions[-1] = {**self.decisions[-1], "phantom": 1}
        return more

    monkeypatch.setattr(bench.Side, "step", diverging)
    with pytest.raises(RuntimeError, match="scheduled different requests or tokens"):
        bench.main([LIBRARY, LIBRARY, *ARGS])


def test_a_missing_library_is_named(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        bench.main([str(tmp_path / "nope.so"), LIBRARY, *ARGS])
    assert "no such library" in capsys.readouterr().err
