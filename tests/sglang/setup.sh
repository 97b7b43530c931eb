#!/usr/bin/env bash
# Build the CPU virtual environment in which tests/sglang runs a real SGLang 0.5.23 server.
#
#   bash tests/sglang/setup.sh            # venv at ${SGLANG_VENV:-.venv-sglang} (relative to the repo root)
#   SGLANG_SETUP_FORCE=1 bash tests/sglang/setup.sh   # rebuild from nothing
#
# Idempotent: a marker file in the venv records a hash of the inputs (the pins below and
# RECIPE_VERSION, requirements.txt, the Python version; the shims and pyproject.toml). Same
# inputs: nothing is done. Only the shims or pyproject.toml changed: only the light steps are
# redone (about 10 s). Anything else: the venv is removed and rebuilt from nothing (about 2
# minutes and 2.8 GB on the 2-core CI machine). Bump RECIPE_VERSION when changing the heavy steps.
#
# What and why (see also tests/sglang/server.py):
#   1. torch==2.13.0, the CPU build. SGLang's metadata pins torch==2.14.1 (a CUDA build here), so
#      SGLang is installed without its dependencies and the rest comes from requirements.txt,
#      constrained so that nothing replaces torch.
#   2. sglang==0.5.23, triton==3.8.0, torchvision==0.28.0, all --no-deps.
#   3. tests/sglang/requirements.txt: the pinned pure-Python/CPU packages SGLang imports or serves with.
#   4. tensor-trace itself, editable, --no-deps (plus msgpack and click), so
#      `.venv-sglang/bin/tensor-trace record -- ...` can trace the server.
#   5. shims/torchvision_ops.pth + shims/_tt_torchvision_shim.py into site-packages: torchvision
#      0.28.0 from PyPI is a CUDA build whose _C.so cannot load on CPU torch; defining the
#      torchvision::nms/qnms schemas before it is imported lets it import.
#      shims/tt_sglang_standins.pth too: it applies shims/tt_sglang_standins (MoE, MLA, EP,
#      DP-attention and EAGLE-3 stand-ins, wide dummy weights) where TT_SGLANG_STANDINS asks.
#      The other shim, shims/sgl_kernel, is NOT installed: the launcher puts tests/sglang/shims on
#      PYTHONPATH (tests/sglang/server.py does), so it cannot shadow a real sgl_kernel.
set -Eeuo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"

VENV="${SGLANG_VENV:-.venv-sglang}"
case "$VENV" in /*) VENV_ABS="$VENV" ;; *) VENV_ABS="$ROOT/$VENV" ;; esac
PYTHON="${PYTHON:-python3}"
RECIPE_VERSION=1
TORCH_VERSION="2.13.0"
NODEPS_PINS=(sglang==0.5.23 triton==3.8.0 torchvision==0.28.0)
MARKER="$VENV/.tt-sglang-setup"
STEP="start"
T0=$(date +%s)

LOG=""

fail() {
    local rc=$?
    echo >&2
    if [[ -n "$LOG" && -s "$LOG" ]]; then
        echo "---- last lines of $LOG ----" >&2
        grep -v "^WARNING: Location 'file:" "$LOG" | tail -n 40 >&2 || true
        echo "----" >&2
    fi
    echo "tests/sglang/setup.sh: FAILED (exit $rc) during: $STEP" >&2
    echo "  venv: $VENV_ABS (left as is, without its marker: the next run rebuilds it)" >&2
    echo "  rerun from nothing with: SGLANG_SETUP_FORCE=1 bash tests/sglang/setup.sh" >&2
    exit "$rc"
}
trap fail ERR

step() {
    STEP="$1"
    printf '[setup.sh %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$STEP"
}

hash_of() { cat "$@" | sha256sum | cut -d' ' -f1; }

STEP="checking inputs"
command -v "$PYTHON" >/dev/null || { echo "setup.sh: $PYTHON not found" >&2; exit 1; }
PYVER="$("$PYTHON" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')"
HEAVY="$(printf '%s\n' "$RECIPE_VERSION" "$PYVER" "$TORCH_VERSION" "${NODEPS_PINS[*]}" "$(hash_of "$HERE/requirements.txt")")"
LIGHT="$(hash_of "$HERE/shims/torchvision_ops.pth" "$HERE/shims/_tt_torchvision_shim.py" "$HERE/shims/tt_sglang_standins.pth" "$ROOT/pyproject.toml")"
WANT="$(printf 'heavy %s\nlight %s\n' "$(echo "$HEAVY" | sha256sum | cut -d' ' -f1)" "$LIGHT")"

if [[ "${SGLANG_SETUP_FORCE:-0}" != "1" && -f "$MARKER" ]]; then
    if [[ "$(cat "$MARKER")" == "$WANT" ]]; then
        echo "tests/sglang/setup.sh: $VENV is up to date (marker $MARKER); nothing to do"
        exit 0
    fi
fi

HEAVY_LINE="$(echo "$WANT" | head -1)"
if [[ "${SGLANG_SETUP_FORCE:-0}" != "1" && -f "$MARKER" && "$(head -1 "$MARKER")" == "$HEAVY_LINE" ]]; then
    echo "tests/sglang/setup.sh: only the shims or pyproject.toml changed; redoing the light steps"
    rm -f "$MARKER"
else
    step "creating $VENV from nothing (python $PYVER)"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
    LOG="$VENV/tt-setup.log"   # pip's output goes here; its tail is shown on failure
    : > "$LOG"

    step "pip install torch==$TORCH_VERSION (CPU build)"
    "${PIP[@]}" install -q "torch==$TORCH_VERSION" >>"$LOG" 2>&1
    if ! "$VENV/bin/python" -W ignore -c 'import sys, torch; sys.exit(0 if torch.version.cuda is None else 1)'; then
        echo "setup.sh: the torch==$TORCH_VERSION that pip found is a CUDA build; this venv needs the CPU build" >&2
        echo "  (put torch-$TORCH_VERSION+cpu where pip finds it, e.g. a --find-links folder)" >&2
        false
    fi

    step "pip install --no-deps ${NODEPS_PINS[*]}"
    "${PIP[@]}" install -q --no-deps "${NODEPS_PINS[@]}" >>"$LOG" 2>&1

    step "pip install -r tests/sglang/requirements.txt (torch constrained to $TORCH_VERSION)"
    printf 'torch==%s\n' "$TORCH_VERSION" > "$VENV/tt-constraints.txt"
    # pip then complains that sglang's own (CUDA) requirements are missing or differ
    # ("sglang 0.5.23 requires torch==2.14.1 ..."): expected, and it still exits 0.
    "${PIP[@]}" install -q -r "$HERE/requirements.txt" -c "$VENV/tt-constraints.txt" >>"$LOG" 2>&1
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
LOG="$VENV/tt-setup.log"

step "pip install --no-deps -e . (tensor-trace) + msgpack, click"
"${PIP[@]}" install -q -c "$VENV/tt-constraints.txt" "msgpack>=1.0" "click>=8.1" >>"$LOG" 2>&1
"${PIP[@]}" install -q --no-deps -e "$ROOT" >>"$LOG" 2>&1

step "installing the torchvision shim into site-packages"
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
install -m 0644 "$HERE/shims/_tt_torchvision_shim.py" "$SITE/_tt_torchvision_shim.py"
install -m 0644 "$HERE/shims/torchvision_ops.pth" "$SITE/torchvision_ops.pth"
# One line that applies tests/sglang/shims/tt_sglang_standins (on PYTHONPATH, never installed)
# only where TT_SGLANG_STANDINS names stand-ins: a plain run of this venv is untouched.
install -m 0644 "$HERE/shims/tt_sglang_standins.pth" "$SITE/tt_sglang_standins.pth"

step "checking: torch is the CPU build and unchanged, torchvision and sglang import"
"$VENV/bin/python" - "$TORCH_VERSION" <<'EOF'
import sys
import warnings
warnings.filterwarnings("ignore")
import torch
assert torch.__version__.split("+")[0] == sys.argv[1], f"torch is {torch.__version__}, wanted {sys.argv[1]}"
assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build"
import torchvision  # needs the nms/qnms shim
import sglang
import sglang.srt.utils  # noqa: F401
import tensor_trace  # noqa: F401
print(f"  torch {torch.__version__}, torchvision {torchvision.__version__}, sglang {sglang.__version__}")
EOF
if [[ -e "$SITE/sgl_kernel" ]]; then
    echo "  note: a real sgl_kernel is installed in $SITE (the shim on PYTHONPATH will shadow it for the server)"
fi

echo "$WANT" > "$MARKER"
echo "  pip's output: $LOG"
echo "tests/sglang/setup.sh: done in $(( $(date +%s) - T0 )) s; venv $VENV_ABS ($(du -sh "$VENV" | cut -f1))"
