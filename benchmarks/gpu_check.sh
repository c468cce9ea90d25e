#!/usr/bin/env bash
# GPU readiness check: on a machine with one CUDA GPU, in under 8 minutes and without network, runs
#   1. the core equivalence tests on the GPU, in float32 and in bf16 (FULLBAND_TEST_DEVICE=cuda),
#   2. ~125M-parameter training throughput, baseline and FBT K = 1, 2, 3, bf16 autocast, eager and
#      torch.compile: tokens/s, MFU (H200 dense bf16 peak, 989 TFLOP/s), peak memory, K2/K1 and K3/K1,
#   3. benchmarks/decode.py on the GPU (batch 1, 8, 64) and fullband against Hugging Face generate,
#   4. two processes on the one GPU: NCCL, then DDP and FSDP2 steps (or why they cannot run),
# and writes every figure to $OUT/gpu_check.json and $OUT/gpu_check.md (default benchmarks/results/gpu).
# Without CUDA it says so and exits 0. Each part has its own time limit, so one that hangs or fails does
# not stop the others; its failure is recorded in the report.
#
#   bash benchmarks/gpu_check.sh              # PYTHON=... to choose the interpreter
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}"
OUT="${OUT:-benchmarks/results/gpu}"

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: this check needs a CUDA GPU and none is available here (torch.cuda.is_available() is False);"
    echo "nothing to do. Run it on a machine with one GPU: bash benchmarks/gpu_check.sh"
    exit 0
fi
mkdir -p "$OUT"
started=$(date +%s)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"

# record NAME EXIT_CODE LOG: a JSON file with the exit code and the last lines of a part's output
record() {
    "$PY" - "$OUT/$1.json" "$2" "$3" <<'EOF'
import json, sys
path, code, log = sys.argv[1], int(sys.argv[2]), open(sys.argv[3], errors="replace").read().splitlines()
tail = [line for line in log if line.strip()][-15:]
json.dump({"exit_code": code, "timed_out": code == 124, "summary": tail[-1] if tail else "", "tail": tail},
          open(path, "w"), indent=1)
EOF
}

echo "== info"
"$PY" benchmarks/gpu_check.py info --out "$OUT"

TESTS="tests/test_model.py tests/test_generation.py tests/test_train.py"
SELECT="soft_decoding_matches or standard_decoding_matches or fused_decoding_matches or batched_ragged or multipass_converges or resume_is_bitwise"
for variant in float32 bf16; do
    echo "== equivalence tests on cuda, $variant"
    dtype=$([ "$variant" = bf16 ] && echo bfloat16 || echo float32)
    FULLBAND_TEST_DEVICE=cuda FULLBAND_TEST_DTYPE=$dtype timeout 100 "$PY" -m pytest -q -p no:cacheprovider \
        $TESTS -k "$SELECT" > "$OUT/tests_$variant.log" 2>&1
    code=$?
    tail -3 "$OUT/tests_$variant.log"
    record "tests_$variant" $code "$OUT/tests_$variant.log"
done

echo "== training throughput (~125M parameters)"
timeout 210 "$PY" benchmarks/gpu_check.py train --steps 60 --warmup 8 --out "$OUT" > "$OUT/train.log" 2>&1
code=$?
tail -2 "$OUT/train.log"
[ -f "$OUT/train.json" ] || record train_failed $code "$OUT/train.log"

echo "== benchmarks/decode.py"
timeout 70 "$PY" benchmarks/decode.py --device cuda --dtype bfloat16 --batch 1 8 64 --repeats 3 --models d512-L6 \
    --out "$OUT/decode.json" > "$OUT/decode.log" 2>&1
code=$?
tail -2 "$OUT/decode.log"
[ -f "$OUT/decode.json" ] || record decode_failed $code "$OUT/decode.log"

echo "== fullband vs Hugging Face generate"
timeout 60 "$PY" benchmarks/gpu_check.py hf --out "$OUT" > "$OUT/hf.log" 2>&1
code=$?
tail -2 "$OUT/hf.log"
[ -f "$OUT/hf.json" ] || record hf_failed $code "$OUT/hf.log"

echo "== two processes on one GPU (NCCL, DDP, FSDP2)"
timeout 60 "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/gpu_check.py dist-worker \
    --out "$OUT" > "$OUT/dist.log" 2>&1
code=$?
tail -2 "$OUT/dist.log"
[ -f "$OUT/dist.json" ] || record dist_failed $code "$OUT/dist.log"

echo "== report"
"$PY" benchmarks/gpu_check.py report --out "$OUT"
echo "gpu_check: $(( $(date +%s) - started )) s; results in $OUT/gpu_check.json and $OUT/gpu_check.md"
