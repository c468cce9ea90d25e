#!/bin/sh
# Controls for the 2000-step state-tracking tables of docs/results.md, and the preset through the trainer.
# Resumable (finished task/seed/model triples are skipped; a finished trainer run is skipped):
#   nohup sh benchmarks/state_tracking_controls.sh > runs/st_controls.log 2>&1 &
set -e
# The preset's settings when these runs were made (before "A wider gate at init", docs/results.md):
# the paper loss (Eq. 12) and W_G initialised like every other matrix.
EARLIER="--set train.pass_loss=paper --set model.gate_init_std=none"
D=benchmarks/results/explore
st() { python benchmarks/state_tracking.py --threads 1 $EARLIER --plot "" --steps 2000 "$@"; }
trainer() {  # the `state-tracking` preset (its settings then) through `fullband train` / `fullband bench`
    [ -f "runs/st_trainer_$1_s$2/bench64/results.json" ] || OMP_NUM_THREADS=1 bash benchmarks/state_tracking_trainer.sh \
        "$1" "$2" "runs/st_trainer_$1_s$2" --train.pass_loss paper --model.gate_init_std none
}
# (a) The written-trace control: the answer lists the state after every move, then `=> final`; graded on the
#     whole answer (greedy decoding reproduces it). The standard transformer only (full attention).
st --models baseline --seeds 0 1 2 --out $D/trace_control.jsonl \
    --tasks "parity:trace=true,summod:trace=true,flipflop:trace=true,cycle:trace=true,s3:trace=true,s5:trace=true"
# (b) The preset through the trainer: one task where the recurrence holds to 8×, one where it leaks.
trainer s3 0
trainer cycle 0
# (c) The standard transformer at the FBT's token-equivalent compute (2000 × the FBT's mean passes steps), where
#     the FBT's recurrence holds to 8× (S3, sum mod 5), then where it does not (cycle, S5).
st --models baseline_compute --tasks s3,summod --seeds 0 1 2 --out $D/steps2000.jsonl
trainer summod 0
trainer parity 0
st --models baseline_compute --tasks cycle,s5 --seeds 0 --out $D/steps2000.jsonl
trainer flipflop 0
trainer s5 0
