"""`import hybrid_kv` never imports vLLM; `import hybrid_kv.vllm` does, and names the classes
`--scheduler-cls` takes."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (see .ci/run)")


def _modules_after(statement: str) -> set[str]:
    code = f"{statement}\nimport sys\nprint('\\n'.join(sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    return set(out.split())


def test_import_hybrid_kv_does_not_import_vllm() -> None:
    modules = _modules_after("import hybrid_kv")
    assert "hybrid_kv" in modules
    assert not any(m == "vllm" or m.startswith(("vllm.", "hybrid_kv.vllm")) for m in modules)


def test_import_hybrid_kv_vllm_imports_vllm_and_the_scheduler_classes() -> None:
    modules = _modules_after(
        "from hybrid_kv.vllm import Scheduler, AsyncScheduler\n"
        "from vllm.utils.import_utils import resolve_obj_by_qualname\n"
        "assert resolve_obj_by_qualname('hybrid_kv.vllm.Scheduler') is Scheduler"
    )
    assert "vllm.v1.core.sched.scheduler" in modules


def test_the_testing_harness_removes_its_config_directories_at_exit() -> None:
    # The offline model configs the harness writes live as long as the process that made them.
    code = (
        "from pathlib import Path\n"
        "from hybrid_kv.vllm import testing\n"
        "dirs = [testing.model_dir(), testing.mtp_model_dir(), testing.eagle_dir()]\n"
        "assert all((Path(d) / 'config.json').is_file() for d in dirs)\n"
        "print('\\n'.join(dirs))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    dirs = out.split()
    assert len(dirs) == 3
    assert not any(Path(d).exists() for d in dirs), dirs
