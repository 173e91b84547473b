"""What the package ships beside its code: typing files, presets, version, entry point.

These hold for an editable install and for an installed wheel alike. With
HYBRID_KV_TEST_INSTALLED=1 (scripts/test_installed.py sets it), the suite also asserts that it is
testing the installed wheel, not a source tree.
"""

import importlib.metadata
import os
import sys
import sysconfig
from pathlib import Path

import hybrid_kv
import hybrid_kv._core
import pytest
from hybrid_kv import cli

PACKAGE = Path(hybrid_kv.__file__).resolve().parent


def test_package_ships_py_typed_and_the_native_module_stubs() -> None:
    assert (PACKAGE / "py.typed").is_file()
    stubs = (PACKAGE / "_core.pyi").read_text()
    assert "class KVCacheManager" in stubs
    assert Path(hybrid_kv._core.__file__).resolve().parent == PACKAGE


def test_every_listed_preset_is_a_shipped_json_file_that_loads() -> None:
    shipped = sorted(p.stem for p in (PACKAGE / "presets").glob("*.json"))
    assert shipped == sorted(hybrid_kv.list_presets())
    for name in shipped:
        assert hybrid_kv.load_model(name).layers


def test_version_is_the_distribution_version_from_cargo_toml() -> None:
    assert hybrid_kv.__version__ == hybrid_kv._core.__version__
    assert importlib.metadata.version("hybrid-kv") == hybrid_kv.__version__


def test_console_script_entry_point_is_the_cli_main() -> None:
    points = importlib.metadata.distribution("hybrid-kv").entry_points
    (script,) = [e for e in points if e.group == "console_scripts" and e.name == "hybrid-kv"]
    assert script.load() is cli.main


@pytest.mark.skipif(
    os.environ.get("HYBRID_KV_TEST_INSTALLED") != "1", reason="only against an installed wheel"
)
def test_suite_runs_against_the_installed_wheel_not_a_source_tree() -> None:
    site = {Path(sysconfig.get_path(key)).resolve() for key in ("purelib", "platlib")}
    assert PACKAGE.parent in site
    assert Path(sys.prefix).resolve() in PACKAGE.parents
    entries = [Path(entry or ".").resolve() for entry in sys.path]
    first_site = min(i for i, path in enumerate(entries) if path in site)
    # Nothing before the venv's site-packages holds a hybrid_kv that would shadow the wheel.
    # After it come the test tools' directories borrowed from the interpreter that ran
    # scripts/test_installed.py, which may hold another install (the README's `pip install .`).
    for path in entries[:first_site]:
        assert not (path / "hybrid_kv" / "__init__.py").exists(), path
