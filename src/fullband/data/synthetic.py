"""Synthetic state-tracking tasks: seeded generators with exact answer checkers.

Each task turns a `random.Random` into an `Example(prompt, answer)`. A training document is
`prompt + answer + "\\n"`; at evaluation the model is given the prompt and its completion is checked.
Answers are always a single line, so a completion is read up to its first newline and anything the
model writes after that is ignored. Tasks with a trace write `<trace> => <result>` and only the result
is checked: the trace is there to teach the model the steps, not to be graded.

Default sizes keep every document under 254 bytes, so `[bos] + document + [eos]` fits a 256-token
byte-level context. Sizes can be changed per task, e.g. `synthetic:parity:max_len=64` as a source.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from fullband.errors import ConfigError


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str

    @property
    def text(self) -> str:
        """The training document for this example."""
        return self.prompt + self.answer + "\n"


def final_answer(text: str) -> str:
    """The graded part of an answer or completion: its first line, after the last `=>` if any."""
    line = text.split("\n", 1)[0]
    if "=>" in line:
        line = line.rsplit("=>", 1)[1]
    return line.strip()


@dataclass(frozen=True)
class SyntheticTask:
    """Base class: subclasses set `name` and implement `generate`."""

    name = "task"

    def generate(self, rng: random.Random) -> Example:
        raise NotImplementedError

    def check(self, example: Example, completion: str) -> bool:
        """True iff the completion (text generated after the prompt) carries the right result."""
        return final_answer(completion) == final_answer(example.answer)


@dataclass(frozen=True)
class Parity(SyntheticTask):
    """Running parity of a bit string: `parity 1011 : 1101` (the XOR of the bits so far, bit by bit)."""

    name = "parity"
    min_len: int = 8
    max_len: int = 64

    def generate(self, rng: random.Random) -> Example:
        bits = [rng.randint(0, 1) for _ in range(rng.randint(self.min_len, self.max_len))]
        running, acc = [], 0
        for b in bits:
            acc ^= b
            running.append(acc)
        return Example(f"parity {''.join(map(str, bits))} :", " " + "".join(map(str, running)))


@dataclass(frozen=True)
class S5(SyntheticTask):
    """Composition of permutations of 5 elements, the classic hard state-tracking problem.

    A permutation is written in one-line notation (`20413` maps 0->2, 1->0, ...). The state starts at
    the identity and each step maps every entry x of the state to p[x]. With `trace` the answer lists
    the state after every step, then `=> final`.
    """

    name = "s5"
    min_steps: int = 2
    max_steps: int = 16
    trace: bool = True

    def generate(self, rng: random.Random) -> Example:
        perms = []
        for _ in range(rng.randint(self.min_steps, self.max_steps)):
            p = list(range(5))
            rng.shuffle(p)
            perms.append(p)
        state, states = list(range(5)), []
        for p in perms:
            state = [p[x] for x in state]
            states.append("".join(map(str, state)))
        prompt = "s5 " + " ".join("".join(map(str, p)) for p in perms) + " :"
        answer = " " + " ".join(states) + " => " + states[-1] if self.trace else " " + states[-1]
        return Example(prompt, answer)


@dataclass(frozen=True)
class Registers(SyntheticTask):
    """Multi-register latest-write: `regs b=3 a=7 b=1 ? b : 1` (the value of the last write to b)."""

    name = "registers"
    num_registers: int = 4
    min_writes: int = 4
    max_writes: int = 32

    def __post_init__(self) -> None:
        if not 1 <= self.num_registers <= 26:
            raise ConfigError(
                f"Synthetic task registers: num_registers must be 1..26, got {self.num_registers}."
            )

    def generate(self, rng: random.Random) -> Example:
        names = "abcdefghijklmnopqrstuvwxyz"[: self.num_registers]
        n_writes = rng.randint(self.min_writes, self.max_writes)
        writes = [(rng.choice(names), rng.randint(0, 9)) for _ in range(n_writes)]
        latest = dict(writes)
        query = rng.choice(sorted(latest))
        prompt = "regs " + " ".join(f"{r}={v}" for r, v in writes) + f" ? {query} :"
        return Example(prompt, f" {latest[query]}")


@dataclass(frozen=True)
class Addition(SyntheticTask):
    """Multi-digit addition with a digit-by-digit trace from the right, carries included.

    `add 47+85 : 7+5+0=12 c1, 4+8+1=13 c1 => 132`: each step adds the two digits and the incoming
    carry, keeps the last digit of the sum and carries the rest.
    """

    name = "addition"
    min_digits: int = 1
    max_digits: int = 10

    def generate(self, rng: random.Random) -> Example:
        def number() -> int:
            digits = rng.randint(self.min_digits, self.max_digits)
            return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)

        a, b = number(), number()
        da, db = str(a)[::-1], str(b)[::-1]
        steps, carry = [], 0
        for i in range(max(len(da), len(db))):
            x = int(da[i]) if i < len(da) else 0
            y = int(db[i]) if i < len(db) else 0
            s = x + y + carry
            steps.append(f"{x}+{y}+{carry}={s} c{s // 10}")
            carry = s // 10
        return Example(f"add {a}+{b} :", " " + ", ".join(steps) + f" => {a + b}")


SYNTHETIC_TASKS: dict[str, SyntheticTask] = {
    t.name: t for t in (Parity(), S5(), Registers(), Addition())
}


def get_task(spec: str) -> SyntheticTask:
    """Resolve `name` or `name:key=value,key=value` (sizes override the task's defaults)."""
    name, _, params = spec.partition(":")
    if name not in SYNTHETIC_TASKS:
        raise ConfigError(
            f"Unknown synthetic task {name!r} in data.source. Available tasks: "
            f"{', '.join(sorted(SYNTHETIC_TASKS))}; use e.g. --data.source synthetic:parity."
        )
    task = SYNTHETIC_TASKS[name]
    if not params:
        return task
    fields = {f.name: f.type for f in dataclasses.fields(task)}
    overrides: dict[str, int | bool] = {}
    for item in params.split(","):
        key, eq, value = item.partition("=")
        if not eq or key not in fields:
            raise ConfigError(
                f"Bad synthetic task option {item!r} in data.source {spec!r}. Options of {name!r} are "
                f"{', '.join(f'{k}=<value>' for k in fields)}, separated by commas."
            )
        if fields[key] in ("bool", bool):
            if value not in ("true", "false"):
                raise ConfigError(f"Synthetic task option {key} in {spec!r} must be true or false.")
            overrides[key] = value == "true"
        else:
            try:
                overrides[key] = int(value)
            except ValueError:
                raise ConfigError(
                    f"Synthetic task option {key} in {spec!r} must be an integer, got {value!r}."
                ) from None
    task = dataclasses.replace(task, **overrides)
    lo_hi = [(k, k.replace("min_", "max_")) for k in fields if k.startswith("min_")]
    for lo, hi in lo_hi:
        if not 1 <= getattr(task, lo) <= getattr(task, hi):
            raise ConfigError(f"Synthetic task {spec!r}: need 1 <= {lo} <= {hi}.")
    return task


def synthetic_examples(task: str | SyntheticTask, n: int, seed: int) -> list[Example]:
    """`n` examples of a task, fully determined by `seed` (same seed, same examples)."""
    task = get_task(task) if isinstance(task, str) else task
    rng = random.Random(seed)
    return [task.generate(rng) for _ in range(n)]
