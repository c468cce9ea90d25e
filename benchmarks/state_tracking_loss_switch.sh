#!/bin/sh
# docs/results.md, "The paper loss, then the last pass": the state-tracking FBT trained for 2000 steps with
# the paper's loss (Eq. 12) for the first half and the loss on the exact-recurrence pass alone for the second
# (train.last_pass_loss_from=0.5), every task, seeds 0 1 2. Every call resumes (finished triples are skipped):
#   nohup sh benchmarks/state_tracking_loss_switch.sh > runs/st_loss_switch.log 2>&1 &
set -e
D=benchmarks/results/explore
run() { python benchmarks/state_tracking.py --threads 1 --plot "" --models fbt --steps 2000 \
    --set train.last_pass_loss_from=0.5 --out $D/loss_switch_2000.jsonl "$@"; }
run --tasks cycle,parity,s5,summod,flipflop,s3 --seeds 0
run --tasks cycle,parity,s5,summod,flipflop,s3 --seeds 1 2
