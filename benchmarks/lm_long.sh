#!/bin/sh
# The longest language-modelling budget of docs/results.md: the `cpu` preset's model trained on 20M tokens
# (8.3× the preset; ~1 epoch of a 24 MB slice of the built-in corpus), evaluated every 610 steps on the same
# validation windows. Resumable (checkpoints every 610 steps; finished (arm, seed) pairs are skipped):
#   nohup sh benchmarks/lm_long.sh > runs/lm_long.log 2>&1 &
#   sh benchmarks/lm_long.sh 1      # seed 1 (default 0)
#   ARMS=baseline@1.28,baseline@2.12 sh benchmarks/lm_long.sh   # baselines at the FBT arms' compute
set -e
SEED=${1:-0}
ARMS=${ARMS:-baseline,fbt_from0,fbt}
OMP_NUM_THREADS=1 python benchmarks/lm_recipes.py --arms "$ARMS" --seeds "$SEED" \
    --out benchmarks/results/lm_long.jsonl --work-dir runs/lm_long --plot "" --curve-plot docs/lm_long.png \
    --set data.max_train_bytes=24000000 --set train.tokens=20000000 --set train.eval_every=610 \
    --set train.ckpt_every=610 --set eval.batches=16
