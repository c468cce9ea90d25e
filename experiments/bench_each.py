"""`fullband bench` run several times in one process: each argument is one bench command line as a JSON list, run
through `fullband.cli.main` (the command's own parser and code), so that grading many checkpoints of a run pays for
starting Python and importing torch once instead of once per checkpoint.

    python -m experiments.bench_each '["bench", "runs/x/checkpoints/step_00000200/model", "--task", ...]' ...
"""

from __future__ import annotations

import json
import sys

from fullband.cli import main


def run_each(commands: list[list[str]]) -> int:
    for argv in commands:
        if argv[:1] != ["bench"]:
            raise SystemExit(f"not a bench command: {argv!r}")
        print(f"== fullband {' '.join(argv)}", flush=True)
        status = main(argv)
        if status:
            return status
    return 0


if __name__ == "__main__":
    sys.exit(run_each([json.loads(arg) for arg in sys.argv[1:]]))
