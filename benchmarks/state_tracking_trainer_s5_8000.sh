#!/bin/sh
# docs/results.md, "The preset through the trainer at L = 16": does S5 through the trainer reach 0.90 at 8x L
# with twice the preset's steps? The preset with `--train.tokens 8192000` (8000 steps; the curriculum and the
# learning-rate decay stretch with the run) and twice the records (520,000: no window repeats), S5 seeds
# 0, 1 and 2 on 1..16 moves, graded like the preset's runs (benchmarks/state_tracking_trainer.sh, MOVES=16).
# Two queues side by side, one per core; every call resumes (a checkpoint every 500 steps).
#   nohup sh benchmarks/state_tracking_trainer_s5_8000.sh > runs/st_trainer_s5_8000.log 2>&1 &
#   python benchmarks/state_tracking_trainer_table.py --label len16_8000
set -e
export MOVES=16 RECORDS=520000 OMP_NUM_THREADS=1
run() {  # SEED
    out=runs/st_trainer_s5_s$1_len16_8000
    if [ -f "$out/bench128/results.json" ]; then return 0; fi
    if [ -f "$out/config.yaml" ]; then resume=--resume; else resume=; fi
    echo "== s5 seed $1, 8000 steps ($(date -u +%H:%M:%S))"
    bash benchmarks/state_tracking_trainer.sh s5 "$1" "$out" --train.tokens 8192000 $resume
}
{ run 0 && run 2; } >> runs/st_trainer_s5_8000_a.log 2>&1 &
run 1 >> runs/st_trainer_s5_8000_b.log 2>&1
wait
