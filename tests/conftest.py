"""Shared fixtures: the conformance directory beside the repository."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFORMANCE = REPO.parent / "shared" / "conformance"
FIXTURES = [
    "gpt-oss.shared-prefix",
    "full-attn.eviction",
    "gemma3-27b.eviction",
    "gpt-oss.long-context",
    "jamba.eviction",
    "jamba.shared-prefix.default",
    "gpt-oss.eviction.default",
    "gemma3-27b.shared-prefix.default",
    "llama4.long-context.default",
]


@pytest.fixture(scope="session")
def conformance_dir() -> Path:
    if not (CONFORMANCE / "trace_diff.py").exists():
        pytest.fail(
            f"conformance fixtures not found at {CONFORMANCE} (shared/ must sit beside the repo)"
        )
    return CONFORMANCE
