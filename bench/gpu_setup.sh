#!/bin/bash
# dimd on a GPU machine whose own Python holds a CUDA build of PyTorch and that cannot reach a package index:
# a venv (default /tmp/dimd-gpu) that sees the machine's own packages, the wheels carried in .whl/
# (`make gpu-wheels` fetches them where an index is reachable: mpi4py, mpich, lmdb), and this checkout
# installed without dependencies. Run from the checkout's root; `make gpu-check` runs it when .whl/ holds wheels.
set -euo pipefail
VENV=${1:-/tmp/dimd-gpu}
SITE=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
echo "$SITE" > "$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/machine-packages.pth"
"$VENV/bin/pip" install -q --disable-pip-version-check --no-index --no-deps .whl/*.whl
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
"$VENV/bin/python" -c "import torch, mpi4py, lmdb; print('dimd on torch', torch.__version__, 'cuda', torch.cuda.is_available())"
