#!/usr/bin/env bash
# The dimd pipeline as workflow steps chained by files:
#   pack train and val -> inspect -> shuffle --verify -> bench-allreduce -> train
#   -> export (eval the last checkpoint, export it to WORKDIR/model, predict 3 validation images)
#   -> plot (WORKDIR/run.png from the metrics; needs matplotlib: `make plots-setup`; not run by default)
#
# usage: bin/pipeline.sh TRAIN_SRC VAL_SRC WORKDIR [extra `dimd train` options...]
#
# Environment (all optional):
#   NP=2                   MPI ranks for the MPI steps
#   LAUNCH="mpiexec -n 2"  how MPI steps start (srun, jsrun, mpirun -hostfile ...); srun gets
#                          --mpi=$SLURM_MPI_TYPE (default pmi2, which the mpich wheel needs)
#                          unless LAUNCH names an --mpi itself
#   DIMD=dimd              the dimd executable
#   PACK_WORKERS           `dimd pack --workers` (default: all cores)
#   VAL_LIST               a `relative/path label` list for a flat val folder (ImageNet's val)
#   VAL_CLASSES            class names for VAL_LIST's labels, one per line
#   FRESH=1                start training afresh instead of resuming from WORKDIR/checkpoints
#   MODEL=resnet50 IMAGE_SIZE=224 EPOCHS=90 BATCH_SIZE=64 LR=0.1
#   STEPS="pack shuffle bench train export"  the steps to run, in this order (of these and plot)
#
# Every step writes its outputs under WORKDIR; a step that fails stops the pipeline, and so does an MPI
# step whose launcher exits 0 though dimd did not write the step's JSON (its last act).
set -euo pipefail

if [[ $# -lt 3 ]]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2
    exit 2
fi
train_src=$1 val_src=$2 work=$3
shift 3

NP=${NP:-2}
read -r -a launch <<<"${LAUNCH:-mpiexec -n $NP}"
# Plain srun gives the mpich wheel no PMI: every rank would run alone (dimd refuses that).
if [[ ${launch[0]##*/} == srun && " ${launch[*]} " != *" --mpi"* ]]; then
    launch=("${launch[0]}" "--mpi=${SLURM_MPI_TYPE:-pmi2}" "${launch[@]:1}")
fi
DIMD=${DIMD:-dimd}
MODEL=${MODEL:-resnet50}
IMAGE_SIZE=${IMAGE_SIZE:-224}
EPOCHS=${EPOCHS:-90}
BATCH_SIZE=${BATCH_SIZE:-64}
LR=${LR:-0.1}
ALL_STEPS="pack shuffle bench train export plot"
STEPS=${STEPS:-pack shuffle bench train export}
for s in $STEPS; do   # every name checked before the first step runs: a typo costs no pack
    [[ " $ALL_STEPS " == *" $s "* ]] || {
        echo "pipeline.sh: unknown step '$s' in STEPS='$STEPS' (steps: $ALL_STEPS)" >&2
        exit 2
    }
done

for arg in "$@"; do   # the extra `dimd train` options
    if [[ $arg == --json || $arg == --json=* ]]; then
        echo "pipeline.sh: --json is this script's own ($work/train.json: it shows the step ended); leave it out" >&2
        exit 2
    fi
done

command -v "${DIMD%% *}" >/dev/null || {
    echo "pipeline.sh: '${DIMD%% *}' is not on PATH; activate dimd's environment (or set DIMD)" >&2
    exit 127
}
mkdir -p "$work"
step() { printf '\n== %s ==\n' "$*"; }
# An MPI step, `mpi_step OUT.json dimd ... --json OUT.json`: dimd writes OUT.json at the step's end only, and
# the launcher's status 0 alone does not prove that end came (Open MPI 5's mpirun exits 0 after it ended a
# job that lost a node; docs/mpi.md).
mpi_step() {
    local out=$1
    shift
    rm -f "$out"
    "${launch[@]}" "$@"
    if [[ ! -f $out ]]; then
        echo "pipeline.sh: the launcher exited 0 but $out is missing (it is written at the step's end): the step did not end normally" >&2
        exit 1
    fi
}
workers=()
[[ -n ${PACK_WORKERS:-} ]] && workers=(--workers "$PACK_WORKERS")

for s in $STEPS; do
    case $s in
    pack)
        step "pack $train_src -> $work/train"
        $DIMD pack "$train_src" -o "$work/train" --force "${workers[@]}" --skipped "$work/train.skipped"
        step "pack $val_src -> $work/val"
        val_list=()
        [[ -n ${VAL_LIST:-} ]] && val_list=(--list "$VAL_LIST")
        [[ -n ${VAL_CLASSES:-} ]] && val_list+=(--classes-file "$VAL_CLASSES")
        $DIMD pack "$val_src" -o "$work/val" --force "${workers[@]}" "${val_list[@]}" \
            --skipped "$work/val.skipped"
        $DIMD inspect "$work/train" --json "$work/train.inspect.json"
        ;;
    shuffle)
        step "shuffle --verify on $NP ranks"
        mpi_step "$work/shuffle.json" $DIMD shuffle "$work/train" --rounds 3 --verify --json "$work/shuffle.json"
        ;;
    bench)
        step "bench-allreduce --check on $NP ranks"
        mpi_step "$work/allreduce.json" $DIMD bench-allreduce --check --max-bytes 4M --factor 4 \
            --json "$work/allreduce.json"
        ;;
    train)
        step "train $MODEL on $NP ranks"
        [[ ${FRESH:-0} == 1 ]] && rm -rf "$work/checkpoints" "$work/metrics.jsonl"
        mpi_step "$work/train.json" $DIMD train "$work/train" --val "$work/val" --model "$MODEL" \
            --image-size "$IMAGE_SIZE" --epochs "$EPOCHS" --batch-size "$BATCH_SIZE" --lr "$LR" \
            --checkpoint-dir "$work/checkpoints" --resume \
            --metrics "$work/metrics.jsonl" --json "$work/train.json" "$@"
        ;;
    export)
        checkpoint=$(find "$work/checkpoints" -name 'checkpoint-*.pt' | sort | tail -n 1)
        [[ -n $checkpoint ]] || { echo "pipeline.sh: no checkpoint in $work/checkpoints (run the train step)" >&2; exit 1; }
        step "eval $checkpoint on $NP ranks"
        mpi_step "$work/eval.json" $DIMD eval "$checkpoint" "$work/val" --json "$work/eval.json"
        step "export -> $work/model, predict 3 validation images"
        $DIMD export "$checkpoint" -o "$work/model" --force
        mapfile -t images < <(find "$val_src" -type f \( -iname '*.jpg' -o -iname '*.jpeg' -o -iname '*.png' \) | sort)
        n=${#images[@]}   # three spread over the set, so that they are of different classes where it is sorted
        ((n > 3)) && images=("${images[0]}" "${images[n / 3]}" "${images[2 * n / 3]}")
        $DIMD predict "$work/model" "${images[@]}" --top 3 --json "$work/predict.json"
        ;;
    plot)
        step "plot $work/metrics.jsonl -> $work/run.png"
        $DIMD plot "$work/metrics.jsonl" -o "$work/run.png" --label "$MODEL on $NP ranks"
        ;;
    esac
done
