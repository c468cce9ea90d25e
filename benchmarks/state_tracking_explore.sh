#!/bin/sh
# Follow-up runs of docs/results.md ("Why cycle, sum mod 5, S3 and S5 stop"): the FBT of the state-tracking
# benchmark with one change each, seed 0 unless said (every call resumes: finished triples are skipped).
# From the repository root:  nohup sh benchmarks/state_tracking_explore.sh > runs/st_explore.log 2>&1 &
set -e
# The preset's settings when these runs were made (before "A wider gate at init", docs/results.md):
# the paper loss (Eq. 12) and W_G initialised like every other matrix.
EARLIER="--set train.pass_loss=paper --set model.gate_init_std=none"
D=benchmarks/results/explore
run() { python benchmarks/state_tracking.py --threads 1 $EARLIER --plot "" --models fbt "$@"; }
# A longer budget: 2000 steps instead of 600.
run --tasks summod,cycle,s5,s3 --seeds 0 --steps 2000 --out $D/steps2000.jsonl
run --tasks s5,summod --seeds 1 2 --steps 2000 --out $D/steps2000.jsonl
run --tasks s3,cycle --seeds 1 2 --steps 2000 --out $D/steps2000.jsonl
# The baseline transformer at the same 2000 steps (equal tokens).
python benchmarks/state_tracking.py --threads 1 $EARLIER --plot "" --models baseline --tasks summod,s3,s5,cycle --seeds 0 1 2 \
    --steps 2000 --out $D/steps2000.jsonl
run --tasks parity,flipflop --seeds 0 --steps 2000 --out $D/steps2000.jsonl
# One change each, cycle navigation, 600 steps.
run --tasks summod,cycle --seeds 0 --set model.feedback_jitter=0.1 --out $D/jitter0.1.jsonl
run --tasks cycle --seeds 0 --set model.sliding_window=1 --out $D/cycle_window1.jsonl
run --tasks cycle --seeds 0 --set model.sliding_window=2 --out $D/cycle_window2.jsonl
run --tasks cycle --seeds 0 --set model.fusion=add --out $D/cycle_fusion_add.jsonl
run --tasks cycle --seeds 0 --set model.fusion=concat --out $D/cycle_fusion_concat.jsonl
run --tasks cycle --seeds 0 --set model.d_model=128 --set model.d_ff=256 --out $D/cycle_d128.jsonl
run --tasks cycle --seeds 0 --train-len 16 --out $D/cycle_len16.jsonl
run --tasks cycle --seeds 0 --set train.weight_decay=0.1 --out $D/cycle_wd0.1.jsonl
run --tasks cycle --seeds 0 --steps 2000 --set model.d_model=128 --set model.d_ff=256 --out $D/cycle_d128_steps2000.jsonl
run --tasks cycle --seeds 0 --out $D/cycle_default.jsonl  # the preset unchanged, with the hold test
run --tasks cycle --seeds 0 --set model.feedback_jitter=0.5 --out $D/cycle_jitter0.5.jsonl
run --tasks cycle --seeds 0 --set model.feedback_jitter=1.0 --out $D/cycle_jitter1.0.jsonl
# The same tasks on 3 states instead of 5 (rotations of order 3), 600 and 2000 steps.
run --tasks "cycle:size=3,summod:modulus=3" --seeds 0 --out $D/z3.jsonl
run --tasks "cycle:size=3" --seeds 1 2 --out $D/z3.jsonl
run --tasks "cycle:size=3,summod:modulus=3" --seeds 0 --steps 2000 --out $D/z3_steps2000.jsonl
