#!/usr/bin/env bash
# One idempotent setup: system packages, a virtualenv in .venv, torch first, then Sluice.
# Re-running is cheap: every step checks before it acts.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
# iproute2: ip/tc for the simulated cluster; chromium + chromium-driver: the test that reads the
# nightly report in a real browser; dict-gcide, fortunes(-min), python3.11-doc: the text corpus of the token
# artifact demo (stages/data/text/debian.py)
APT_PACKAGES="pkg-config libturbojpeg0-dev libopencv-dev dataset-fashion-mnist iproute2 chromium chromium-driver dict-gcide fortunes fortunes-min python3.11-doc"
STAMP="$VENV/.sluice-setup-stamp"

log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
# pip, minus this machine's notes about unused local index folders
pipq() { "$PY" -m pip "$@" 2>&1 | { grep -vE "WARNING: Location '.*' is ignored" || true; }; return "${PIPESTATUS[0]}"; }

need_apt=""
for p in $APT_PACKAGES; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need_apt="$need_apt $p"
done
if [ -n "$need_apt" ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  log "installing system packages:$need_apt"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $need_apt >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtualenv $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
if [ ! -f "$VENV/.sluice-pip-upgraded" ]; then
  pipq install -q --upgrade pip setuptools wheel && touch "$VENV/.sluice-pip-upgraded"
fi

# The MLflow server the tracking tests start (tests/mlflow_server.py): full MLflow in a virtualenv
# of its own, as a team runs its server beside its training code. In this project's env it could
# not install as pinned: it needs pyarrow<26, importlib_metadata<10 and graphql-core<3.3, and
# pulls pandas and ~20 more; the project installs only the client (mlflow-skinny, `.[mlflow]`).
MLFLOW_VENV="${MLFLOW_VENV:-.venv-mlflow}"
MLFLOW_SERVER_SPEC="${MLFLOW_SERVER_SPEC:-mlflow==3.17.2}"
if ! "$MLFLOW_VENV/bin/python" -c "import mlflow, sys; sys.exit(mlflow.__version__ != '${MLFLOW_SERVER_SPEC#*==}')" 2>/dev/null; then
  log "installing the MLflow server for the tracking tests ($MLFLOW_SERVER_SPEC in $MLFLOW_VENV; a minute)"
  [ -x "$MLFLOW_VENV/bin/python" ] || "$PYTHON" -m venv "$MLFLOW_VENV"
  "$MLFLOW_VENV/bin/python" -m pip install -q "$MLFLOW_SERVER_SPEC" 2>&1 | { grep -vE "WARNING: Location '.*' is ignored" || true; }
fi

# The stamp records what was installed; when pyproject or the torch spec change, install again.
want="$(cat pyproject.toml; echo "$TORCH_SPEC")"
want_sum="$(printf '%s' "$want" | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want_sum" ]; then
  log "environment up to date ($VENV)"
  exit 0
fi

# torch first, so no other package pulls a CUDA build; again when TORCH_SPEC names another version
want_torch="${TORCH_SPEC#*==}"
have_torch="$("$PY" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true)"
if [ "$have_torch" != "${want_torch%%+*}" ]; then
  log "installing $TORCH_SPEC${have_torch:+ (replacing $have_torch)}"
  pipq install -q "$TORCH_SPEC"
fi
log "installing sluice and its dependencies (ffcv compiles once; a few minutes)"
pipq install -q numpy 'cython<3.2' pkgconfig
pipq install -q --no-build-isolation -e '.[all,test]'
printf '%s' "$want_sum" > "$STAMP"
log "done"
