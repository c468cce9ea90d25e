#!/bin/sh
# docs/results.md, "The baseline with the FBT's own window": the standard transformer with the preset's
# 4-token sliding window (the FBT's architecture without the feedback; --models baseline_window) on the
# batches of len16_4000.jsonl (1..16 moves, 4000 steps, the preset's settings), flip-flop first, 3 seeds.
# Every call resumes (finished task/seed/model triples are skipped):
#   nohup sh benchmarks/state_tracking_baseline_window.sh > runs/st_baseline_window.log 2>&1 &
set -e
OUT=benchmarks/results/explore/len16_4000_baseline_window.jsonl
PY=${PYTHON:-python}
for task in flipflop parity summod cycle s3 s5; do
    $PY benchmarks/state_tracking.py --threads 1 --plot "" --set train.pass_loss=last --set model.gate_init_std=0.2 \
        --steps 4000 --models baseline_window --train-len 16 --tasks $task --out $OUT
done
