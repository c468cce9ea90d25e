#!/usr/bin/env bash
# Set up (with the dev extras), lint, and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=dev bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks experiments
exec .venv/bin/python -m pytest "$@"
