#!/bin/sh
# docs/results.md, "AdamW epsilon 1e-5 at L = 16, every task": AdamW epsilon 1e-5 (for 1e-8) removed the
# loss jump of cycle navigation seed 0 on 1..16 moves (benchmarks/state_tracking_cycle_stability.sh, whose
# cycle seed 0 and sum mod 5 seed 2 share the output file). Before it can enter a preset it must hold on
# every task and seed: the FBT runs of len16_4000.jsonl (MOVES=16, the default) or of the preset's own
# last_gate_init0.2_4000.jsonl (MOVES=8) with only train.adam_eps changed, same seeds and batches; S5 and
# cycle navigation first. Two queues run side by side, one per core.
# Every call resumes (finished task/seed/model triples are skipped):
#   nohup sh benchmarks/state_tracking_adam_eps.sh > runs/st_adam_eps.log 2>&1 &
#   MOVES=8 nohup sh benchmarks/state_tracking_adam_eps.sh > runs/st_adam_eps_len8.log 2>&1 &
set -e
D=benchmarks/results/explore
PY=${PYTHON:-python}
MOVES=${MOVES:-16}
case $MOVES in
    16) OUT=$D/len16_4000_eps1e-5.jsonl ;;
    8) OUT=$D/last_gate_init0.2_4000_eps1e-5.jsonl ;;
    *) echo "MOVES must be 16 or 8 (the lengths whose epsilon 1e-8 runs exist), got $MOVES" >&2; exit 2 ;;
esac
run() { $PY benchmarks/state_tracking.py --threads 1 --plot "" --set train.pass_loss=last --set model.gate_init_std=0.2 \
        --set train.adam_eps=1e-5 --steps 4000 --models fbt --train-len $MOVES --out $OUT "$@"; }
queue_a() {
    run --tasks s5 --seeds 0 && run --tasks s5 --seeds 2 && run --tasks cycle --seeds 0 && run --tasks cycle --seeds 2 \
        && run --tasks parity --seeds 0 && run --tasks parity --seeds 2 && run --tasks summod --seeds 2 \
        && run --tasks flipflop --seeds 1 && run --tasks s3 --seeds 0 && run --tasks s3 --seeds 2
}
queue_b() {
    run --tasks s5 --seeds 1 && run --tasks cycle --seeds 1 && run --tasks summod --seeds 0 \
        && run --tasks summod --seeds 1 && run --tasks parity --seeds 1 && run --tasks flipflop --seeds 0 \
        && run --tasks flipflop --seeds 2 && run --tasks s3 --seeds 1
}
queue_a &
queue_b
wait
