"""Tests a built wheel as a user gets it: installed into a fresh virtual environment, with no Rust
toolchain on PATH and no source tree on sys.path (standard library only, any OS).

    python scripts/test_installed.py WHEEL [--platform TAG] [--test-deps borrow|install]
                                           [--no-conformance] [--keep]

1. The wheel: its size, and its tags (file name against its WHEEL file); with --platform, fails
   unless TAG is one of its platform tags (e.g. manylinux_2_17_x86_64).
2. `pip install WHEEL` into a fresh venv made by this interpreter: the wheel and its runtime
   dependencies, nothing else (timed). Then, run by the venv's interpreter from an empty
   directory, fails unless: hybrid_kv comes from the venv's site-packages and no source tree is on
   sys.path; cargo and rustc are not on PATH; every file of the source package is installed, with
   py.typed, _core.pyi, the presets and the native module; the distribution's version is
   hybrid_kv.__version__; every module imports with the runtime dependencies alone (buffers needs
   its torch extra, hybrid_kv.vllm its vllm extra: without them they fail on that import alone)
   and imports nothing outside the standard library and those dependencies;
   the `hybrid-kv` entry point is installed, `--version` prints that version, and `--help`,
   `plan` and `simulate` run.
3. The test tools (--test-deps): `borrow` (default) appends this interpreter's site-packages
   directories, where .ci/run installed the `test` extra, to the venv's sys.path with a .pth
   file (a directory added that way has its own .pth files ignored, so an editable hybrid_kv
   installed there stays off the path); `install` pip-installs the `test` extra's requirements
   but torch (whose tests then skip).
4. pytest on a copy of tests/ (and of the README, whose examples it runs) in a scratch
   directory (with ../shared beside it, as in CI; --no-conformance runs without it and leaves
   out tests/test_conformance.py), the cache plugin off, then mypy.stubtest of hybrid_kv._core:
   both against the installed wheel.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DIST = "hybrid-kv"
# Modules (and their submodules) whose import needs an optional extra: the extra's main module,
# then every top-level module the extra brings that they may import first.
NEEDS_EXTRA = {"hybrid_kv.buffers": ("torch",), "hybrid_kv.vllm": ("vllm", "torch")}
# Files the package cannot work or type-check without, whatever the source tree holds.
REQUIRED = ["__init__.py", "py.typed", "_core.pyi", "cli.py", "catalogue.py"]
RUST_TOOLS = ("cargo", "rustc", "rustup")


def fail(message: str) -> None:
    raise SystemExit(f"FAIL: {message}")


def say(message: str) -> None:
    print(f"--> {message}", flush=True)


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# --- 1. the wheel file ---------------------------------------------------------------------------


def check_wheel(path: Path, platform: str | None) -> None:
    parts = path.name.removesuffix(".whl").split("-")
    if not path.name.endswith(".whl") or len(parts) not in (5, 6):
        fail(f"{path.name} is not a wheel file name")
    python_tags, abi_tags, platform_tags = (part.split(".") for part in parts[-3:])
    with zipfile.ZipFile(path) as wheel:
        info = next(n for n in wheel.namelist() if n.endswith(".dist-info/WHEEL"))
        declared = [
            line.split(":", 1)[1].strip()
            for line in wheel.read(info).decode().splitlines()
            if line.startswith("Tag:")
        ]
    named = [f"{p}-{a}-{t}" for p in python_tags for a in abi_tags for t in platform_tags]
    if sorted(declared) != sorted(named):
        fail(f"the file name's tags {named} differ from those in {info}: {declared}")
    size = path.stat().st_size
    print(f"{path.name}: {size / 1024:.1f} KiB ({size:,} bytes)")
    print(f"tags: {', '.join(declared)}")
    if platform is not None and platform not in platform_tags:
        fail(f"platform tag {platform} expected, the wheel has {', '.join(platform_tags)}")
    version = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    if version not in python_tags:
        fail(f"the wheel is for {', '.join(python_tags)}, this interpreter is {version}")


# --- 2. inside the venv: the install with its runtime dependencies alone --------------------------


def top_level_modules() -> set[str]:
    return {name.partition(".")[0] for name in sys.modules}


def is_stdlib(name: str) -> bool:
    if name in sys.stdlib_module_names:
        return True
    origin = getattr(sys.modules.get(name), "__file__", None) or ""
    stdlib = [Path(sysconfig.get_path(key)).resolve() for key in ("stdlib", "platstdlib")]
    path = Path(origin).resolve()
    return (
        bool(origin)
        and "site-packages" not in path.parts
        and any(d in path.parents for d in stdlib)
    )


def module_owners() -> dict[str, set[str]]:
    """Top-level module name -> the distributions that install it (normalised names), read from
    each distribution's file list (Python 3.10's packages_distributions reads top_level.txt only,
    which the wheels of maturin and of numpy do not have)."""
    owners: dict[str, set[str]] = {}
    for dist in importlib.metadata.distributions():
        for file in dist.files or []:
            top = file.parts[0] if file.parts else ""
            if top in ("", "..") or top.endswith((".dist-info", ".data")):
                continue
            name = top.split(".")[0] if len(file.parts) == 1 else top
            owners.setdefault(name, set()).add(normalise(dist.metadata["Name"]))
    return owners


def requirement_closure(dist: str, seen: set[str]) -> set[str]:
    """The distribution and, recursively, its unconditional requirements (normalised names)."""
    if normalise(dist) in seen:
        return seen
    seen.add(normalise(dist))
    for requirement in importlib.metadata.requires(dist) or []:
        marker = requirement.partition(";")[2]
        name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
        if name is not None and "extra" not in marker:
            requirement_closure(name.group(0), seen)
    return seen


def check_install(source_files: Path) -> None:
    if sys.prefix == sys.base_prefix:
        fail("not running in a virtual environment")
    for tool in RUST_TOOLS:
        if shutil.which(tool):
            fail(f"{tool} is on PATH ({shutil.which(tool)}); the install must work without Rust")

    before = top_level_modules()
    import hybrid_kv
    import hybrid_kv._core

    site = {Path(sysconfig.get_path(key)).resolve() for key in ("purelib", "platlib")}
    package = Path(hybrid_kv.__file__).resolve().parent
    if package.parent not in site:
        fail(f"hybrid_kv was imported from {package}, not from site-packages {sorted(site)}")
    for entry in sys.path:
        path = Path(entry or ".").resolve()
        if path not in site and (path / "hybrid_kv" / "__init__.py").exists():
            fail(f"a hybrid_kv source tree is on sys.path: {path}")
    if Path(hybrid_kv._core.__file__).resolve().parent != package:
        fail(f"the native module {hybrid_kv._core.__file__} is not inside {package}")
    print(f"hybrid_kv {hybrid_kv.__version__} imported from {package}")

    expected = {line.strip() for line in source_files.read_text().splitlines() if line.strip()}
    missing = sorted(f for f in expected | set(REQUIRED) if not (package / f).is_file())
    if missing:
        fail(f"files of the package missing from the install: {', '.join(missing)}")
    presets = sorted(p.stem for p in (package / "presets").glob("*.json"))
    if not presets or sorted(hybrid_kv.list_presets()) != presets:
        fail(f"presets: list_presets() = {hybrid_kv.list_presets()}, files: {presets}")
    print(f"all {len(expected)} files of the source package installed, {len(presets)} presets")

    version = importlib.metadata.version(DIST)
    if version != hybrid_kv.__version__:
        fail(f"distribution version {version} != hybrid_kv.__version__ {hybrid_kv.__version__}")

    for module in pkgutil.walk_packages(hybrid_kv.__path__, "hybrid_kv."):
        extra = next(
            (m for p, m in NEEDS_EXTRA.items() if f"{module.name}.".startswith(f"{p}.")),
            None,
        )
        if extra is not None and importlib.util.find_spec(extra[0]) is None:
            try:
                importlib.import_module(module.name)
            except ModuleNotFoundError as error:
                if (error.name or "").partition(".")[0] not in extra:
                    raise
            else:
                fail(f"{module.name} imported without {extra[0]}")
            continue
        importlib.import_module(module.name)
    allowed = requirement_closure(DIST, set())
    owners = module_owners()
    foreign = sorted(
        name
        for name in top_level_modules() - before
        if not is_stdlib(name) and not owners.get(name, set()) & allowed
    )
    if foreign:
        fail(f"importing hybrid_kv's modules imported non-runtime packages: {', '.join(foreign)}")
    print(f"every module imports with the runtime dependencies alone: {', '.join(sorted(allowed))}")

    entry_points = importlib.metadata.distribution(DIST).entry_points
    scripts = {e.name: e.value for e in entry_points if e.group == "console_scripts"}
    if scripts.get("hybrid-kv") != "hybrid_kv.cli:main":
        fail(f"console script hybrid-kv -> hybrid_kv.cli:main expected, found {scripts}")
    command = shutil.which("hybrid-kv", path=sysconfig.get_path("scripts"))
    if command is None:
        fail(f"the hybrid-kv command is not installed in {sysconfig.get_path('scripts')}")
    version = subprocess.run([str(command), "--version"], capture_output=True, text=True)
    if f"hybrid-kv {hybrid_kv.__version__} " not in version.stdout:
        fail(f"hybrid-kv --version printed {version.stdout!r}{version.stderr!r}")
    print(f"hybrid-kv --version: {version.stdout.strip()}")
    for args in (
        ["--help"],
        ["plan", "gemma-3-27b", "--memory", "40GiB"],
        ["simulate", "--requests", "20", "--no-progress"],
    ):
        run = subprocess.run([str(command), *args], capture_output=True, text=True)
        if run.returncode != 0 or not run.stdout.strip():
            fail(f"hybrid-kv {' '.join(args)} exited {run.returncode}:\n{run.stdout}{run.stderr}")
        print(f"hybrid-kv {' '.join(args)}: ok, {len(run.stdout.splitlines())} lines")


# --- the driver ----------------------------------------------------------------------------------


def path_without_rust() -> str:
    kept = []
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        if entry and not any(shutil.which(tool, path=entry) for tool in RUST_TOOLS):
            kept.append(entry)
    return os.pathsep.join(kept)


def source_package_files() -> list[str]:
    package = REPO / "python" / "hybrid_kv"
    try:
        listed = subprocess.run(
            ["git", "-C", str(REPO), "ls-files", "--", "python/hybrid_kv"],
            capture_output=True,
            text=True,
        )
    except FileNotFoundError:  # no git: every file of the directory but native builds
        listed = None
    if listed is not None and listed.returncode == 0 and listed.stdout.strip():
        return [str(Path(line).relative_to("python/hybrid_kv")) for line in listed.stdout.split()]
    return [
        p.relative_to(package).as_posix()
        for p in package.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".so", ".pyd")
    ]


def run(args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
    subprocess.run(args, check=True, env=env, cwd=cwd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--platform", help="a platform tag the wheel must have")
    parser.add_argument("--test-deps", choices=["borrow", "install"], default="borrow")
    parser.add_argument("--no-conformance", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument("--check-install", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.check_install is not None:  # step 2, in the venv
        check_install(args.check_install)
        return

    wheel = args.wheel.resolve()
    say("the wheel")
    check_wheel(wheel, args.platform)

    scratch = Path(tempfile.mkdtemp(prefix="hybrid-kv-installed."))
    try:
        test(wheel, scratch, args)
    except subprocess.CalledProcessError as error:
        fail(f"{' '.join(map(str, error.cmd))} exited {error.returncode}")
    finally:
        if args.keep:
            print(f"scratch directory kept: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"installed-wheel tests passed: {wheel.name}")


def test(wheel: Path, scratch: Path, args: argparse.Namespace) -> None:
    venv = scratch / "venv"
    run([sys.executable, "-m", "venv", str(venv)])
    bin_dir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = str(bin_dir / "python")
    env = dict(os.environ, PATH=os.pathsep.join([str(bin_dir), path_without_rust()]))
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    pip = [python, "-m", "pip", "--disable-pip-version-check"]

    say(f"pip install {wheel.name} into a fresh venv, no Rust on PATH")
    start = time.perf_counter()
    run([*pip, "install", "--quiet", str(wheel)], env=env)
    took = time.perf_counter() - start
    frozen = subprocess.run([*pip, "list", "--format=freeze"], env=env, capture_output=True)
    installed = [p for p in frozen.stdout.decode().split() if not p.startswith("pip==")]
    print(f"installed in {took:.1f} s: {' '.join(installed)}")

    say("checks of the install, with its runtime dependencies alone")
    files = scratch / "source-files.txt"
    files.write_text("\n".join(source_package_files()) + "\n")
    cwd = scratch / "cwd"
    cwd.mkdir()
    me = str(Path(__file__).resolve())
    run([python, "-I", me, str(wheel), "--check-install", str(files)], env=env, cwd=cwd)

    say(f"test tools: {args.test_deps}")
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if args.test_deps == "borrow":
        borrowed = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
        (Path(site) / "zz-test-tools.pth").write_text("\n".join(borrowed) + "\n")
        print("borrowed:", " ".join(borrowed))
    else:
        reqs = subprocess.run(
            [
                python,
                "-c",
                "import importlib.metadata as m\n"
                "for r in m.requires('hybrid-kv') or []:\n"
                "    name, _, marker = r.partition(';')\n"
                "    if 'test' in marker and not name.strip().startswith('torch'):\n"
                "        print(name.strip())",
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
        reqs = [r for r in reqs if r]
        print("installing:", " ".join(reqs))
        run([*pip, "install", "--quiet", *reqs], env=env)

    say("pytest against the installed wheel, on a copy of tests/ alone")
    root = scratch / "hybrid-kv"
    shutil.copytree(REPO / "tests", root / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    # tests/test_readme_examples.py runs the README's examples against the installed package.
    shutil.copy2(REPO / "README.md", root / "README.md")
    ignore = []
    if args.no_conformance:
        ignore = ["--ignore=tests/test_conformance.py"]
    else:
        shared = REPO.parent / "shared"
        if not (shared / "conformance").is_dir():
            fail(f"no {shared}/conformance beside the repository (or pass --no-conformance)")
        (scratch / "shared").symlink_to(shared, target_is_directory=True)
    test_env = dict(env, HYBRID_KV_TEST_INSTALLED="1")
    pytest = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-ra", *ignore, "tests"]
    run(pytest, env=test_env, cwd=root)

    say("stubtest: _core.pyi against the installed extension")
    run([python, "-m", "mypy.stubtest", "hybrid_kv._core"], env=env, cwd=cwd)


if __name__ == "__main__":
    main()
