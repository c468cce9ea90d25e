#!/bin/sh
# docs/results.md, "Keeping the best validation checkpoint at L = 16": the FBT runs of len16_4000.jsonl
# (1..16 moves, 4000 steps, the preset's settings, AdamW epsilon 1e-8) again with a validation every 100
# steps on held-out rows of 16 moves and the model of the lowest validation loss kept (--keep best).
# Same seeds and batches, so the training itself is the same run (compare loss_curve). The runs whose loss
# jumped back or sat on a plateau first (cycle navigation seeds 0 and 1, sum mod 5 seed 2, parity seed 1),
# then one seed of every other task, then the rest. Two queues side by side, one per core.
# Every call resumes (finished task/seed/model triples are skipped):
#   nohup sh benchmarks/state_tracking_keep_best.sh > runs/st_keep_best.log 2>&1 &
set -e
OUT=benchmarks/results/explore/len16_4000_keep_best.jsonl
PY=${PYTHON:-python}
run() { $PY benchmarks/state_tracking.py --threads 1 --plot "" --set train.pass_loss=last --set model.gate_init_std=0.2 \
        --steps 4000 --models fbt --train-len 16 --val-every 100 --keep best --out $OUT "$@"; }
queue_a() {
    run --tasks cycle --seeds 0 && run --tasks cycle --seeds 1 && run --tasks s5 --seeds 0 && run --tasks flipflop --seeds 0 \
        && run --tasks s5 --seeds 1 && run --tasks s5 --seeds 2 && run --tasks summod --seeds 1 && run --tasks flipflop --seeds 1 \
        && run --tasks s3 --seeds 2
}
queue_b() {
    run --tasks summod --seeds 2 && run --tasks parity --seeds 1 && run --tasks s3 --seeds 0 && run --tasks parity --seeds 2 \
        && run --tasks cycle --seeds 2 && run --tasks parity --seeds 0 && run --tasks summod --seeds 0 \
        && run --tasks flipflop --seeds 2 && run --tasks s3 --seeds 1
}
queue_a &
queue_b
wait
