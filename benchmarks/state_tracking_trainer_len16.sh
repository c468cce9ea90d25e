#!/bin/sh
# docs/results.md, "The preset through the trainer at L = 16": the preset as it is (4000 steps, the model of the
# best validation kept in OUT/best) through `fullband train --config state-tracking` on exported records of
# 1..16 moves of every task, graded by `fullband bench OUT/best --modes standard,fused:auto` at 16, 32, 64 and
# 128 moves (benchmarks/state_tracking_trainer.sh with MOVES=16), seeds 0, 1 and 2 of every task.
# Two queues side by side, one per core (OMP_NUM_THREADS=1). Every call resumes: a run already in
# benchmarks/results/state_tracking_trainer/len16.json or graded at 128 moves is skipped, one with a run
# directory but no grade continues with --resume; each graded run is merged into that JSON (and its plot) at once,
# so what finished survives the run directories (runs/ is not committed).
#   nohup sh benchmarks/state_tracking_trainer_len16.sh > runs/st_trainer_len16.log 2>&1 &
set -e
export MOVES=16 OMP_NUM_THREADS=1
PY=${PYTHON:-.venv/bin/python}
run() {  # TASK SEED
    out=runs/st_trainer_$1_s$2_len16
    if "$PY" benchmarks/state_tracking_trainer_table.py --has "$1" "$2"; then return 0; fi
    if [ ! -f "$out/bench128/results.json" ]; then
        if [ -f "$out/config.yaml" ]; then set -- "$1" "$2" "$out" --resume; else set -- "$1" "$2" "$out"; fi
        echo "== $1 seed $2 ($(date -u +%H:%M:%S))"
        bash benchmarks/state_tracking_trainer.sh "$@"
    fi
    flock runs/st_trainer_len16.lock "$PY" benchmarks/state_tracking_trainer_table.py > /dev/null
}
queue_a() { for t in s5 flipflop parity summod cycle s3; do run "$t" 0; run "$t" 1; done; }
queue_b() { for t in s5 flipflop parity summod cycle s3; do run "$t" 2; done; }
mkdir -p runs
queue_a >> runs/st_trainer_len16_a.log 2>&1 &
queue_b >> runs/st_trainer_len16_b.log 2>&1
wait
