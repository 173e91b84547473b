"""Shared fixtures: the conformance directory beside the repository."""

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
