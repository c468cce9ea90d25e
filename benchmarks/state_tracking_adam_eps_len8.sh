#!/bin/sh
# docs/results.md, "AdamW epsilon 1e-5 on every task at L = 16": before the state-tracking preset's AdamW
# epsilon can change from 1e-8 to 1e-5, the preset's own runs on 1..8 moves (last_gate_init0.2_4000.jsonl:
# 4000 steps, every task 1.00 at 8x L except S5, 0.49 +- 0.08) again with only train.adam_eps changed, same
# seeds and batches. Two queues run side by side, one per core.
# Every call resumes (finished task/seed/model triples are skipped):
#   nohup sh benchmarks/state_tracking_adam_eps_len8.sh > runs/st_adam_eps_len8.log 2>&1 &
set -e
D=benchmarks/results/explore
PY=${PYTHON:-python}
run() { $PY benchmarks/state_tracking.py --threads 1 --plot "" --set train.pass_loss=last --set model.gate_init_std=0.2 \
        --set train.adam_eps=1e-5 --steps 4000 --models fbt --out $D/last_gate_init0.2_4000_eps1e-5.jsonl "$@"; }
queue_a() {
    run --tasks s5 --seeds 0 && run --tasks s5 --seeds 2 && run --tasks summod --seeds 1 && run --tasks parity --seeds 0 \
        && run --tasks parity --seeds 2 && run --tasks flipflop --seeds 1 && run --tasks s3 --seeds 0 && run --tasks s3 --seeds 2 \
        && run --tasks cycle --seeds 1
}
queue_b() {
    run --tasks s5 --seeds 1 && run --tasks cycle --seeds 0 && run --tasks summod --seeds 0 && run --tasks summod --seeds 2 \
        && run --tasks parity --seeds 1 && run --tasks flipflop --seeds 0 && run --tasks flipflop --seeds 2 && run --tasks s3 --seeds 1 \
        && run --tasks cycle --seeds 2
}
queue_a &
queue_b
wait
