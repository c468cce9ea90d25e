#!/usr/bin/env bash
# The state-tracking recipe of benchmarks/state_tracking.py (length curriculum, K = the exact number of passes
# each batch needs) run through the real trainer: `fullband train --config state-tracking` on exported
# records of 1..MOVES moves of a state-tracking task (MOVES=8 unless set), then exact-match accuracy at 1, 2, 4 and
# 8 x MOVES moves in standard mode (one plain pass) and fused:auto (run to the exact recurrence, up to 1024
# passes, no tolerance), of OUT_DIR/best (the preset's model of the best validation) or, without one, the last
# (benchmarks/state_tracking_trainer_bench.sh).
#   bash benchmarks/state_tracking_trainer.sh [TASK] [SEED] [OUT_DIR] [TRAIN OPTIONS...]
# (default parity 0 runs/st_trainer_TASK_sSEED; further arguments go to `fullband train`, e.g. the preset's
# earlier settings: --train.pass_loss paper --model.gate_init_std none)
# TASK: parity, summod, flipflop, cycle, s3 or s5 (fullband.data.synthetic.STATE_TRACKING_TASKS).
# Train data: RECORDS records (default 260,000), 1-2 per window of 33 tokens: the preset's 4000 steps x 32 windows
# without repeating one (RECORDS=130000 with --train.tokens 2048000: the preset's earlier 2000 steps). Records
# of 16 moves are at most 30 tokens, so MOVES=16 fits the preset's windows as they are. A checkpoint every 500
# steps, so a run stopped part-way continues from its last one with --resume (the checkpoints leave the
# training unchanged).
set -euo pipefail
cd "$(dirname "$0")/.."
TASK=${1:-parity}
SEED=${2:-0}
MOVES=${MOVES:-8}
OUT=${3:-runs/st_trainer_${TASK}_s$SEED}
shift $(( $# < 3 ? $# : 3 ))
DATA=$OUT.data
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$DATA"
"$PY" - "$DATA" "$TASK" "$SEED" "${RECORDS:-260000}" "$MOVES" <<'PYTHON'
import sys
from pathlib import Path

from fullband.data.synthetic import export_jsonl, state_tracking_task

data, task, seed, records, train_moves = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
export_jsonl(state_tracking_task(task, 1, train_moves), data / "train.jsonl", records, seed=seed)
PYTHON
start=$(date +%s)
"$PY" -m fullband train --config state-tracking --data.source "$DATA/train.jsonl" --out-dir "$OUT" \
    --train.seed "$SEED" --train.progress false --train.log_every 50 --train.ckpt_every 500 "$@"
echo "train: $(( $(date +%s) - start )) s"
MOVES=$MOVES bash benchmarks/state_tracking_trainer_bench.sh "$TASK" "$OUT"
