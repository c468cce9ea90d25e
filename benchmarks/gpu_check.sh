#!/usr/bin/env bash
# GPU readiness check: on a machine with one CUDA GPU, without network, runs
#   tests   the core equivalence tests on the GPU, in float32 and in bf16 (FULLBAND_TEST_DEVICE=cuda),
#   train   ~125M-parameter training throughput, baseline and FBT K = 1, 2, 3, bf16 autocast, eager and
#           torch.compile: tokens/s, MFU, peak memory, K2/K1 and K3/K1,
#   exact   the exact-recurrence training step (state-tracking preset, token steps compiled 8 at a time)
#           against one pass of the same model, an LSTM and DeltaProduct (benchmarks/state_tracking_models.py),
#   decode  benchmarks/decode.py (soft/standard/fused per token, batch 1, 8, 64),
#   hf      fullband against Hugging Face generate on the same Llama weights (batch 1, 8, 64),
#   dist    two processes on the one GPU: NCCL (which refuses two ranks on one GPU), then gloo; DDP and FSDP2
#           steps whose ranks must agree,
# and writes every figure to $OUT/gpu_check.json and $OUT/gpu_check.md (default benchmarks/results/gpu).
# Each part has its own time limit (14 minutes in all at most; parts may run in separate calls), so one that
# hangs or fails does not stop the others; its failure is recorded in the report. Without CUDA it says so
# and exits 0.
#
#   bash benchmarks/gpu_check.sh                 # every part; PYTHON=... to choose the interpreter
#   bash benchmarks/gpu_check.sh train exact     # only those parts (the report covers what $OUT holds)
#   bash benchmarks/gpu_check.sh --dry-run       # every part on the CPU at tiny sizes: checks the script
set -u
cd "$(dirname "$0")/.."
ALL_PARTS="tests train exact decode hf dist"
DRY=0
PARTS=""
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) if [[ " $ALL_PARTS " == *" $arg "* ]]; then PARTS="$PARTS $arg"; else
               echo "gpu_check: unknown part '$arg'; choose from: $ALL_PARTS (or --dry-run)" >&2; exit 2; fi ;;
    esac
done
PARTS="${PARTS:-$ALL_PARTS}"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
elif command -v python3 >/dev/null 2>&1; then PY=python3
else PY=python; fi
# a machine where fullband is not installed (a GPU image with torch alone): run it from this checkout
if ! "$PY" -c "import fullband" 2>/dev/null; then
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "gpu_check: $PY cannot import torch; set PYTHON to an interpreter that has it" >&2
    exit 2
fi

if [ $DRY = 1 ]; then
    DEVICE=cpu
    OUT="${OUT:-benchmarks/results/gpu_dry_run}"
elif "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    DEVICE=cuda
    OUT="${OUT:-benchmarks/results/gpu}"
else
    echo "gpu_check: this check needs a CUDA GPU and none is available here (torch.cuda.is_available() is False);"
    echo "nothing to do. Run it on a machine with one GPU: bash benchmarks/gpu_check.sh"
    echo "(bash benchmarks/gpu_check.sh --dry-run runs every part on the CPU at tiny sizes)"
    exit 0
fi
mkdir -p "$OUT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
# limit SECONDS: the part's time limit on a GPU; a dry run gets room for a slow CPU
limit() { if [ $DRY = 1 ]; then echo 300; else echo "$1"; fi; }
# run NAME LIMIT COMMAND...: the command under its time limit, output to $OUT/NAME.log; prints its last lines
run() {
    local name=$1 seconds=$2
    shift 2
    timeout "$(limit "$seconds")" "$@" > "$OUT/$name.log" 2>&1
    code=$?
    tail -3 "$OUT/$name.log"
    return $code
}
# record NAME EXIT_CODE: $OUT/NAME.json with the exit code and the last lines of $OUT/NAME.log (for a part
# that failed before writing its own JSON, NAME is PART_failed and the log is PART.log)
record() {
    "$PY" - "$OUT/$1.json" "$2" "$OUT/${1%_failed}.log" <<'EOF'
import json, sys
path, code, log = sys.argv[1], int(sys.argv[2]), open(sys.argv[3], errors="replace").read().splitlines()
tail = [line for line in log if line.strip()][-15:]
json.dump({"exit_code": code, "timed_out": code == 124, "summary": tail[-1] if tail else "", "tail": tail},
          open(path, "w"), indent=1)
EOF
}
# each part's own JSON, or PART_failed.json when the part ended without writing it
check_written() { [ -f "$OUT/$1.json" ] || record "$1_failed" "$2"; }
wants() { [[ " $PARTS " == *" $1 "* ]]; }
TINY=$([ $DRY = 1 ] && echo --tiny)

echo "== info ($DEVICE; parts:$PARTS)"
"$PY" benchmarks/gpu_check.py info --device $DEVICE --out "$OUT"

if wants tests; then
    TESTS="tests/test_model.py tests/test_generation.py tests/test_train.py"
    SELECT="soft_decoding_matches or standard_decoding_matches or fused_decoding_matches or batched_ragged"
    SELECT="$SELECT or multipass_converges or resume_is_bitwise"
    for variant in float32 bf16; do
        echo "== equivalence tests on $DEVICE, $variant"
        dtype=$([ "$variant" = bf16 ] && echo bfloat16 || echo float32)
        FULLBAND_TEST_DEVICE=$DEVICE FULLBAND_TEST_DTYPE=$dtype run "tests_$variant" 100 \
            "$PY" -m pytest -q -p no:cacheprovider $TESTS -k "$SELECT"
        record "tests_$variant" $?
    done
fi

# part NAME LIMIT TITLE DRY_ARGS GPU_ARGS COMMAND...: a part's command with its arguments for a dry run or a GPU
part() {
    local name=$1 seconds=$2 title=$3 dry_args=$4 gpu_args=$5
    shift 5
    wants "$name" || return 0
    echo "== $title"
    local args
    args=$([ $DRY = 1 ] && echo "$dry_args" || echo "$gpu_args")
    run "$name" "$seconds" "$@" $args
    check_written "$name" $?
}
part train 220 "training throughput (~125M parameters)" "--tiny --no-compile --steps 1 --warmup 0" \
    "--steps 60 --warmup 8" "$PY" benchmarks/gpu_check.py train --device $DEVICE --out "$OUT"
part exact 170 "exact-recurrence training step (compiled) against one pass" "--quick" \
    "--compile-chunk 8 --steps 10 --repeats 3" \
    "$PY" benchmarks/state_tracking_models.py --device $DEVICE --threads 4 --out "$OUT/exact.json"
part decode 80 "benchmarks/decode.py" "--quick --models d128-L2 --batch 1 2" \
    "--dtype bfloat16 --batch 1 8 64 --repeats 3 --models d512-L6" \
    "$PY" benchmarks/decode.py --device $DEVICE --out "$OUT/decode.json"
part hf 70 "fullband vs Hugging Face generate" "--tiny --dtype float32" "" \
    "$PY" benchmarks/gpu_check.py hf --device $DEVICE --out "$OUT"

if wants dist; then
    echo "== two processes on one $DEVICE (DDP, FSDP2)"
    # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"); gloo then runs the same steps on CUDA tensors
    BACKENDS=$([ $DRY = 1 ] && echo gloo || echo "nccl gloo")
    for backend in $BACKENDS; do
        run "dist_$backend" 60 "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 \
            benchmarks/gpu_check.py dist-worker --device $DEVICE $TINY --backend $backend --out "$OUT"
        check_written "dist_$backend" $?
    done
fi

echo "== report"
"$PY" benchmarks/gpu_check.py report --out "$OUT"
