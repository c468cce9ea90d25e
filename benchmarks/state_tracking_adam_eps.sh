#!/bin/sh
# docs/results.md, "Cycle navigation's collapse, seed 0 again": AdamW epsilon 1e-5 (for 1e-8) removed the
# loss jump of cycle navigation seed 0 on 1..16 moves. Before it can enter a preset it must hold on every
# task and seed: the same L = 16, 4000-step FBT runs as len16_4000.jsonl with only train.adam_eps changed,
# S5 and cycle navigation first, then the rest (cycle seed 0 and sum mod 5 seed 2 are in the same file
# from benchmarks/state_tracking_cycle_stability.sh). Two queues run side by side, one per core.
# Every call resumes (finished task/seed/model triples are skipped):
#   nohup sh benchmarks/state_tracking_adam_eps.sh > runs/st_adam_eps.log 2>&1 &
set -e
D=benchmarks/results/explore
PY=${PYTHON:-python}
run() { $PY benchmarks/state_tracking.py --threads 1 --plot "" --set train.pass_loss=last --set model.gate_init_std=0.2 \
        --set train.adam_eps=1e-5 --steps 4000 --models fbt --train-len 16 --out $D/len16_4000_eps1e-5.jsonl "$@"; }
queue_a() {
    run --tasks s5 --seeds 0 && run --tasks s5 --seeds 2 && run --tasks cycle --seeds 2 \
        && run --tasks parity --seeds 0 && run --tasks parity --seeds 2 && run --tasks flipflop --seeds 1 \
        && run --tasks s3 --seeds 0 && run --tasks s3 --seeds 2
}
queue_b() {
    run --tasks s5 --seeds 1 && run --tasks cycle --seeds 1 && run --tasks summod --seeds 0 \
        && run --tasks summod --seeds 1 && run --tasks parity --seeds 1 && run --tasks flipflop --seeds 0 \
        && run --tasks flipflop --seeds 2 && run --tasks s3 --seeds 1
}
queue_a &
queue_b
wait
