#!/usr/bin/env bash
# The measured inputs of `dimd plan-batch`, at small scale on one machine:
#   bench-allreduce at P = 2, 3, 4, 5, RUNS times (with the model's gradient size as one more message),
#   the cost-model fit of every algorithm with its held-out check (fit on P = 2, 3; predict 4, 5),
#   and the step time of lenet (28 px) and resnet20 (32 px) on NP ranks.
# Every step writes a JSON result under OUT; re-run it on a quiet machine to replace them:
#   PATH=$PWD/.venv/bin:$PATH bash bench/plan_batch_inputs.sh
set -euo pipefail

OUT=${OUT:-bench/results}
RANKS=${RANKS:-"2 3 4 5"}
RUNS=${RUNS:-3}
MODEL=${MODEL:-resnet20}            # whose gradient size Delta(P) is predicted for
NP=${NP:-2}                         # ranks for the step time (they share the node's cores as in training)
ALGORITHMS=${ALGORITHMS:-ring,recursive-doubling,ps,tree,multicolor,rabenseifner,mpi}
mkdir -p "$OUT"

files=()
for run in $(seq 1 "$RUNS"); do      # repeats at each P: comm combines them by their median
  for p in $RANKS; do
    mpiexec -n "$p" dimd bench-allreduce -b 64K -e 16M -f 4 -a "$ALGORITHMS" --model "$MODEL" \
      --json "$OUT/plan_batch_ar_P${p}_r$run.json"
    files+=("$OUT/plan_batch_ar_P${p}_r$run.json")
  done
done
dimd plan-batch comm "${files[@]}" --model "$MODEL" --json "$OUT/plan_batch_comm.json"

mpiexec -n "$NP" dimd plan-batch step-time --model lenet --image-size 28 --json "$OUT/plan_batch_step_lenet.json"
mpiexec -n "$NP" dimd plan-batch step-time --model resnet20 --image-size 32 \
  --json "$OUT/plan_batch_step_resnet20.json"
