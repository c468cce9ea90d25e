"""Verifiable rewards: a reward function scores completions (text) against the reference answers of their prompts.

The interface is one method, ``RewardFunction.__call__(completions, answers) -> list[float]``: one reward per
completion, in order, from the completion's text (decoded, without its end token) and the answer of its record.
``correct_at`` says which rewards count as a correct answer (the trainer's accuracy). Any object with these two
attributes can be passed to the trainer (``fullband.rl.trainer.run_rl``'s ``reward``).

- ``ExactMatchReward``: 1 when the completion's final answer (its first line, after the last ``=>`` if any: the
  synthetic tasks' and ``fullband bench``'s rule, ``fullband.data.synthetic.final_answer``) equals the answer's.
- ``RegexReward``: the first match of a pattern in the completion (its group ``answer``, else group 1, else the
  whole match) compared with the answer, stripped.
- ``MathVerifyReward``: math-verify's equivalence of the answer and the completion (``fullband[eval]``).
- ``CodeTestReward``: the completion, then the record's answer (test code that raises on failure), run as one
  program in the bubblewrap sandbox of ``fullband bench`` (``fullband.bench.sandbox``); 1 when it exits 0.

``make_reward(spec)`` builds one from the text the command line takes: ``exact``, ``regex:PATTERN``, ``math``,
``code``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Protocol

from fullband.bench.sandbox import Limits, choose_isolation, run_programs
from fullband.data.synthetic import final_answer
from fullband.errors import ConfigError

__all__ = ["CodeTestReward", "ExactMatchReward", "MathVerifyReward", "RegexReward", "RewardFunction", "REWARD_KINDS",
           "make_reward"]

REWARD_KINDS = "exact, regex:PATTERN, math, code"


class RewardFunction(Protocol):
    """Scores completions against their records' answers; ``correct_at``: a reward at or above it is correct."""

    correct_at: float

    def __call__(self, completions: Sequence[str], answers: Sequence[str]) -> list[float]: ...


def _check_pairs(completions: Sequence[str], answers: Sequence[str]) -> None:
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers: give one answer per completion")


class ExactMatchReward:
    """1.0 when the final answers are equal (``final_answer`` of each), else 0.0."""

    correct_at = 1.0

    def __call__(self, completions: Sequence[str], answers: Sequence[str]) -> list[float]:
        _check_pairs(completions, answers)
        return [float(final_answer(c) == final_answer(a)) for c, a in zip(completions, answers)]


class RegexReward:
    """1.0 when the first match of ``pattern`` in the completion (group ``answer``, else group 1, else the whole
    match) equals the answer (both stripped); 0.0 when it differs or nothing matches."""

    correct_at = 1.0

    def __init__(self, pattern: str):
        try:
            self.pattern = re.compile(pattern)
        except re.error as exc:
            raise ConfigError(f"reward regex {pattern!r} does not compile: {exc}") from None

    def extract(self, text: str) -> str | None:
        match = self.pattern.search(text)
        if match is None:
            return None
        if "answer" in self.pattern.groupindex:
            return match.group("answer")
        return match.group(1) if self.pattern.groups else match.group(0)

    def __call__(self, completions: Sequence[str], answers: Sequence[str]) -> list[float]:
        _check_pairs(completions, answers)
        found = [self.extract(c) for c in completions]
        return [float(f is not None and f.strip() == str(a).strip()) for f, a in zip(found, answers)]


class MathVerifyReward:
    """1.0 when math-verify finds the completion's answer equivalent to the reference (``verify(parse(answer),
    parse(completion))``, as ``fullband bench --match math``), else 0.0."""

    correct_at = 1.0

    def __init__(self) -> None:
        try:
            from math_verify import parse, verify
        except ImportError:
            raise ConfigError("the math reward needs math-verify: pip install 'fullband[eval]'") from None
        self._parse, self._verify = parse, verify

    def __call__(self, completions: Sequence[str], answers: Sequence[str]) -> list[float]:
        _check_pairs(completions, answers)
        return [float(bool(self._verify(self._parse(str(a)), self._parse(c)))) for c, a in zip(completions, answers)]


class CodeTestReward:
    """1.0 when the program ``completion + "\\n\\n" + answer`` (the answer holds the record's tests: asserts, or a
    call that raises on a wrong result) exits 0 in the sandbox, else 0.0. Bubblewrap is required unless
    ``allow_unsandboxed`` (then the resource-limit guard runs it where bubblewrap cannot: not a boundary)."""

    correct_at = 1.0

    def __init__(self, limits: Limits | None = None, workers: int | None = None, allow_unsandboxed: bool = False):
        self.limits, self.workers = limits or Limits(), workers
        # Decided (or refused) now, before any rollout is generated.
        self.isolation = choose_isolation(allow_unsandboxed)

    @staticmethod
    def program(completion: str, tests: str) -> str:
        return f"{completion}\n\n{tests}\n"

    def __call__(self, completions: Sequence[str], answers: Sequence[str]) -> list[float]:
        _check_pairs(completions, answers)
        programs = [self.program(c, str(a)) for c, a in zip(completions, answers)]
        return [float(r.passed) for r in run_programs(programs, self.limits, self.workers, self.isolation)]


def make_reward(spec: str, allow_unsandboxed: bool = False) -> RewardFunction:
    """The reward a spec names: ``exact``, ``regex:PATTERN``, ``math`` or ``code`` (see the module doc)."""
    kind, colon, argument = spec.partition(":")
    if kind == "exact" and not colon:
        return ExactMatchReward()
    if kind == "regex" and argument:
        return RegexReward(argument)
    if kind == "math" and not colon:
        return MathVerifyReward()
    if kind == "code" and not colon:
        return CodeTestReward(allow_unsandboxed=allow_unsandboxed)
    raise ConfigError(f"unknown reward {spec!r}; rewards are {REWARD_KINDS}")
