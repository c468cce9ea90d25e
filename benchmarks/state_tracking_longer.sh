#!/bin/sh
# docs/results.md, "Where the preset stops" and "S5 on 1..16 moves at 4000 steps": the `state-tracking`
# preset's settings (train.pass_loss=last, model.gate_init_std=0.2) for 4000 steps instead of 2000, first
# where the 2000-step runs fell short of the goal (sum mod 5 seed 2, S5), then on every task, then with
# training prompts of 1..16 moves.
# Every call resumes (finished task/seed/model triples are skipped):
#   nohup sh benchmarks/state_tracking_longer.sh > runs/st_longer.log 2>&1 &
set -e
D=benchmarks/results/explore
PY=${PYTHON:-python}
run() { $PY benchmarks/state_tracking.py --threads 1 --plot "" --set train.pass_loss=last --set model.gate_init_std=0.2 "$@"; }
run --steps 4000 --models fbt --tasks summod --seeds 2 --out $D/last_gate_init0.2_4000.jsonl
run --steps 4000 --models fbt --tasks s5 --seeds 0 1 2 --out $D/last_gate_init0.2_4000.jsonl
# S3 at 2000 steps again, its weights kept (benchmarks/state_drift.py compares the states of a group the
# recurrence holds with those of S5); the accuracies must equal those of last_gate_init0.2_2000.jsonl.
run --steps 2000 --models fbt --tasks s3 --seeds 0 1 2 --out $D/last_gate_init0.2_2000_saved.jsonl
# Candidate for the preset's budget: the other tasks and seeds at 4000 steps, so that one setting is
# measured on every task (cycle first: the task that leaked under every earlier recipe).
for task in cycle parity flipflop s3; do
    run --steps 4000 --models fbt --tasks $task --seeds 0 1 2 --out $D/last_gate_init0.2_4000.jsonl
done
run --steps 4000 --models fbt --tasks summod --seeds 0 1 --out $D/last_gate_init0.2_4000.jsonl
# The preset's budget since then (4000 steps): the baseline transformer on the same batches (equal tokens).
run --steps 4000 --models baseline --tasks parity,cycle,summod,flipflop,s5,s3 --seeds 0 1 2 --out $D/last_gate_init0.2_4000.jsonl
# S5 with both changes that carried it further (docs/results.md, "Against S5's drift"): training prompts of
# 1..16 moves and the preset's 4000 steps, tested at 16/32/64/128 moves.
run --steps 4000 --models fbt --tasks s5 --seeds 0 1 2 --train-len 16 --out $D/s5_len16_4000.jsonl
# The other tasks the same way (1..16 moves, 4000 steps), and the baseline on the same batches (equal tokens).
run --steps 4000 --models baseline --tasks parity,cycle,summod,flipflop,s5,s3 --seeds 0 1 2 --train-len 16 --out $D/len16_4000.jsonl
for seed in 0 1 2; do
    run --steps 4000 --models fbt --tasks summod,cycle,s3,parity,flipflop --seeds $seed --train-len 16 --out $D/len16_4000.jsonl
done
# The baseline at the FBT's token-equivalent compute (4000 x the FBT's mean passes steps), where the equal-token
# baseline is weakest (S5) and strongest (flip-flop), seed 0.
run --steps 4000 --models baseline_compute --tasks s5 --seeds 0 --train-len 16 --out $D/s5_len16_4000.jsonl
run --steps 4000 --models baseline_compute --tasks flipflop --seeds 0 --train-len 16 --out $D/len16_4000.jsonl
