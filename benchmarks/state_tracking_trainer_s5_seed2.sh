#!/bin/sh
# docs/results.md, "S5's slowest seed through the trainer: what moves it (one change each), and the wider
# model in 3 seeds": S5 seed 2 (the seed below 0.90 at 8x L
# with 4000 and 8000 steps) through the preset with one change each, graded like the preset's runs, through the
# resumable queue of benchmarks/state_tracking_trainer_queue.sh (one JSON per change under
# benchmarks/results/state_tracking_trainer/), one after the other: about 30 (decay), 70 (width) and 100 (12000
# steps) minutes of one core with the other core busy (docs/results.md ran them two at a time, by hand):
#   nohup sh benchmarks/state_tracking_trainer_s5_seed2.sh > runs/st_s5_seed2.log 2>&1 &
#   python benchmarks/state_tracking_trainer_table.py --label len16_decay05 --from-json   # (and the others)
set -e
q() { sh benchmarks/state_tracking_trainer_queue.sh "$@"; }
# the learning-rate decay over the last half of the steps instead of the last quarter (same steps)
LABEL=len16_decay05 JOBS="s5:2" q --train.decay_fraction 0.5
# a wider model (d_model 128, d_ff 256 for 64, 128; 2.5-2.9x the time per step here)
LABEL=len16_d128 JOBS="s5:2" q --model.d_model 128 --model.d_ff 256
# three times the preset's steps (12000; the curriculum and the decay stretch with the run; no window repeats)
RECORDS=780000 LABEL=len16_12000 JOBS="s5:2" q --train.tokens 12288000
# the wider model on the other two seeds (two lanes), into the same JSON as its seed 2
LABEL=len16_d128 JOBS="s5:0 s5:1" q --model.d_model 128 --model.d_ff 256
