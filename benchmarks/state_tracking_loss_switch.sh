#!/bin/sh
# docs/results.md, "The paper loss first, or the plain pass and the last": the state-tracking FBT trained for
# 2000 steps with (a) the paper's loss (Eq. 12) first and the loss on the exact-recurrence pass alone from a
# fraction of the steps on (train.last_pass_loss_from), (b) the plain pass's and the last pass's losses
# only (train.pass_loss=first+last), (c) (b) then the last pass alone, first on the tasks and seeds where one
# loss alone failed. Every call resumes (finished task/seed/model triples are skipped):
#   nohup sh benchmarks/state_tracking_loss_switch.sh > runs/st_loss_switch.log 2>&1 &
set -e
# The preset's settings when these runs were made (before "A wider gate at init", docs/results.md):
# the paper loss (Eq. 12) and W_G initialised like every other matrix.
EARLIER="--set train.pass_loss=paper --set model.gate_init_std=none"
D=benchmarks/results/explore
st() { python benchmarks/state_tracking.py --threads 1 $EARLIER --plot "" --models fbt --steps 2000 "$@"; }
switch() { F=$1; shift; st --set train.last_pass_loss_from=$F --out $D/loss_switch_$F.jsonl "$@"; }
switch 0.5 --tasks cycle,parity,s5 --seeds 0
switch 0.15 --tasks cycle,parity,s5 --seeds 0
switch 0.15 --tasks parity,summod,flipflop,cycle --seeds 1
ends() { st --set train.pass_loss=first+last --out $D/first_plus_last.jsonl "$@"; }
ends --tasks summod --seeds 1
ends --tasks cycle --seeds 0
ends --tasks parity,flipflop --seeds 1
# (c) first+last for the first half, then the last pass alone.
ends_then_last() { st --set train.pass_loss=first+last --set train.last_pass_loss_from=0.5 \
    --out $D/first_plus_last_then_last.jsonl "$@"; }
ends_then_last --tasks cycle --seeds 0
ends_then_last --tasks summod --seeds 1
# (b) on every task and seed.
ends --tasks s5,cycle,summod --seeds 0
ends --tasks cycle --seeds 2
ends --tasks s5,cycle,summod,s3,parity,flipflop --seeds 0 1 2
