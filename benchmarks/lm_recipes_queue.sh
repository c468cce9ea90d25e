#!/bin/sh
# The language-modelling recipe runs of docs/results.md, in the order they were made (resumable: every call
# skips the (arm, seed) pairs already in benchmarks/results/lm_recipes.jsonl). From the repository root:
#   nohup sh benchmarks/lm_recipes_queue.sh > runs/lm_recipes.log 2>&1 &
# (The runs were made in two single-threaded lanes; the baseline's seeds 1 and 2 were taken from
# benchmarks/results/compare_seeds.json, same preset and seeds: its seed 0 rerun here matched in every digit.)
set -e
run() { OMP_NUM_THREADS=1 python benchmarks/lm_recipes.py --plot "" "$@"; }
run --arms baseline,fbt,fbt_7525
OMP_NUM_THREADS=1 python benchmarks/contraction.py --arms fbt,fbt_7525
run --arms baseline@1.25,baseline@1.5,baseline@2
run --arms fbt_ramp,fbt_fusion_lr3,fbt_warmup
run --arms fbt_from0,fbt_from50
run --arms baseline@2,fbt_from50,baseline@1.5 --seeds 1 2
run --arms fbt_concat,fbt_add
run --arms baseline@3
run --arms fbt_from25    # made later, on another machine of the same kind
python benchmarks/lm_recipes.py --summary-only --plot-arms fbt,fbt_from0,fbt_from25,fbt_from50
# the 20M-token runs with validation curves: benchmarks/lm_long.sh
