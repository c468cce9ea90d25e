#!/bin/sh
# docs/results.md, "The paper loss, then the last pass": the state-tracking FBT trained for 2000 steps with
# the paper's loss (Eq. 12) first and the loss on the exact-recurrence pass alone from a fraction of the steps
# on (train.last_pass_loss_from). Every call resumes (finished task/seed/model triples are skipped):
#   nohup sh benchmarks/state_tracking_loss_switch.sh > runs/st_loss_switch.log 2>&1 &
set -e
D=benchmarks/results/explore
run() { F=$1; shift; python benchmarks/state_tracking.py --threads 1 --plot "" --models fbt --steps 2000 \
    --set train.last_pass_loss_from=$F --out $D/loss_switch_$F.jsonl "$@"; }
run 0.5 --tasks cycle,parity,s5 --seeds 0
run 0.15 --tasks cycle,parity,s5 --seeds 0
run 0.15 --tasks parity,summod,flipflop,cycle --seeds 1
