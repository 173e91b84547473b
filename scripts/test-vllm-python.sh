#!/usr/bin/env bash
# Runs the vLLM plugin's tests under one CPython: a virtualenv of its own (torch, numpy and
# pydantic as PyPI serves them for it, vLLM 0.33 without its dependency tree plus
# .ci/vllm-requirements.txt, as .ci/vllm installs them, and pyproject.toml's test extra), the
# release wheel built for that interpreter (scripts/build-wheels.sh) installed into it, then the
# plugin's tests and those of its direct entries, from this tree against the installed wheel.
# Not part of .ci/run: CI has one Python, and torch is a large download.
#
# Usage: scripts/test-vllm-python.sh PYTHON [PYTEST ARGUMENTS...]
#   e.g.   scripts/test-vllm-python.sh ~/.pyenv/versions/3.12.1/bin/python3.12
# The virtualenv is target/vllm-venv-X.Y (made once, then reused), the wheel target/wheel-X.Y.
# Extra arguments go to pytest, e.g. `-x tests/vllm_plugin/test_vllm_random.py` with
# HYBRID_KV_RANDOM_CASES and HYBRID_KV_RANDOM_SEED set for a longer differential run.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 PYTHON [PYTEST ARGUMENTS...]" >&2; exit 2; }
python="$1"
shift
version="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
venv="target/vllm-venv-$version"
wheels="target/wheel-$version"

if [ ! -e "$venv/.complete" ]; then
    rm -rf "$venv"
    "$python" -m venv "$venv"
    pip=("$venv/bin/python" -m pip install --quiet --no-warn-conflicts)
    "${pip[@]}" torch numpy pydantic
    "${pip[@]}" --no-deps vllm==0.33.0
    "${pip[@]}" -r .ci/vllm-requirements.txt
    # What vLLM imports besides those and .ci/vllm takes from the system site packages.
    "${pip[@]}" requests cloudpickle
    "$venv/bin/python" -c 'import tomllib' 2>/dev/null || "${pip[@]}" tomli
    "$venv/bin/python" -c 'try:
    import tomllib
except ImportError:
    import tomli as tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["test"]))' \
        > "$venv/test-requirements.txt"
    "${pip[@]}" -r "$venv/test-requirements.txt"
    touch "$venv/.complete"
fi

scripts/build-wheels.sh --python "$python" --target "$(uname -m)-unknown-linux-gnu" --no-sdist \
    --out "$wheels"
"$venv/bin/python" -m pip install --quiet --no-warn-conflicts --force-reinstall --no-deps \
    "$wheels"/hybrid_kv-*.whl
# The tests import the installed wheel, not python/ of this tree.
"$venv/bin/python" -c 'import hybrid_kv
assert "site-packages" in hybrid_kv.__file__, hybrid_kv.__file__'
if [ $# -eq 0 ]; then
    set -- tests/vllm_plugin tests/test_entry_arguments.py tests/test_entry_slot_cache.py \
        tests/test_entry_cycles.py tests/test_running_steps.py tests/test_call_timer.py
fi
VLLM_TARGET_DEVICE=cpu HYBRID_KV_REQUIRE_VLLM=1 \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
