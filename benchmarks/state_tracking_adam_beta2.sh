#!/bin/sh
# docs/results.md, "Cycle navigation's collapse, seed 0 again": the hypothesis there is that the loss jumps
# out of zero-loss stretches because AdamW's second-moment estimate (beta2 0.95) forgets the last real
# gradient within tens of steps, after which each coordinate moves by about the learning rate per step on
# gradient noise. AdamW epsilon 1e-5 removed the jump but cost S5 some accuracy at 8x L; a longer memory
# (beta2 0.999, epsilon 1e-8 as in the preset) tests the same hypothesis from the other side, on the failing
# cycle-navigation seed and on S5 (the same L = 16, 4000-step runs as len16_4000.jsonl otherwise).
# Every call resumes (finished task/seed/model triples are skipped):
#   nohup sh benchmarks/state_tracking_adam_beta2.sh > runs/st_adam_beta2.log 2>&1 &
set -e
D=benchmarks/results/explore
PY=${PYTHON:-python}
run() { $PY benchmarks/state_tracking.py --threads 1 --plot "" --set train.pass_loss=last --set model.gate_init_std=0.2 \
        --set train.beta2=0.999 --steps 4000 --models fbt --train-len 16 --out $D/len16_4000_beta2_0.999.jsonl "$@"; }
run --tasks cycle --seeds 0 &
run --tasks s5 --seeds 0
wait
