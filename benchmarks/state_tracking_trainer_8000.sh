#!/bin/sh
# docs/results.md, "S5 with twice the steps through the trainer": the preset with `--train.tokens 8192000`
# (8000 steps; the curriculum and the learning-rate decay stretch with the run) and twice the records (520,000:
# no window repeats) on 1..16 moves, graded like the preset's runs (benchmarks/state_tracking_trainer.sh,
# MOVES=16). S5 seeds 0, 1 and 2 first (the question: does S5 reach 0.90 at 8x L with twice the steps?), then
# seeds 0, 1 and 2 of the other tasks (can 8000 steps be the preset's default for every task?); about 80 min a
# run on one core. Through the resumable queue of benchmarks/state_tracking_trainer_queue.sh (into
# benchmarks/results/state_tracking_trainer/len16_8000.json and docs/state_tracking_trainer_len16_8000.png).
#   nohup sh benchmarks/state_tracking_trainer_8000.sh > runs/st_trainer_8000.log 2>&1 &
#   python benchmarks/state_tracking_trainer_table.py --label len16_8000 --from-json
RECORDS=520000 LABEL=len16_8000 JOBS="s5:0 s5:1 s5:2 parity:0 summod:0 flipflop:0 cycle:0 s3:0 parity:1 summod:1
flipflop:1 cycle:1 s3:1 parity:2 summod:2 flipflop:2 cycle:2 s3:2" \
    exec sh benchmarks/state_tracking_trainer_queue.sh --train.tokens 8192000
