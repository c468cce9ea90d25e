#!/bin/sh
# The order in which the state-tracking results of docs/results.md were produced (resumable: every
# call skips the task/seed/model triples already in the JSONL). Run from the repository root:
#   nohup sh benchmarks/state_tracking_queue.sh > runs/state_tracking.log 2>&1 &
set -e
# The preset's settings when these runs were made (before "A wider gate at init", docs/results.md):
# the paper loss (Eq. 12) and W_G initialised like every other matrix.
EARLIER="--set train.pass_loss=paper --set model.gate_init_std=none"
run() { python benchmarks/state_tracking.py --threads 1 $EARLIER --plot "" "$@"; }
run --tasks parity --seeds 0 1 2 --models fbt,baseline
run --tasks parity --seeds 0 --models baseline_compute
run --tasks flipflop,cycle,summod,s3,s5 --seeds 0 --models fbt,baseline
run --tasks parity --seeds 1 2 --models baseline_compute
run --tasks flipflop,cycle,summod,s3,s5 --seeds 1 2 --models fbt,baseline
run --tasks flipflop,cycle,summod,s3,s5 --seeds 0 1 2 --models baseline_compute
python benchmarks/state_tracking.py --summary-only
