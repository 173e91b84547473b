"""A benchmark script of `benches/` loaded as a module, for the tests of its parts."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHES = Path(__file__).resolve().parents[2] / "benches"


def load_bench(filename: str) -> ModuleType:
    """`benches/<filename>` as a module (named after it, with a `_bench` suffix)."""
    path = BENCHES / filename
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing")
    spec = importlib.util.spec_from_file_location(f"{path.stem}_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
