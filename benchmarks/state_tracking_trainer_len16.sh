#!/bin/sh
# docs/results.md, "The preset through the trainer at L = 16": the preset as it is (4000 steps, the model of the
# best validation kept in OUT/best) through `fullband train --config state-tracking` on exported records of
# 1..16 moves of every task, graded by `fullband bench OUT/best --modes standard,fused:auto` at 16 and 128 moves
# (benchmarks/state_tracking_trainer.sh with MOVES=16). Seed 0 of every task first, then S5's seeds 1 and 2
# (the one task below 0.90 at 128 moves in seed 0), then seed 1 of the other tasks, then their seed 2.
# Two queues side by side, one per core (OMP_NUM_THREADS=1). Every call resumes: a run graded at 128 moves is
# skipped, one with a run directory but no grade continues with --resume.
#   nohup sh benchmarks/state_tracking_trainer_len16.sh > runs/st_trainer_len16.log 2>&1 &
set -e
export MOVES=16 OMP_NUM_THREADS=1
run() {  # TASK SEED
    out=runs/st_trainer_$1_s$2_len16
    if [ -f "$out/bench128/results.json" ]; then return 0; fi
    if [ -f "$out/config.yaml" ]; then set -- "$1" "$2" "$out" --resume; else set -- "$1" "$2" "$out"; fi
    echo "== $1 seed $2 ($(date -u +%H:%M:%S))"
    bash benchmarks/state_tracking_trainer.sh "$@"
}
queue_a() { run s5 0 && run cycle 0 && run flipflop 0 && run s5 1 && run cycle 1 && run flipflop 1 \
            && run parity 1 && run cycle 2 && run flipflop 2; }
queue_b() { run summod 0 && run s3 0 && run parity 0 && run s5 2 && run summod 1 && run s3 1 \
            && run summod 2 && run s3 2 && run parity 2; }
queue_a >> runs/st_trainer_len16_a.log 2>&1 &
queue_b >> runs/st_trainer_len16_b.log 2>&1
wait
