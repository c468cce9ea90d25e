#!/bin/sh
# docs/results.md, "The preset through the trainer at L = 16": the preset as it is (4000 steps, the model of the
# best validation kept in OUT/best) through `fullband train --config state-tracking` on exported records of
# 1..16 moves of every task, graded by `fullband bench OUT/best --modes standard,fused:auto` at 16, 32, 64 and
# 128 moves (benchmarks/state_tracking_trainer.sh with MOVES=16), seeds 0, 1 and 2 of every task, through the
# resumable queue of benchmarks/state_tracking_trainer_queue.sh (into benchmarks/results/state_tracking_trainer/len16.json).
#   nohup sh benchmarks/state_tracking_trainer_len16.sh > runs/st_trainer_len16.log 2>&1 &
LABEL=len16 JOBS="s5:0 s5:1 s5:2 flipflop:0 flipflop:1 flipflop:2 parity:0 parity:1 parity:2 summod:0 summod:1
summod:2 cycle:0 cycle:1 cycle:2 s3:0 s3:1 s3:2" exec sh benchmarks/state_tracking_trainer_queue.sh
