#!/bin/sh
# docs/results.md, "The preset through the trainer at L = 16": does S5 through the trainer reach 0.90 at 8x L
# with twice the preset's steps? The preset with `--train.tokens 8192000` (8000 steps; the curriculum and the
# learning-rate decay stretch with the run) and twice the records (520,000: no window repeats), S5 seeds
# 0, 1 and 2 on 1..16 moves, graded like the preset's runs (benchmarks/state_tracking_trainer.sh, MOVES=16).
# The three seeds side by side (OMP_NUM_THREADS=1 each; on two cores their wall-clock seconds are not the
# preset's). Every call resumes: a run already in benchmarks/results/state_tracking_trainer/len16_8000.json is
# skipped, one with a run directory continues with --resume (a checkpoint every 500 steps); each graded run is
# merged into that JSON (and docs/state_tracking_trainer_len16_8000.png) at once.
#   nohup sh benchmarks/state_tracking_trainer_s5_8000.sh > runs/st_trainer_s5_8000.log 2>&1 &
#   python benchmarks/state_tracking_trainer_table.py --label len16_8000 --from-json
set -e
export MOVES=16 RECORDS=520000 OMP_NUM_THREADS=1
PY=${PYTHON:-.venv/bin/python}
run() {  # SEED
    out=runs/st_trainer_s5_s$1_len16_8000
    if "$PY" benchmarks/state_tracking_trainer_table.py --label len16_8000 --has s5 "$1"; then return 0; fi
    if [ ! -f "$out/bench128/results.json" ]; then
        if [ -f "$out/config.yaml" ]; then resume=--resume; else resume=; fi
        echo "== s5 seed $1, 8000 steps ($(date -u +%H:%M:%S))"
        bash benchmarks/state_tracking_trainer.sh s5 "$1" "$out" --train.tokens 8192000 $resume
    fi
    flock runs/st_trainer_s5_8000.lock "$PY" benchmarks/state_tracking_trainer_table.py --label len16_8000 > /dev/null
}
mkdir -p runs
run 0 >> runs/st_trainer_s5_8000_s0.log 2>&1 &
run 1 >> runs/st_trainer_s5_8000_s1.log 2>&1 &
run 2 >> runs/st_trainer_s5_8000_s2.log 2>&1
wait
