#!/usr/bin/env bash
# Set up (with the dev extras), lint, and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=dev bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks experiments
# Two workers (pytest-xdist), each test file on one of them (module fixtures built once); TEST_WORKERS=0 runs in
# this process. tests/conftest.py keeps each worker to one thread.
exec .venv/bin/python -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
