#!/bin/sh
# docs/results.md, "Which passes carry the loss": the state-tracking FBT trained with train.pass_loss=last
# (the loss on the exact-recurrence pass alone) for 2000 steps, every task, seeds 0 1 2, and the baseline
# transformer on the same batches. Every call resumes (finished task/seed/model triples are skipped):
#   nohup sh benchmarks/state_tracking_last_pass.sh > runs/st_last_pass.log 2>&1 &
set -e
# The preset's settings when these runs were made (before "A wider gate at init", docs/results.md):
# the paper loss (Eq. 12) and W_G initialised like every other matrix.
EARLIER="--set train.pass_loss=paper --set model.gate_init_std=none"
D=benchmarks/results/explore
run() { python benchmarks/state_tracking.py --threads 1 $EARLIER --plot "" --steps 2000 --set train.pass_loss=last \
    --out $D/last_pass_2000.jsonl "$@"; }
run --models fbt --tasks s5,cycle,summod,s3,parity,flipflop --seeds 0
run --models fbt --tasks s5,cycle,summod,s3,parity,flipflop --seeds 1 2
run --models baseline --tasks s5,cycle,summod,s3,parity,flipflop --seeds 0 1 2
# The first run (600 steps) and two single changes on S5, seed 0.
python benchmarks/state_tracking.py --threads 1 $EARLIER --plot "" --models fbt --tasks cycle,s5 --seeds 0 \
    --set train.pass_loss=last --out $D/last_pass.jsonl
run --models fbt --tasks s5 --seeds 0 --set model.feedback_jitter=0.1 --out $D/last_pass_s5_jitter0.1.jsonl
run --models fbt --tasks s5 --seeds 0 --set model.d_model=128 --set model.d_ff=256 --out $D/last_pass_s5_d128.jsonl
# The paper loss plus the last pass (train.pass_loss=paper+last) on the seeds where each loss alone failed.
both() { python benchmarks/state_tracking.py --threads 1 $EARLIER --plot "" --models fbt --steps 2000 \
    --set train.pass_loss=paper+last "$@"; }
both --tasks parity --seeds 1 --out $D/paper_plus_last_2000.jsonl
both --tasks summod --seeds 0 --out $D/paper_plus_last_2000.jsonl
both --tasks cycle --seeds 2 --out $D/paper_plus_last_2000b.jsonl
both --tasks s5 --seeds 0 --out $D/paper_plus_last_2000b.jsonl
