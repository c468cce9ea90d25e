#!/bin/sh
# The resumable queue behind benchmarks/state_tracking_trainer_len16.sh and state_tracking_trainer_8000.sh:
# the runs JOBS ("TASK:SEED ...") of benchmarks/state_tracking_trainer.sh (MOVES=16) in runs/st_trainer_TASK_sSEED_LABEL,
# two lanes, one per core (OMP_NUM_THREADS=1), taking the jobs in turn. A run that
# benchmarks/results/state_tracking_trainer/LABEL.json already holds is skipped, one with a run directory but no
# grade continues with --resume (a checkpoint every 500 steps), and each graded run is merged into that JSON (and
# docs/state_tracking_trainer_LABEL.png) at once, so what finished survives runs/ (which is not committed).
#   LABEL=... JOBS="s5:0 s5:1" sh benchmarks/state_tracking_trainer_queue.sh [TRAIN OPTIONS...]
set -e
: "${LABEL:?set LABEL, the runs name suffix}" "${JOBS:?set JOBS, e.g. JOBS=\"s5:0 s5:1\"}"
export MOVES=16 OMP_NUM_THREADS=1
PY=${PYTHON:-.venv/bin/python}
TRAIN_OPTIONS="$*"
held() {  # TASK SEED: exit 0 if the JSON holds the run, 1 if not; anything else (e.g. a LABEL the table script
    # cannot name its JSON after) stops the queue instead of training a run whose grades could not be merged
    rc=0
    "$PY" benchmarks/state_tracking_trainer_table.py --label "$LABEL" --has "$1" "$2" || rc=$?
    if [ "$rc" -gt 1 ]; then exit "$rc"; fi
    return "$rc"
}
held - 0 || true  # before any training: the same check on no run in particular
run() {  # TASK SEED
    out=runs/st_trainer_$1_s$2_$LABEL
    if held "$1" "$2"; then return 0; fi
    if [ ! -f "$out/bench128/results.json" ]; then
        if [ -f "$out/config.yaml" ]; then resume=--resume; else resume=; fi
        echo "== $1 seed $2 $TRAIN_OPTIONS ($(date -u +%H:%M:%S))"
        # shellcheck disable=SC2086  # the options split into words on purpose
        bash benchmarks/state_tracking_trainer.sh "$1" "$2" "$out" $TRAIN_OPTIONS $resume
    fi
    flock "runs/st_trainer_$LABEL.lock" "$PY" benchmarks/state_tracking_trainer_table.py --label "$LABEL" > /dev/null
}
lane() {  # 0 or 1: every other job of JOBS
    i=0
    for job in $JOBS; do
        if [ $((i % 2)) -eq "$1" ]; then run "${job%:*}" "${job#*:}"; fi
        i=$((i + 1))
    done
}
mkdir -p runs
lane 0 >> "runs/st_trainer_${LABEL}_a.log" 2>&1 &
lane 1 >> "runs/st_trainer_${LABEL}_b.log" 2>&1
wait
