#!/usr/bin/env bash
# The main job: set up, then train a small standard transformer and a small FBT on the CPU and compare.
set -euo pipefail
cd "$(dirname "$0")/.."
# The demo needs only the plot extra; `EXTRAS=all bash scripts/setup.sh` installs everything.
EXTRAS="${EXTRAS:-plot}" bash scripts/setup.sh
exec .venv/bin/fullband demo "$@"
