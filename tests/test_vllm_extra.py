"""`import hybrid_kv.vllm` without vLLM 0.33: one error naming the `vllm` extra, before anything
of vLLM's internals is imported. Run in a child interpreter each, with vLLM hidden or replaced
by a stand-in of another release, so the tests need no vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HIDE_VLLM = """
import sys
class _NoVllm:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoVllm())
"""

IMPORT = """
try:
    import hybrid_kv.vllm
except ImportError as error:
    print(type(error).__name__, error.name, error, sep="|")
else:
    print("imported")
"""


def _child(code: str, extra_path: Path | None = None) -> str:
    env = os.environ.copy()
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(extra_path), env.get("PYTHONPATH")) if p
        )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    return result.stdout.strip()


def test_import_without_vllm_names_the_extra() -> None:
    assert _child(HIDE_VLLM + IMPORT) == (
        "ModuleNotFoundError|vllm|hybrid_kv.vllm needs vLLM 0.33: "
        "pip install 'hybrid-kv[vllm]' (vllm>=0.33,<0.34)"
    )


@pytest.mark.parametrize("version", ["0.32.1", "0.34.0", "0.3.3", "0.330.0"])
def test_import_under_another_vllm_release_names_both_releases(
    version: str, tmp_path: Path
) -> None:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    assert _child(IMPORT, tmp_path) == (
        f"ImportError|vllm|hybrid_kv.vllm follows vLLM 0.33, but vLLM {version} is installed: "
        "pip install 'hybrid-kv[vllm]' (vllm>=0.33,<0.34)"
    )


def test_a_033_release_gets_past_the_version_check(tmp_path: Path) -> None:
    # The stand-in has no scheduler: the import fails after the check, on vLLM's internals.
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("__version__ = '0.33.1rc1'\n")
    kind, name, _ = _child(IMPORT, tmp_path).split("|", 2)
    assert (kind, name) == ("ModuleNotFoundError", "vllm.logger")
