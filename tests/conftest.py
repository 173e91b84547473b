"""Shared fixtures: the conformance directory beside the repository; a thread runner."""

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFORMANCE = REPO.parent / "shared" / "conformance"
# The fixtures of conformance/README.md; the Rust tests and the benches read the same file.
FIXTURES = (REPO / "tests" / "conformance_fixtures.txt").read_text().split()


@pytest.fixture(scope="session")
def conformance_dir() -> Path:
    if not (CONFORMANCE / "trace_diff.py").exists():
        pytest.fail(
            f"conformance fixtures not found at {CONFORMANCE} (shared/ must sit beside the repo)"
        )
    return CONFORMANCE


def run_threads(work: Callable[[int], None], count: int) -> None:
    """Runs `work(0)` ... `work(count - 1)` on as many threads at once; fails with the errors
    any of them raised."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            work(i)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [], errors
