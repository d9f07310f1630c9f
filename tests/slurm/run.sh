#!/usr/bin/env bash
# The batch jobs on a real single-node SLURM (Debian's slurm-wlm and munge), run as a user runs
# them (see docs/batch-jobs.md):
#   1. plain `srun -n 2 dimd train` fails at start with dimd's one-line message (the singleton
#      trap); `srun -n 1`, `mpiexec -n 2` inside an allocation and SLURM_MPI_TYPE=pmi2 work;
#   2. pack.sbatch on sample data -> train.sbatch --dependency=afterok on 2 tasks (the log says
#      2 ranks); a rerun of the pack job keeps its finished, verified output;
#   3. scancel --signal=TERM, scancel --batch --signal=TERM and plain scancel of a running
#      training: checkpoint, no requeue;
#   4. a short time limit with --signal=B:USR1@75: warned -> checkpoint -> requeued by the job
#      itself (Restarts >= 1) -> resumes from that checkpoint -> finishes;
#   5. bin/pipeline.sh with LAUNCH=srun runs its MPI step on 2 ranks;
# and sbatch reads train.sbatch's GPU lines only once a site turns them on (this cluster has no GPU).
# The jobs run as an unprivileged user created for the test (it requeues its own job).
#
#   tests/slurm/run.sh        # as root, after `make setup`; CI runs it from .ci/run
#
# Installs slurm-wlm and munge from Debian's archive when they are missing (fails, saying so,
# when it cannot). Runs munged, slurmctld and slurmd from a temporary folder (own socket, ports,
# key and state; nothing under /etc changes), and on any exit cancels the jobs, stops the
# daemons it started by PID and removes the folder (KEEP=1 keeps it, with every log).
# Environment: DIMD_BIN (dimd and its python; default: the checkout's .venv/bin),
# TEST_USER (default dimd-slurm-test).
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
DIMD_BIN=${DIMD_BIN:-$repo/.venv/bin}
TEST_USER=${TEST_USER:-dimd-slurm-test}
start_time=$SECONDS
tmp= conf= work= user_created= as_root=0
pids=()       # daemons we started, in start order

say() { printf 'slurm-test [%3ds]: %s\n' $((SECONDS - start_time)) "$*"; }
ok() { say "ok: $*"; }
fail() {
    say "FAIL: $*" >&2
    if [[ -n $work && -d $work ]]; then
        for log in "$work"/*.out; do
            [[ -f $log ]] || continue
            echo "----- $(basename "$log") (last 30 lines)" >&2
            tail -n 30 "$log" >&2
        done
    fi
    for log in "$tmp"/slurmctld.log "$tmp"/slurmd.log; do
        [[ -f $log ]] && { echo "----- $(basename "$log") (last 15 lines)" >&2; tail -n 15 "$log" >&2; }
    done
    exit 1
}

cleanup() {
    local rc=$? pid i
    set +e
    trap - EXIT INT TERM
    if [[ -n $conf && ${#pids[@]} -gt 0 ]]; then
        local jobs
        jobs=$(SLURM_CONF=$conf squeue -h -o %i 2>/dev/null)
        if [[ -n $jobs ]]; then
            SLURM_CONF=$conf scancel $jobs 2>/dev/null
            for i in $(seq 60); do
                [[ -z $(SLURM_CONF=$conf squeue -h -o %i 2>/dev/null) ]] && break
                sleep 0.5
            done
        fi
    fi
    for ((i = ${#pids[@]} - 1; i >= 0; i--)); do   # slurmd, slurmctld, then munged
        pid=${pids[i]}
        kill -TERM "$pid" 2>/dev/null || continue
        for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
        kill -KILL "$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
    done
    [[ -n $user_created ]] && userdel "$TEST_USER" 2>/dev/null
    if [[ -n $tmp ]]; then
        if [[ ${KEEP:-0} == 1 ]]; then say "kept $tmp"; else rm -rf "$tmp"; fi
    fi
    if [[ $rc -eq 0 ]]; then say "passed in $((SECONDS - start_time)) s"; else say "failed (exit $rc)"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- what the test needs ------------------------------------------------------------------
[[ $EUID -eq 0 ]] || fail "needs root: it starts slurmd and slurmctld and runs the jobs as a test user"
[[ -x $DIMD_BIN/dimd && -x $DIMD_BIN/python3 ]] || fail "no dimd in $DIMD_BIN: run 'make setup' first (or set DIMD_BIN)"
missing=()
for tool in munged slurmctld slurmd sbatch srun scontrol scancel squeue sinfo; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
if [[ ${#missing[@]} -gt 0 ]]; then
    command -v apt-get >/dev/null || fail "${missing[*]} missing and no apt-get here: install slurm-wlm and munge"
    say "installing slurm-wlm and munge from Debian's archive (${missing[*]} missing)"
    apt_log=$(mktemp)
    if ! { DEBIAN_FRONTEND=noninteractive apt-get update -q &&
           DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
               slurm-wlm munge; } >"$apt_log" 2>&1 </dev/null; then
        tail -n 20 "$apt_log" >&2
        rm -f "$apt_log"
        fail "could not install slurm-wlm and munge from Debian's archive (apt-get's last lines above)"
    fi
    rm -f "$apt_log"
    for tool in "${missing[@]}"; do command -v "$tool" >/dev/null || fail "$tool still missing after apt-get install"; done
fi
say "$(slurmctld -V), $(munged -V 2>&1 | head -n 1)"

# ---- a private cluster under a temporary folder ---------------------------------------------
tmp=$(mktemp -d /tmp/dimd-slurm.XXXXXX)
chmod 755 "$tmp"
mkdir -p "$tmp/munge" "$tmp/run" "$tmp/state" "$tmp/spool" "$tmp/work"
chmod 700 "$tmp/munge"
chmod 755 "$tmp/run"
work=$tmp/work
conf=$tmp/slurm.conf
export SLURM_CONF=$conf

dd if=/dev/urandom of="$tmp/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$tmp/munge/munge.key"
munged -F --socket="$tmp/run/munge.socket" --key-file="$tmp/munge/munge.key" \
    --pid-file="$tmp/run/munged.pid" --seed-file="$tmp/munge/munged.seed" \
    --log-file="$tmp/munge/munged.log" >"$tmp/munged.out" 2>&1 &
pids+=($!)
for _ in $(seq 40); do [[ -S $tmp/run/munge.socket ]] && break; sleep 0.25; done
[[ -S $tmp/run/munge.socket ]] || { cat "$tmp/munged.out" >&2; fail "munged did not start"; }

node=$(hostname -s)
hardware=$(slurmd -C | head -n 1 | sed -e 's/^NodeName=[^ ]* //' -e 's/ *UpTime=.*//')
read -r ctld_port slurmd_port < <("$DIMD_BIN/python3" -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
# cred_expire: how long a requeued job waits in BeginTime (120 s by default; slurm.conf(5)).
cat >"$conf" <<EOF
ClusterName=dimdtest
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$tmp/run/munge.socket,cred_expire=10
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool
SlurmctldPidFile=$tmp/run/slurmctld.pid
SlurmdPidFile=$tmp/run/slurmd.pid
SlurmctldLogFile=$tmp/slurmctld.log
SlurmdLogFile=$tmp/slurmd.log
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
KillWait=30
MinJobAge=3600
ReturnToService=2
MailProg=/bin/true
NodeName=$node NodeAddr=127.0.0.1 $hardware State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
slurmctld -D -f "$conf" >"$tmp/slurmctld.out" 2>&1 &
pids+=($!)
slurmd -D -f "$conf" -N "$node" >"$tmp/slurmd.out" 2>&1 &
pids+=($!)
for _ in $(seq 60); do
    [[ $(sinfo -h -o %T 2>/dev/null) == idle ]] && break
    sleep 0.5
done
[[ $(sinfo -h -o %T 2>/dev/null) == idle ]] || fail "the node did not come up idle: $(sinfo 2>&1 | tail -n 1)"
ok "cluster up: node $node ($hardware), slurmctld :$ctld_port, slurmd :$slurmd_port, MpiDefault=none"

# ---- the user who runs the jobs ---------------------------------------------------------------
if ! id "$TEST_USER" >/dev/null 2>&1; then
    useradd --system --no-create-home --shell /bin/bash "$TEST_USER" || fail "could not create user $TEST_USER"
    user_created=1
fi
mkdir -p "$work/home"
chown -R "$TEST_USER:" "$work"
if ! runuser -u "$TEST_USER" -- "$DIMD_BIN/dimd" --version >/dev/null 2>&1; then
    say "NOTE: $TEST_USER cannot run $DIMD_BIN/dimd (its python, $(readlink -f "$DIMD_BIN/python3")," \
        "lies in a folder closed to other users): the dimd jobs run as root; a small job checks" \
        "that $TEST_USER may requeue its own job"
    as_root=1
fi
job_user=$([[ $as_root == 1 ]] && echo root || echo "$TEST_USER")

# Run a command as USER, in the work folder, with a clean environment (as a login would).
run_as() {
    local who=$1 envs
    shift
    envs=(PATH="$DIMD_BIN:/usr/local/bin:/usr/bin:/bin" HOME="$work/home" LANG=C.UTF-8
          SLURM_CONF="$conf" USER="$who" LOGNAME="$who")
    while [[ $1 == *=* ]]; do envs+=("$1"); shift; done
    if [[ $who == root ]]; then
        (cd "$work" && env -i "${envs[@]}" "$@")
    else
        (cd "$work" && runuser -u "$who" -- env -i "${envs[@]}" "$@")
    fi
}
as_user() { run_as "$job_user" "$@"; }
submit() { as_user "$@" | tail -n 1; }                           # sbatch --parsable ...
field() { scontrol show job "$1" | grep -o "\b$2=[^ ]*" | head -n 1 | cut -d= -f2-; }
state() { field "$1" JobState; }
wait_state() {   # JOB TIMEOUT STATE...: until the job is in one of STATE
    local job=$1 timeout=$2 s
    shift 2
    local deadline=$((SECONDS + timeout))
    while ((SECONDS < deadline)); do
        s=$(state "$job")
        for want in "$@"; do [[ $s == "$want" ]] && return 0; done
        sleep 1
    done
    fail "job $job is $(state "$job") after ${timeout}s, not $*"
}
wait_log() {     # FILE TIMEOUT PATTERN: until the log has PATTERN
    local deadline=$((SECONDS + $2))
    while ((SECONDS < deadline)); do
        grep -q -- "$3" "$1" 2>/dev/null && return 0
        sleep 1
    done
    fail "$(basename "$1") has no '$3' after $2 s"
}
json() {         # FILE EXPRESSION(doc): print a value from a dimd JSON envelope
    "$DIMD_BIN/python3" -c 'import json, sys
doc = json.load(open(sys.argv[1]))
print(eval(sys.argv[2], {"doc": doc, "result": doc.get("result", {})}))' "$1" "$2"
}
has() { grep -q -- "$2" "$1" || fail "$(basename "$1") does not say '$2'"; }
lacks() { ! grep -q -- "$2" "$1" || fail "$(basename "$1") says '$2'"; }
ok "the dimd jobs run as $job_user"

# ---- a non-root user may requeue its own job (what train.sbatch does at the warning) ---------
cat >"$work/requeue-self.sh" <<'EOF'
#!/usr/bin/env bash
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=requeue-self.out
echo "run ${SLURM_RESTART_COUNT:-0} as $(id -un)"
if [[ -z ${SLURM_RESTART_COUNT:-} ]]; then
    echo "requeueing as $(id -un)"      # before: the requeue ends this run at once
    scontrol requeue "$SLURM_JOB_ID" || echo "scontrol requeue failed for $(id -un)"
    sleep 60
fi
EOF
chmod 755 "$work/requeue-self.sh"
self=$(run_as "$TEST_USER" sbatch --parsable requeue-self.sh | tail -n 1)
wait_state "$self" 120 COMPLETED FAILED CANCELLED TIMEOUT
[[ $(state "$self") == COMPLETED && $(field "$self" Restarts) == 1 ]] ||
    fail "job $self of $TEST_USER: $(state "$self"), Restarts=$(field "$self" Restarts): $(cat "$work/requeue-self.out")"
has "$work/requeue-self.out" "requeueing as $TEST_USER"
lacks "$work/requeue-self.out" "scontrol requeue failed"
has "$work/requeue-self.out" "run 1 as $TEST_USER"
ok "$TEST_USER requeued its own job $self (scontrol requeue from inside it): Restarts=1, then COMPLETED"

# ---- train.sbatch's GPU lines: off as shipped, a GPU request once a site turns them on --------
# This cluster has no GPU: sbatch takes the script as shipped and refuses it with its GPU lines on,
# which shows that it reads them (docs/batch-jobs.md#before-you-submit).
sed 's/^##SBATCH --gpu/#SBATCH --gpu/' "$repo/bin/slurm/train.sbatch" >"$work/train-gpu.sbatch"
shipped_said=$(as_user sbatch --test-only "$repo/bin/slurm/train.sbatch" packed 2>&1) ||
    fail "sbatch --test-only refused train.sbatch as shipped: $shipped_said"
if gpu_said=$(as_user sbatch --test-only "$work/train-gpu.sbatch" packed 2>&1); then
    fail "sbatch --test-only took train.sbatch with its GPU lines on, on a cluster without GPUs: $gpu_said"
fi
ok "train.sbatch: no GPU asked for as shipped; its GPU lines on, refused here: '$(tail -n 1 <<<"$gpu_said")'"

# ---- sample data (ImageNet-style: class folders for train, a flat val with a label list) ----
as_user dimd sample-data data/train --classes 4 --per-class 40 --seed 1 >/dev/null
as_user dimd sample-data data/val --classes 4 --per-class 10 --seed 2 --layout flat >/dev/null
ok "sample data: 160 train images in 4 class folders, 40 flat val images with labels.txt and classes.txt"

# ---- 1. the singleton trap, and the launches that are right ---------------------------------
train_small=(--model lenet --image-size 32 --epochs 1 --batch-size 8 --decode-workers 1)
as_user dimd pack data/train -o trap-train --short-side 40 >/dev/null
trap_out=$work/trap.out
rc=0
as_user srun -n 2 dimd train trap-train --val trap-train "${train_small[@]}" >"$trap_out" 2>&1 || rc=$?
[[ $rc -ne 0 ]] || fail "plain srun -n 2 dimd train exited 0: $(cat "$trap_out")"
[[ $(grep -c "dimd: error: srun started 2 processes (SLURM_STEP_NUM_TASKS=2)" "$trap_out") == 1 ]] ||
    fail "plain srun -n 2 did not print dimd's message once: $(cat "$trap_out")"
has "$trap_out" "srun --mpi=pmi2"
lacks "$trap_out" "ranks x batch"
ok "plain srun -n 2 dimd train: exit $rc, one line: $(grep -o 'dimd: error: .\{60\}' "$trap_out")..."

as_user srun -n 1 dimd bench-allreduce --max-bytes 64 --algorithms mpi --json one.json >/dev/null 2>&1 ||
    fail "srun -n 1 dimd bench-allreduce failed (a one-rank run on purpose)"
[[ $(json "$work/one.json" 'doc["mpi"]["world_size"]') == 1 ]] || fail "srun -n 1 did not run on 1 rank"
as_user SLURM_MPI_TYPE=pmi2 srun -n 2 dimd bench-allreduce --max-bytes 64 --algorithms mpi --json pmi2.json \
    >/dev/null 2>&1 || fail "SLURM_MPI_TYPE=pmi2 srun -n 2 dimd bench-allreduce failed"
[[ $(json "$work/pmi2.json" 'doc["mpi"]["world_size"]') == 2 ]] || fail "SLURM_MPI_TYPE=pmi2 srun -n 2 did not make 2 ranks"
as_user sbatch --wait -n 2 -o mpiexec.out --wrap \
    "mpiexec -n 2 dimd bench-allreduce --max-bytes 64 --algorithms mpi --json mpiexec.json" >/dev/null ||
    fail "mpiexec -n 2 inside an allocation failed: $(cat "$work/mpiexec.out")"
[[ $(json "$work/mpiexec.json" 'doc["mpi"]["world_size"]') == 2 ]] || fail "mpiexec -n 2 inside sbatch did not make 2 ranks"
ok "srun -n 1 runs on 1 rank; SLURM_MPI_TYPE=pmi2 srun -n 2 and mpiexec -n 2 inside sbatch -n 2 on 2 ranks"

# ---- 2. pack.sbatch -> train.sbatch (afterok), on 2 tasks ------------------------------------
# The README's example, word for word apart from the folder names.
pack=$(submit VAL_LIST=data/val/labels.txt VAL_CLASSES=data/val/classes.txt \
    sbatch --parsable "$repo/bin/slurm/pack.sbatch" data packed --short-side 64)
train=$(submit sbatch --parsable --dependency=afterok:"$pack" "$repo/bin/slurm/train.sbatch" packed \
    --model resnet20 --image-size 32 --epochs 3 --batch-size 8 --lr 0.2)
say "pack job $pack, train job $train (afterok:$pack)"
[[ $(state "$train") == PENDING ]] || fail "train job $train did not wait for pack job $pack"
wait_state "$pack" 180 COMPLETED FAILED CANCELLED TIMEOUT
[[ $(state "$pack") == COMPLETED ]] || fail "pack job $pack ended $(state "$pack")"
wait_state "$train" 300 COMPLETED FAILED CANCELLED TIMEOUT
[[ $(state "$train") == COMPLETED ]] || fail "train job $train ended $(state "$train")"
log=$work/dimd-train-$train.out
has "$log" "2 ranks x batch 8 = 16"
has "$log" "srun --mpi=pmi2"
has "$log" "done: val top1"
lacks "$log" "requeueing"
run=$work/packed/runs/dimd-train
[[ $(json "$run/train.json" 'result["world_size"]') == 2 ]] || fail "train.json: world_size is not 2"
[[ $(json "$run/train.json" 'len(result["history"])') == 3 ]] || fail "train.json: not 3 epochs"
[[ $(field "$train" Restarts) == 0 ]] || fail "train job $train was requeued"
ok "pack.sbatch -> train.sbatch afterok: '$(grep -o '2 ranks x batch [0-9]* = [0-9]*' "$log")', $(grep -o 'done: val top1 [0-9.]*%' "$log")"
epoch_s=$(json "$run/train.json" 'round(sorted(e["seconds"] for e in result["history"])[1], 2)')

rerun=$(submit sbatch --parsable "$repo/bin/slurm/pack.sbatch" data packed --short-side 64)
wait_state "$rerun" 180 COMPLETED FAILED CANCELLED TIMEOUT
[[ $(state "$rerun") == COMPLETED ]] || fail "the pack job's rerun $rerun ended $(state "$rerun")"
has "$work/dimd-pack-$rerun.out" "packed/train is complete, verified and packed from data/train; kept"
has "$work/dimd-pack-$rerun.out" "packed/val is complete, verified and packed from data/val; kept"
ok "a rerun of pack.sbatch keeps the finished, verified output"

# ---- 3. stop a running training: checkpoint, no requeue ---------------------------------------
# --allreduce ring: no start-up measurement of the algorithms (10 s and more on a busy machine).
long_train=(--model resnet20 --image-size 32 --epochs 1000 --batch-size 8 --lr 0.2 --allreduce ring)
stop_test() {    # NAME HOW: submit, wait for training, stop it with HOW, check the ending
    local name=$1 how=$2 job log stopped
    job=$(submit sbatch --parsable --job-name="$name" "$repo/bin/slurm/train.sbatch" packed "${long_train[@]}")
    log=$work/dimd-train-$job.out
    wait_log "$log" 180 "2 ranks x batch"   # loaded and set up: the next thing is training
    case $how in
    term) as_user scancel --signal=TERM "$job" ;;
    term-batch) as_user scancel --batch --signal=TERM "$job" ;;
    cancel) as_user scancel "$job" ;;
    esac
    wait_state "$job" 120 COMPLETED CANCELLED FAILED TIMEOUT
    wait_log "$log" 30 "stopped by SIGTERM"
    stopped=$(grep -o "checkpoint [^;]*\.pt" "$log" | tail -n 1 | cut -d' ' -f2)
    [[ -f $work/$stopped ]] || fail "$name: no checkpoint written at the stop"
    [[ $(field "$job" Restarts) == 0 ]] || fail "$name: the job was requeued"
    lacks "$log" "requeueing"
    # A plain scancel ends the batch shell too, so only the others get to say so.
    [[ $how == cancel ]] || has "$log" "the ranks stopped for SIGTERM and wrote a checkpoint; not requeued"
    say "ok: $how: job $job ended $(state "$job") (exit $(field "$job" ExitCode)), $(grep -o 'stopped by SIGTERM after step [0-9]*' "$log"), checkpoint $(basename "$stopped"), Restarts=0"
}
stop_test term term              # scancel --signal=TERM JOB: to the ranks
stop_test term-batch term-batch  # TERM to the batch shell, which passes it on through SLURM
stop_test cancel cancel          # plain scancel: SLURM signals everything, then SIGKILL after KillWait

# ---- 4. the time-limit warning: checkpoint, requeue, resume, finish --------------------------
# SLURM checks time limits every 30 s and warns when the end is at most 75 + 30 s away: 15-45 s
# after the start here. The training takes about 90 s at this machine's pace (measured by the
# job above), so the first run is warned mid-way.
epochs=$("$DIMD_BIN/python3" -c "import math; print(max(6, math.ceil(90 / max($epoch_s, 0.1))))")
warned=$(submit sbatch --parsable --job-name=warned --time=2 --signal=B:USR1@75 \
    "$repo/bin/slurm/train.sbatch" packed --model resnet20 --image-size 32 --epochs "$epochs" \
    --batch-size 8 --lr 0.2 --allreduce ring)
log=$work/dimd-train-$warned.out
say "warned job $warned: --time=2 --signal=B:USR1@75, $epochs epochs of about ${epoch_s}s"
wait_log "$log" 240 "train.sbatch: the ranks stopped"
grep -q "requeueing job $warned" "$log" || fail "warned job: the first run was not warned in time ($(grep 'train.sbatch: the ranks stopped\|^done' "$log"))"
has "$log" "SIGUSR1 -> the ranks of job $warned"
has "$log" "stopped by SIGUSR1"
checkpoint=$(grep -o "stopped by SIGUSR1 after step [0-9]*; checkpoint [^;]*\.pt" "$log" | head -n 1 | sed 's/.*checkpoint //')
[[ -f $work/$checkpoint ]] || fail "warned job: no checkpoint at the warning"
deadline=$((SECONDS + 60))
until (($(field "$warned" Restarts) >= 1)); do
    ((SECONDS < deadline)) || fail "warned job: the log says requeueing, but Restarts is still 0"
    sleep 1
done
say "requeued: $(scontrol show job "$warned" | grep -o 'JobState=[^ ]* Reason=[^ ]*\|Restarts=[^ ]*\|BeginTime=[^ ]*' | tr '\n' ' ')"
# The next run gets room to finish (as root, as a site admin could); its time limit would warn it again.
scontrol update JobId="$warned" TimeLimit=20 || fail "could not give the requeued job $warned more time"
wait_state "$warned" 600 COMPLETED FAILED CANCELLED TIMEOUT
[[ $(state "$warned") == COMPLETED ]] || fail "warned job ended $(state "$warned")"
restarts=$(field "$warned" Restarts)
((restarts >= 1)) || fail "warned job: Restarts=$restarts"
has "$log" "restart 1,"
has "$log" "resumed from $checkpoint"
has "$log" "done: val top1"
run=$work/packed/runs/warned
[[ $(json "$run/train.json" 'result["stopped_by"]') == None ]] || fail "warned job: the last run did not finish"
[[ $(json "$run/train.json" 'len(result["history"])') == "$epochs" ]] || fail "warned job: not $epochs epochs in train.json"
[[ $(json "$run/train.json" 'result["world_size"]') == 2 ]] || fail "warned job: not 2 ranks"
ok "warned job $warned: $(grep -o 'stopped by SIGUSR1 after step [0-9]*' "$log" | head -n 1), requeued by $job_user," \
   "Restarts=$restarts, resumed from $(basename "$checkpoint"), $(grep -o 'done: val top1 [0-9.]*%' "$log")"

# ---- 5. bin/pipeline.sh with LAUNCH=srun -----------------------------------------------------
as_user LAUNCH=srun STEPS=shuffle sbatch --wait -n 2 -o pipeline.out \
    "$repo/bin/pipeline.sh" - - packed >/dev/null || fail "pipeline.sh with LAUNCH=srun failed"
[[ $(json "$work/packed/shuffle.json" 'doc["mpi"]["world_size"]') == 2 ]] ||
    fail "pipeline.sh LAUNCH=srun: shuffle.json is not from 2 ranks"
ok "bin/pipeline.sh with LAUNCH=srun: its MPI step (shuffle --verify) ran on 2 ranks (srun --mpi=pmi2)"
