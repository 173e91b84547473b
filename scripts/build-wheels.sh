#!/usr/bin/env bash
# Builds hybrid-kv's Linux release artifacts, linked with zig so one host makes them all:
#   - a wheel for every supported CPython found here (pyproject.toml's "Programming Language ::
#     Python :: 3.X" classifiers) and every target: manylinux2014 (manylinux_2_17) for
#     *-linux-gnu, musllinux_1_2 for *-linux-musl. Default targets: this host's *-linux-gnu, and
#     the other of x86_64 / aarch64 if its Rust standard library is installed
#     (`rustup target add aarch64-unknown-linux-gnu`);
#   - the sdist, checked to build: a wheel built from the unpacked sdist must hold the same files
#     as the one built from the tree.
# Then prints every artifact and its size. maturin and zig come pinned from
# scripts/requirements-tools.txt (scripts/tools.sh). The release workflow builds its Linux wheels
# and the sdist with this script (scripts/check_release_workflow.py checks).
#
# Usage: scripts/build-wheels.sh [--out DIR] [--python PYTHON]... [--target TRIPLE]...
#                                [--no-sdist | --sdist-only]
#   --out DIR         where the artifacts go (default dist/); older hybrid_kv-* files there go first
#   --python PYTHON   build for this interpreter only (repeatable); default: every supported one
#   --target TRIPLE   build for this Rust target only (repeatable), e.g. x86_64-unknown-linux-musl
#   --no-sdist        wheels only;  --sdist-only  the sdist and its check only
# Compiles in target/zig (or $CARGO_TARGET_DIR), apart from `pip install -e .`'s target/release,
# so the two kinds of build do not undo each other's work.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"

OUT=dist
PYTHONS=()
TARGETS=()
WHEELS=1
SDIST=1
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT="$2"; shift 2 ;;
        --python) PYTHONS+=("$2"); shift 2 ;;
        --target) TARGETS+=("$2"); shift 2 ;;
        --no-sdist) SDIST=0; shift ;;
        --sdist-only) WHEELS=0; shift ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done

# maturin's arguments for a target: the same for every wheel but the libc's compatibility policy.
maturin_args() {
    case "$1" in
        *-linux-gnu) echo "--release --zig --compatibility manylinux2014 --target $1" ;;
        *-linux-musl) echo "--release --zig --compatibility musllinux_1_2 --target $1" ;;
        *) echo "unsupported target $1 (Linux, gnu or musl)" >&2; return 1 ;;
    esac
}

say() { printf '\n--> %s\n' "$*"; }
elapsed() { echo "$(($(date +%s) - $1)) s"; }

# Supported CPython versions, from the classifiers.
mapfile -t SUPPORTED < <(grep -oE '"Programming Language :: Python :: 3\.[0-9]+"' pyproject.toml |
    grep -oE '3\.[0-9]+')
[ ${#SUPPORTED[@]} -gt 0 ] || { echo "no Python version classifiers in pyproject.toml" >&2; exit 1; }

# An interpreter of version $1 (with the GIL, not free-threaded), or nothing.
find_python() {
    local v="$1" candidate
    for candidate in "$(command -v "python$v" 2>/dev/null || true)" \
        "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$v".*/bin/"python$v"; do
        if [ -z "$candidate" ] || [ ! -x "$candidate" ]; then continue; fi
        if "$candidate" -c "import sys, sysconfig
sys.exit(not (sys.version.startswith('$v.') and not sysconfig.get_config_var('Py_GIL_DISABLED')))" \
            2>/dev/null; then
            echo "$candidate"
            return
        fi
    done
}

if [ ${#PYTHONS[@]} -eq 0 ]; then
    for v in "${SUPPORTED[@]}"; do
        p="$(find_python "$v")"
        if [ -n "$p" ]; then PYTHONS+=("$p"); else echo "CPython $v: not found here, no wheel" >&2; fi
    done
fi
[ ${#PYTHONS[@]} -gt 0 ] || { echo "no supported CPython (${SUPPORTED[*]}) found" >&2; exit 1; }
VERSIONS=()
for i in "${!PYTHONS[@]}"; do
    # The interpreter itself, not a name that PATH (which scripts/tools.sh changes) resolves.
    PYTHONS[i]="$("${PYTHONS[$i]}" -c 'import sys; print(sys.executable)')"
    p="${PYTHONS[$i]}"
    v="$("$p" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
    printf '%s\n' "${SUPPORTED[@]}" | grep -qx "$v" ||
        { echo "$p is CPython $v, not a supported version (${SUPPORTED[*]})" >&2; exit 1; }
    VERSIONS+=("$v")
done

HOST="$(rustc -vV | sed -n 's/^host: //p')"
installed() { [ -d "$(rustc --print target-libdir --target "$1" 2>/dev/null)" ]; }
if [ ${#TARGETS[@]} -eq 0 ]; then
    TARGETS=("$HOST")
    for t in x86_64-unknown-linux-gnu aarch64-unknown-linux-gnu; do
        [ "$t" = "$HOST" ] && continue
        if installed "$t"; then
            TARGETS+=("$t")
        else
            echo "$t: skipped, its Rust standard library is not installed" \
                "(rustup target add $t)" >&2
        fi
    done
fi

# shellcheck source=scripts/tools.sh
source scripts/tools.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$REPO/target/zig}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
rm -f "$OUT"/hybrid_kv-*.whl "$OUT"/hybrid_kv-*.tar.gz

# maturin -i arguments for target $1: the interpreters themselves for the host; for another target
# their versions, whose build configuration maturin keeps in its own tables.
interpreters() {
    local i
    for i in "${!PYTHONS[@]}"; do
        if [ "$1" = "$HOST" ]; then echo "-i ${PYTHONS[$i]}"; else echo "-i python${VERSIONS[$i]}"; fi
    done
}

if [ "$WHEELS" = 1 ]; then
    for target in "${TARGETS[@]}"; do
        read -r -a args <<<"$(maturin_args "$target")"
        mapfile -t iargs < <(interpreters "$target" | tr ' ' '\n')
        say "$target wheels for CPython ${VERSIONS[*]}: maturin build ${args[*]}"
        start=$(date +%s)
        maturin build "${args[@]}" "${iargs[@]}" --out "$OUT"
        echo "$target wheels built in $(elapsed "$start")"
    done
fi

if [ "$SDIST" = 1 ]; then
    say "sdist, and a wheel built from it for CPython ${VERSIONS[0]}"
    start=$(date +%s)
    maturin sdist --out "$OUT"
    sdist=("$OUT"/hybrid_kv-*.tar.gz)
    scratch="$(mktemp -d)"
    trap 'rm -rf "$scratch"' EXIT
    tar -xzf "${sdist[0]}" -C "$scratch"
    # Newer than every build artifact, so cargo compiles the sdist's own sources (the registry
    # crates, pinned by its Cargo.lock, come from the cache).
    find "$scratch" -type f -exec touch {} +
    read -r -a args <<<"$(maturin_args "$HOST")"
    (cd "$scratch"/hybrid_kv-*/ &&
        maturin build "${args[@]}" -i "${PYTHONS[0]}" --out "$scratch/from-sdist")
    (cd "$REPO" && maturin build "${args[@]}" -i "${PYTHONS[0]}" --out "$scratch/from-tree")
    python3 - "$scratch"/from-tree/*.whl "$scratch"/from-sdist/*.whl <<'EOF'
import sys
import zipfile

tree, sdist = (set(zipfile.ZipFile(path).namelist()) for path in sys.argv[1:])
if tree != sdist:
    print("the wheel built from the sdist differs from the one built from the tree:")
    for name in sorted(tree - sdist):
        print("  only from the tree:", name)
    for name in sorted(sdist - tree):
        print("  only from the sdist:", name)
    sys.exit(1)
print(f"the sdist builds: its wheel holds the same {len(tree)} files as the tree's")
EOF
    echo "sdist built and checked in $(elapsed "$start")"
fi

say "artifacts in $OUT"
for f in "$OUT"/hybrid_kv-*; do
    awk -v size="$(stat -c %s "$f")" -v name="$f" 'BEGIN { printf "%8.1f KiB  %s\n", size / 1024, name }'
done
