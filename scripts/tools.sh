# shellcheck shell=bash
# Sourced by scripts/build-wheels.sh and .ci/run: puts the pinned build and lint tools
# (scripts/requirements-tools.txt: maturin, zig, check-jsonschema) on PATH. They live in their own
# virtual environment, target/wheel-tools (or $HYBRID_KV_TOOLS_VENV), made with python3 the first
# time and remade when the requirements file changes.

hkv_tools() {
    local repo venv stamp bin zigdir
    repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    venv="${HYBRID_KV_TOOLS_VENV:-$repo/target/wheel-tools}"
    stamp="$venv/requirements-tools.txt"
    if ! cmp -s "$repo/scripts/requirements-tools.txt" "$stamp"; then
        echo "installing the build tools into $venv (scripts/requirements-tools.txt)" >&2
        rm -rf "$venv"
        python3 -m venv "$venv"
        bin="$venv/bin"
        [ -d "$venv/Scripts" ] && bin="$venv/Scripts"
        "$bin/python" -m pip install --quiet -r "$repo/scripts/requirements-tools.txt"
        cp "$repo/scripts/requirements-tools.txt" "$stamp"
    fi
    bin="$venv/bin"
    [ -d "$venv/Scripts" ] && bin="$venv/Scripts"
    # maturin finds zig on PATH; the ziglang package keeps its binary beside its __init__.py.
    zigdir="$("$bin/python" -c 'import os, ziglang; print(os.path.dirname(ziglang.__file__))')"
    export PATH="$bin:$zigdir:$PATH"
}

hkv_tools
