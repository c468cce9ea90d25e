#!/bin/sh
# docs/results.md, "S5 with twice the steps through the trainer": the preset with `--train.tokens 8192000`
# (8000 steps; the curriculum and the learning-rate decay stretch with the run) and twice the records (520,000:
# no window repeats) on 1..16 moves, graded like the preset's runs (benchmarks/state_tracking_trainer.sh,
# MOVES=16). S5 seeds 0, 1 and 2 first (the question: does S5 reach 0.90 at 8x L with twice the steps?), then
# seeds 0, 1 and 2 of the other tasks (can 8000 steps be the preset's default for every task?); about 80 min a
# run on one core. Two lanes, one per core (OMP_NUM_THREADS=1), taking the runs in turn. Every call resumes: a
# run already in benchmarks/results/state_tracking_trainer/len16_8000.json is skipped, one with a run directory
# continues with --resume (a checkpoint every 500 steps); each graded run is merged into that JSON (and
# docs/state_tracking_trainer_len16_8000.png) at once, so what finished survives runs/.
#   nohup sh benchmarks/state_tracking_trainer_8000.sh > runs/st_trainer_8000.log 2>&1 &
#   python benchmarks/state_tracking_trainer_table.py --label len16_8000 --from-json
set -e
export MOVES=16 RECORDS=520000 OMP_NUM_THREADS=1
PY=${PYTHON:-.venv/bin/python}
JOBS="s5:0 s5:1 s5:2 parity:0 summod:0 flipflop:0 cycle:0 s3:0 parity:1 summod:1 flipflop:1 cycle:1 s3:1
parity:2 summod:2 flipflop:2 cycle:2 s3:2"
run() {  # TASK SEED
    out=runs/st_trainer_$1_s$2_len16_8000
    if "$PY" benchmarks/state_tracking_trainer_table.py --label len16_8000 --has "$1" "$2"; then return 0; fi
    if [ ! -f "$out/bench128/results.json" ]; then
        if [ -f "$out/config.yaml" ]; then resume=--resume; else resume=; fi
        echo "== $1 seed $2, 8000 steps ($(date -u +%H:%M:%S))"
        bash benchmarks/state_tracking_trainer.sh "$1" "$2" "$out" --train.tokens 8192000 $resume
    fi
    flock runs/st_trainer_8000.lock "$PY" benchmarks/state_tracking_trainer_table.py --label len16_8000 > /dev/null
}
lane() {  # 0 or 1: every other job of JOBS
    i=0
    for job in $JOBS; do
        if [ $((i % 2)) -eq "$1" ]; then run "${job%:*}" "${job#*:}"; fi
        i=$((i + 1))
    done
}
mkdir -p runs
lane 0 >> runs/st_trainer_8000_a.log 2>&1 &
lane 1 >> runs/st_trainer_8000_b.log 2>&1
wait
