#!/bin/sh
# Controls for the 2000-step state-tracking tables of docs/results.md, and the preset through the trainer.
# Resumable (finished task/seed/model triples are skipped; a finished trainer run is skipped):
#   nohup sh benchmarks/state_tracking_controls.sh > runs/st_controls.log 2>&1 &
set -e
D=benchmarks/results/explore
st() { python benchmarks/state_tracking.py --threads 1 --plot "" --steps 2000 "$@"; }
trainer() {  # the `state-tracking` preset through `fullband train` / `fullband bench` (2000 steps)
    [ -f "runs/st_trainer_$1_s$2/bench64/results.json" ] || OMP_NUM_THREADS=1 bash benchmarks/state_tracking_trainer.sh "$1" "$2"
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
