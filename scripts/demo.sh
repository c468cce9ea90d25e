#!/usr/bin/env bash
# The main job: set up, then train a small standard transformer and a small FBT on the CPU and compare.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/fullband demo "$@"
