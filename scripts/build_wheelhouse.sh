#!/usr/bin/env bash
# `make wheelhouse`: everything `make gpu-check` installs on a machine without network, beside the
# image's own CUDA torch: manylinux wheels of scripts/gpu-wheelhouse.txt for the target Python
# (pydantic, WebDataset, Prefect and what its flows and API server import), a wheel of Sluice
# itself, and the Fashion-MNIST IDX files (sluice demo, the GPU tests and the time-to-accuracy arm
# train on them; most images lack the Debian package). At most MAX_MIB (64) MiB in all: what can
# be carried to the GPU machine (cp312: 61.4 MiB, Fashion-MNIST 29.4 of it).
#
#   WHEEL_PY=3.12 scripts/build_wheelhouse.sh      # -> wheelhouse/cp312/
#   WHEEL_PY=3.11 scripts/build_wheelhouse.sh      # -> wheelhouse/cp311/ (this host's dry run)
#
# Environment: WHEEL_PY (default 3.12), WHEELHOUSE (default wheelhouse/cp<py>), MAX_MIB (64),
# PYTHON (the interpreter whose pip downloads; default .venv/bin/python, else python3),
# FASHION_MNIST (default $SLUICE_FASHION_MNIST or /usr/share/datasets/fashion-mnist; "none" skips it).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEEL_PY="${WHEEL_PY:-3.12}"
if ! [[ "$WHEEL_PY" =~ ^3\.[0-9]+$ ]]; then
    echo "build_wheelhouse: WHEEL_PY must look like 3.12, got '$WHEEL_PY'" >&2; exit 2
fi
TAG="cp${WHEEL_PY/./}"
OUT="${WHEELHOUSE:-wheelhouse/$TAG}"
MAX_MIB="${MAX_MIB:-64}"
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
FMNIST="${FASHION_MNIST:-${SLUICE_FASHION_MNIST:-/usr/share/datasets/fashion-mnist}}"

# size_check DIR: fail, naming the biggest files, when DIR holds more than MAX_MIB MiB
size_check() {
    local bytes limit
    bytes=$(du -sb "$1" | cut -f1)
    limit=$(( MAX_MIB * 1024 * 1024 ))
    if (( bytes > limit )); then
        echo "build_wheelhouse: $1 is $(( bytes / 1024 / 1024 )) MiB, over the ${MAX_MIB} MiB budget; largest files:" >&2
        find "$1" -type f -printf '%s %p\n' | sort -rn | head -5 | awk '{printf "  %6.1f MiB  %s\n", $1/1048576, $2}' >&2
        return 1
    fi
    echo "build_wheelhouse: $1 holds $(awk -v b="$bytes" 'BEGIN{printf "%.1f", b/1048576}') MiB (budget ${MAX_MIB} MiB)"
}

if [[ "${1:-}" == "--check-size" ]]; then  # scripts/build_wheelhouse.sh --check-size DIR
    size_check "${2:?usage: build_wheelhouse.sh --check-size DIR}"; exit
fi

rm -rf "$OUT.tmp"
mkdir -p "$OUT.tmp/data"
echo "build_wheelhouse: manylinux wheels for Python $WHEEL_PY into $OUT"
grep -vE '^\s*(#|$)' scripts/gpu-wheelhouse.txt > "$OUT.tmp/requirements.txt"
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$WHEEL_PY" --implementation cp --abi "$TAG" --abi abi3 --abi none \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --platform any \
    -r "$OUT.tmp/requirements.txt" -d "$OUT.tmp"
# Sluice itself (pure Python, any interpreter >= 3.11); its dependencies come from the image and
# the wheels above (installed with --no-deps: torch is never pulled)
"$PYTHON" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation . -w "$OUT.tmp"
if [[ "$FMNIST" != none && -d "$FMNIST" ]]; then
    mkdir -p "$OUT.tmp/data/fashion-mnist"
    cp "$FMNIST"/*-ubyte.gz "$OUT.tmp/data/fashion-mnist/"
else
    echo "build_wheelhouse: no Fashion-MNIST at '$FMNIST': the GPU tests that train on it will skip"
fi
(cd "$OUT.tmp" && find . -type f ! -name SHA256SUMS -printf '%P\n' | sort | xargs sha256sum > SHA256SUMS)
size_check "$OUT.tmp" || { rm -rf "$OUT.tmp"; exit 1; }
rm -rf "$OUT"
mv "$OUT.tmp" "$OUT"
ls -1 "$OUT"/*.whl | sed 's|.*/|  |'
echo "build_wheelhouse: done; carry $OUT (or the whole wheelhouse/ folder) to the GPU machine, then: make gpu-check"
