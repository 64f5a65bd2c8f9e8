#!/usr/bin/env bash
# `make wheelhouse`: everything `make gpu-check` installs on a machine without network, beside the
# image's own CUDA torch: manylinux wheels of scripts/gpu-wheelhouse.txt for the target Python
# (pydantic, WebDataset, Prefect and what its flows and API server import), a wheel of Sluice
# itself, and the Fashion-MNIST IDX files (sluice demo, the GPU tests and the time-to-accuracy arm
# train on them; most images lack the Debian package). The two image files are stored as xz
# (`<name>.xz`, xz -9e: 26.4 + 4.4 MB as .gz, 22.6 + 3.8 MB as xz; scripts/gpu_check.py expands
# them back to the .gz Sluice reads), the two label files as .gz. What is carried to the GPU
# machine is this wheelhouse and the checkout (its tracked and untracked-but-not-ignored files),
# at most MAX_MIB (64) MiB together: the size check counts both (cp312: 57.3 MiB of wheelhouse,
# Fashion-MNIST 25.2 of it, + 4.2 MiB of checkout = 61.5 MiB; with the images as .gz it was 65.8).
#
#   WHEEL_PY=3.12 scripts/build_wheelhouse.sh      # -> wheelhouse/cp312/
#   WHEEL_PY=3.11 scripts/build_wheelhouse.sh      # -> wheelhouse/cp311/ (this host's dry run)
#   scripts/build_wheelhouse.sh --check-size DIR   # the size check alone: DIR + the checkout
#   scripts/build_wheelhouse.sh --pack-fashion-mnist SRC DEST   # SRC's *-ubyte.gz -> DEST (images as xz)
#
# Environment: WHEEL_PY (default 3.12), WHEELHOUSE (default wheelhouse/cp<py>), MAX_MIB (64),
# PYTHON (the interpreter whose pip downloads; default .venv/bin/python, else python3),
# FASHION_MNIST (default $SLUICE_FASHION_MNIST or /usr/share/datasets/fashion-mnist; "none" skips it),
# CHECKOUT (the checkout carried beside the wheelhouse; default this one; "none": the wheelhouse
# alone), XZ (the xz command; default xz, where it is missing Python's lzma at the same preset).
set -euo pipefail
ARGS=()  # the command line's paths, made absolute before the cd
for a in "$@"; do [[ "$a" == -* || "$a" == /* ]] && ARGS+=("$a") || ARGS+=("$PWD/$a"); done
set -- ${ARGS[@]+"${ARGS[@]}"}
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

CHECKOUT="${CHECKOUT:-.}"
XZ="${XZ:-xz}"

# checkout_top: the top of the git checkout carried beside the wheelhouse (nothing: none)
checkout_top() {
    [[ "$CHECKOUT" != none ]] && git -C "$CHECKOUT" rev-parse --show-toplevel 2>/dev/null || true
}

# checkout_files TOP [--others]: "size<TAB>path" for each file of the checkout that travels with
# the wheelhouse: its tracked files (a tracked file deleted here does not travel), or with
# --others its untracked files that git does not ignore (they travel too)
checkout_files() {
    local which=(--cached)
    [[ "${2:-}" == --others ]] && which=(--others --exclude-standard)
    (cd "$1" && git ls-files -z "${which[@]}" | sort -zu \
        | xargs -0 -r stat --printf '%s\t%n\n' -- 2>/dev/null) || true
}

sum_sizes() { awk -F'\t' '{s += $1} END {printf "%d", s}' <<< "$1"; }

mib() { awk -v b="$1" 'BEGIN{printf "%.1f", b/1048576}'; }

# size_check DIR [NAME]: fail, naming the biggest files, when DIR (called NAME) and the checkout
# carried beside it hold more than MAX_MIB MiB together
size_check() {
    local bytes top co="" others co_bytes=0 others_bytes total limit what
    bytes=$(du -sb "$1" | cut -f1)
    top=$(checkout_top)
    if [[ -n "$top" ]]; then
        co=$(checkout_files "$top")
        others=$(checkout_files "$top" --others)
        others_bytes=$(sum_sizes "$others")
        co_bytes=$(( $(sum_sizes "$co") + others_bytes ))
        what="${2:-$1} ($(mib "$bytes") MiB) + the checkout $top ($(mib "$co_bytes") MiB, git ls-files"
        if [[ -n "$others" ]]; then
            what+=": $(mib "$others_bytes") MiB of it untracked, not ignored"
            co+=$'\n'"$others"
        fi
        what+=")"
    else
        what="${2:-$1} ($(mib "$bytes") MiB; no git checkout beside it)"
    fi
    total=$(( bytes + co_bytes ))
    limit=$(( MAX_MIB * 1024 * 1024 ))
    if (( total > limit )); then
        echo "build_wheelhouse: $what: $(mib "$total") MiB to carry, over the ${MAX_MIB} MiB budget; largest files:" >&2
        { find "$1" -type f -printf '%s\t%p\n'; [[ -z "$co" ]] || awk -F'\t' -v d="$top" '{print $1 "\t" d "/" $2}' <<< "$co"; } \
            | sort -rn | head -5 | awk -F'\t' '{printf "  %6.1f MiB  %s\n", $1/1048576, $2}' >&2
        return 1
    fi
    echo "build_wheelhouse: $what = $(mib "$total") MiB to carry (budget ${MAX_MIB} MiB)"
}

# pack_fashion_mnist SRC DEST: SRC's *-ubyte.gz into DEST, the image files recompressed as
# <name>.xz (xz -9e, the two at once; Python's lzma at preset 9|PRESET_EXTREME where xz is
# missing), the tiny label files as they are
pack_fashion_mnist() {
    local src="$1" dest="$2" f name pids=()
    mkdir -p "$dest"
    for f in "$src"/*-ubyte.gz; do
        [[ -e "$f" ]] || { echo "build_wheelhouse: no *-ubyte.gz in $src" >&2; return 1; }
        name=$(basename "$f" .gz)
        if [[ "$name" != *-images-* ]]; then
            cp "$f" "$dest/"
        elif command -v "$XZ" >/dev/null 2>&1; then
            { gzip -dc "$f" | "$XZ" -9e -T0 -c > "$dest/$name.xz"; } &
            pids+=($!)
        else
            "$PYTHON" -c 'import gzip, lzma, shutil, sys
with gzip.open(sys.argv[1]) as i, lzma.open(sys.argv[2], "wb", preset=9 | lzma.PRESET_EXTREME) as o:
    shutil.copyfileobj(i, o, 1 << 20)' "$f" "$dest/$name.xz" &
            pids+=($!)
        fi
    done
    for f in "${pids[@]}"; do wait "$f" || { echo "build_wheelhouse: could not recompress Fashion-MNIST as xz" >&2; return 1; }; done
}

if [[ "${1:-}" == "--check-size" ]]; then  # scripts/build_wheelhouse.sh --check-size DIR
    size_check "${2:?usage: build_wheelhouse.sh --check-size DIR}"; exit
fi
if [[ "${1:-}" == "--pack-fashion-mnist" ]]; then  # scripts/build_wheelhouse.sh --pack-fashion-mnist SRC DEST
    pack_fashion_mnist "${2:?usage: build_wheelhouse.sh --pack-fashion-mnist SRC DEST}" \
        "${3:?usage: build_wheelhouse.sh --pack-fashion-mnist SRC DEST}"; exit
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
    echo "build_wheelhouse: Fashion-MNIST from $FMNIST (the images recompressed as xz -9e: ~40 s)"
    pack_fashion_mnist "$FMNIST" "$OUT.tmp/data/fashion-mnist" || { rm -rf "$OUT.tmp"; exit 1; }
else
    echo "build_wheelhouse: no Fashion-MNIST at '$FMNIST': the GPU tests that train on it will skip"
fi
(cd "$OUT.tmp" && find . -type f ! -name SHA256SUMS -printf '%P\n' | sort | xargs sha256sum > SHA256SUMS)
size_check "$OUT.tmp" "$OUT" || { rm -rf "$OUT.tmp"; exit 1; }
rm -rf "$OUT"
mv "$OUT.tmp" "$OUT"
ls -1 "$OUT"/*.whl | sed 's|.*/|  |'
echo "build_wheelhouse: done; carry $OUT (or the whole wheelhouse/ folder) to the GPU machine, then: make gpu-check"
