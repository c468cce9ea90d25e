"""``fullband bench``: generation benchmarks (accuracy, pass@k, generated length) over synthetic, JSONL,
reasoning-gym and HumanEval tasks, with model-written code executed in a sandbox."""

from fullband.bench.metrics import bootstrap_ci, pass_at_k, summarize
from fullband.bench.runner import BenchSettings, parse_modes, run_bench
from fullband.bench.sandbox import Limits, ProgramResult, network_isolation, run_program, run_programs
from fullband.bench.tasks import BenchTask, Problem, make_task

__all__ = [
    "BenchSettings", "BenchTask", "Limits", "Problem", "ProgramResult", "bootstrap_ci", "make_task",
    "network_isolation", "parse_modes", "pass_at_k", "run_bench", "run_program", "run_programs", "summarize",
]
