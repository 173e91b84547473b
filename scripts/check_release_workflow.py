"""Checks that .github/workflows/release.yml stays in step with the local build and pyproject.toml.

    python scripts/check_release_workflow.py [WORKFLOW]

Run by .ci/run with the tools environment's interpreter (scripts/tools.sh), whose ruamel.yaml
(a check-jsonschema dependency) reads the workflow; the schema itself is checked separately with
`check-jsonschema --builtin-schema vendor.github-workflows`. Fails unless:
- every job's CPython matrix is exactly the versions of pyproject.toml's classifiers;
- the Linux wheels (manylinux and musllinux, x86_64 and aarch64) and the sdist are built by
  scripts/build-wheels.sh, and maturin-action (macOS, Windows) runs the maturin version pinned in
  scripts/requirements-tools.txt with `--release` and no feature or profile of its own;
- every job that builds a wheel tests it with scripts/test_installed.py;
- publishing runs only on a tag, after every build job, with an OIDC token (trusted publishing)
  and no stored password.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML

REPO = Path(__file__).resolve().parents[1]
BUILD = "scripts/build-wheels.sh"
TEST = "scripts/test_installed.py"
LINUX_TARGETS = {
    f"{arch}-unknown-linux-{libc}" for arch in ("x86_64", "aarch64") for libc in ("gnu", "musl")
}
OTHER_TARGETS = {"x86_64-apple-darwin", "aarch64-apple-darwin", "x86_64-pc-windows-msvc"}


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / ".github/workflows/release.yml"
    workflow = YAML(typ="safe").load(path.read_text())
    problems = check(workflow)
    for problem in problems:
        print(f"{path.name}: {problem}")
    if problems:
        sys.exit(1)
    print(f"{path.name} is in step with {BUILD}, pyproject.toml and the pinned maturin")


def steps_text(job: dict[str, Any]) -> str:
    return "\n".join(str(step.get("run", "")) for step in job.get("steps", []))


def check(workflow: dict[str, Any]) -> list[str]:
    problems = []
    pyproject = (REPO / "pyproject.toml").read_text()
    supported = re.findall(r'"Programming Language :: Python :: (3\.\d+)"', pyproject)
    pins = (REPO / "scripts/requirements-tools.txt").read_text()
    maturin = re.search(r"^maturin==(\S+)", pins, re.MULTILINE)
    assert maturin is not None, "maturin is not pinned in scripts/requirements-tools.txt"
    jobs: dict[str, Any] = workflow["jobs"]

    targets: set[str] = set()
    for name, job in jobs.items():
        matrix = job.get("strategy", {}).get("matrix", {})
        if "python" in matrix and [str(v) for v in matrix["python"]] != supported:
            problems.append(f"job {name} builds for CPython {matrix['python']}, not {supported}")
        platforms = matrix.get("platform", [])
        job_targets = {p["target"] for p in platforms if "target" in p}
        for step in job.get("steps", []):
            with_ = step.get("with", {})
            if str(step.get("uses", "")).startswith("PyO3/maturin-action@"):
                if with_.get("maturin-version") != f"v{maturin.group(1)}":
                    problems.append(
                        f"job {name}: maturin-action runs maturin {with_.get('maturin-version')},"
                        f" the pinned one is v{maturin.group(1)}"
                    )
                args = str(with_.get("args", "")).split()
                if "--release" not in args or {"--features", "-F", "--profile"} & set(args):
                    problems.append(f"job {name}: maturin arguments {args}")
                if "${{" not in str(with_.get("target", "${{")):
                    job_targets.add(str(with_["target"]))
        runs = steps_text(job)
        if job_targets & LINUX_TARGETS and BUILD not in runs:
            problems.append(f"job {name} builds Linux wheels without {BUILD}")
        if job_targets and TEST not in runs:
            problems.append(f"job {name} builds wheels but does not test them with {TEST}")
        if f"{BUILD} --sdist-only" in " ".join(runs.split()):
            targets.add("sdist")
        targets |= job_targets
    expected = LINUX_TARGETS | OTHER_TARGETS | {"sdist"}
    if targets != expected:
        problems.append(f"artifacts built: {sorted(targets)}, expected {sorted(expected)}")

    publishers = [
        (name, job)
        for name, job in jobs.items()
        if any("gh-action-pypi-publish" in str(s.get("uses", "")) for s in job.get("steps", []))
    ]
    if len(publishers) != 1:
        problems.append(f"{len(publishers)} publishing jobs, expected one")
    for name, job in publishers:
        if "refs/tags/" not in str(job.get("if", "")):
            problems.append(f"job {name} publishes without being limited to tags")
        if set(job.get("needs", [])) != set(jobs) - {name}:
            problems.append(f"job {name} needs {job.get('needs')}, not every other job")
        if job.get("permissions", {}).get("id-token") != "write":
            problems.append(f"job {name} lacks the id-token: write permission")
        if "password" in str(job.get("steps")):
            problems.append(f"job {name} passes a password: trusted publishing needs none")
    return problems


if __name__ == "__main__":
    main()
