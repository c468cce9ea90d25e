#!/usr/bin/env bash
# Grade a finished run of benchmarks/state_tracking_trainer.sh at 1, 2, 4 and 8 x MOVES moves: exact match in
# standard mode (one plain pass) and fused:auto (run to the exact recurrence, up to 1024 passes, no tolerance),
# of OUT_DIR/best (the preset's model of the best validation) or, without one, the last checkpoint. Each
# length's 200 held-out records are exported to OUT_DIR.data/valN.jsonl once (seed 10,000 + N: the same rows for
# every seed of a task); a length already graded (OUT_DIR/benchN/results.json) is skipped, so it resumes.
#   MOVES=16 bash benchmarks/state_tracking_trainer_bench.sh TASK OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
TASK=$1
OUT=$2
MOVES=${MOVES:-8}
DATA=$OUT.data
PY=${PYTHON:-.venv/bin/python}
MODEL=$OUT  # the last checkpoint; the preset's best-validation model where the run kept one (train.keep_best)
if [ -d "$OUT/best" ]; then MODEL=$OUT/best; fi
for moves in "$MOVES" $(( 2 * MOVES )) $(( 4 * MOVES )) $(( 8 * MOVES )); do
    if [ -f "$OUT/bench$moves/results.json" ]; then continue; fi
    if [ ! -f "$DATA/val$moves.jsonl" ]; then
        "$PY" -c "import sys; from pathlib import Path
from fullband.data.synthetic import export_jsonl, state_tracking_task
task, moves, path = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
export_jsonl(state_tracking_task(task, moves, moves), path, 200, seed=10_000 + moves)" "$TASK" "$moves" "$DATA/val$moves.jsonl"
    fi
    start=$(date +%s)
    "$PY" -m fullband bench "$MODEL" --task "jsonl:$DATA/val$moves.jsonl" --modes standard,fused:auto \
        --fused-max-passes 1024 --fused-tol 0 --out "$OUT/bench$moves" --no-progress --no-plots
    echo "bench $moves moves: $(( $(date +%s) - start )) s"  # the table above is $OUT/bench$moves/results.md
done
