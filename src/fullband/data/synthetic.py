"""Synthetic state-tracking tasks: seeded generators with exact answer checkers. A document is
``prompt + answer + "\n"``; an answer is one line, and with a trace (``<trace> => <result>``) only the result is
checked. Default sizes keep ``[bos] + document + [eos]`` within a 256-token byte-level context."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

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
    # Bounds of integer fields, checked on construction: field -> (low, high, why the bounds).
    ranges: ClassVar[dict[str, tuple[int, int, str]]] = {}

    def __post_init__(self) -> None:
        for field, (low, high, why) in self.ranges.items():
            value = getattr(self, field)
            if not low <= value <= high:
                raise ConfigError(f"Synthetic task {self.name}: {field} must be {low}..{high}{why}, got {value}.")

    def generate(self, rng: random.Random) -> Example:
        raise NotImplementedError

    def check(self, example: Example, completion: str) -> bool:
        """True iff the completion (text generated after the prompt) carries the right result."""
        return final_answer(completion) == final_answer(example.answer)

    def targets(self, example: Example) -> list[tuple[int, str]]:
        """Per-position targets for linear probes: (character offset in the prompt, label), the label
        being the task's running state right after reading that character. [] for tasks without one."""
        return []


def _moves(example: Example) -> str:
    """The moves of a `<name> <moves> :` prompt."""
    return example.prompt.split(" ", 1)[1].removesuffix(" :")


def _counted_moves(example: Example) -> tuple[int, str]:
    """The offset and the moves of a `<name> <number> : <moves> :` prompt."""
    return example.prompt.index(" : ") + 3, example.prompt.split(" : ")[1].removesuffix(" :")


def _state_answer(states: list[str], trace: bool) -> str:
    """The answer of a state-tracking task: the final state, or with `trace` every state then `=> final`."""
    return " " + " ".join(states) + " => " + states[-1] if trace else " " + states[-1]


@dataclass(frozen=True)
class _MovesTask(SyntheticTask):
    """A task whose prompt is `<name> <one character per move> :` and whose state is a function of the moves
    so far; the answer is the final state (with `trace`, every state, see `answer`)."""

    def draw_moves(self, rng: random.Random) -> str:
        raise NotImplementedError

    def states(self, moves: str) -> list[str]:
        """The state after each move."""
        raise NotImplementedError

    def answer(self, states: list[str]) -> str:
        return _state_answer(states, self.trace)

    def generate(self, rng: random.Random) -> Example:
        moves = self.draw_moves(rng)
        return Example(f"{self.name} {moves} :", self.answer(self.states(moves)))

    def targets(self, example: Example) -> list[tuple[int, str]]:
        start = example.prompt.index(" ") + 1
        return [(start + i, state) for i, state in enumerate(self.states(_moves(example)))]


@dataclass(frozen=True)
class Parity(_MovesTask):
    """Running parity of a bit string: `parity 1011 : 1101` (the XOR of the bits so far, bit by bit).
    With `trace=false` the answer is the final parity only (`parity 1011 : 1`)."""

    name = "parity"
    min_len: int = 8
    max_len: int = 64
    trace: bool = True

    def draw_moves(self, rng: random.Random) -> str:
        return "".join(str(rng.randint(0, 1)) for _ in range(rng.randint(self.min_len, self.max_len)))

    def states(self, moves: str) -> list[str]:
        states, acc = [], 0
        for bit in moves:
            acc ^= int(bit)
            states.append(str(acc))
        return states

    def answer(self, states: list[str]) -> str:
        return " " + ("".join(states) if self.trace else states[-1])


@dataclass(frozen=True)
class S5(SyntheticTask):
    """Composition of permutations of 5 elements, the classic hard state-tracking problem.

    A permutation is written in one-line notation (`20413` maps 0->2, 1->0, ...). The state starts at
    the identity and each step maps every entry x of the state to p[x]. With `trace` the answer lists
    the state after every step, then `=> final`.

    With `generators=true` each step is one letter naming a generator of the group instead of a whole
    permutation (`s5 adbe :`): a..d swap entries (0 1), (1 2), (2 3), (3 4) and e shifts every entry by
    one (x -> x+1 mod 5). These generate all 120 elements, and one token per step is what a model that
    carries the state from token to token needs; it is the word problem of Merrill et al. 2024.
    """

    name = "s5"
    degree: ClassVar[int] = 5
    min_steps: int = 2
    max_steps: int = 16
    trace: bool = True
    generators: bool = False

    def group_generators(self) -> list[list[int]]:
        """Adjacent transpositions, then the cycle x -> x+1 (one-line notation, degree entries each)."""
        n, gens = self.degree, []
        for i in range(n - 1):
            p = list(range(n))
            p[i], p[i + 1] = p[i + 1], p[i]
            gens.append(p)
        return gens + [[(x + 1) % n for x in range(n)]]

    def generate(self, rng: random.Random) -> Example:
        n, perms, names = self.degree, [], []
        gens = self.group_generators()
        for _ in range(rng.randint(self.min_steps, self.max_steps)):
            if self.generators:
                i = rng.randrange(len(gens))
                perms.append(gens[i])
                names.append("abcdefgh"[i])
            else:
                p = list(range(n))
                rng.shuffle(p)
                perms.append(p)
                names.append("".join(map(str, p)))
        moves = "".join(names) if self.generators else " ".join(names)
        return Example(f"{self.name} {moves} :", _state_answer(self.states(perms), self.trace))

    def states(self, perms: list[list[int]]) -> list[str]:
        """The state (one-line notation) after each permutation, starting from the identity."""
        state, states = list(range(self.degree)), []
        for p in perms:
            state = [p[x] for x in state]
            states.append("".join(map(str, state)))
        return states

    def targets(self, example: Example) -> list[tuple[int, str]]:
        """The state (one-line notation) after each move, at the move's last character."""
        moves, start = _moves(example), example.prompt.index(" ") + 1
        gens = self.group_generators()
        if self.generators:
            spans = [(start + i, gens["abcdefgh".index(m)]) for i, m in enumerate(moves)]
        else:
            spans, offset = [], start
            for word in moves.split(" "):
                spans.append((offset + len(word) - 1, [int(x) for x in word]))
                offset += len(word) + 1
        return list(zip([offset for offset, _ in spans], self.states([p for _, p in spans])))


@dataclass(frozen=True)
class S3(S5):
    """The same word problem in S3 (6 elements, the smallest non-abelian group): `s3 201 120 : ...`,
    or with `generators=true` letters a, b (swaps) and c (shift), e.g. `s3 acb :`."""

    name = "s3"
    degree: ClassVar[int] = 3


@dataclass(frozen=True)
class Registers(SyntheticTask):
    """Multi-register latest-write: `regs b=3 a=7 b=1 ? b : 1` (the value of the last write to b)."""

    name = "registers"
    ranges: ClassVar = {"num_registers": (1, 26, "")}
    num_registers: int = 4
    min_writes: int = 4
    max_writes: int = 32

    def generate(self, rng: random.Random) -> Example:
        names = "abcdefghijklmnopqrstuvwxyz"[: self.num_registers]
        n_writes = rng.randint(self.min_writes, self.max_writes)
        writes = [(rng.choice(names), rng.randint(0, 9)) for _ in range(n_writes)]
        latest = dict(writes)
        query = rng.choice(sorted(latest))
        prompt = "regs " + " ".join(f"{r}={v}" for r, v in writes) + f" ? {query} :"
        return Example(prompt, f" {latest[query]}")

    def targets(self, example: Example) -> list[tuple[int, str]]:
        """At each write's value: the latest value of register `a` so far (`-` before its first write),
        a state the model must carry across writes to other registers."""
        out, value = [], "-"
        writes = example.prompt.removeprefix("regs ").split(" ? ")[0]
        offset = len("regs ")
        for write in writes.split(" "):
            if write[0] == "a":
                value = write[2]
            out.append((offset + 2, value))
            offset += len(write) + 1
        return out


@dataclass(frozen=True)
class Addition(SyntheticTask):
    """Multi-digit addition with a digit-by-digit trace from the right, carries included.

    `add 47+85 : 7+5+0=12 c1, 4+8+1=13 c1 => 132`: each step adds the two digits and the incoming
    carry, keeps the last digit of the sum and carries the rest. With `trace_percent` < 100 only that
    percent of the examples write the trace; the others answer directly (`add 47+85 : => 132`), so a
    model chooses at decode time whether to write one.
    """

    name = "addition"
    ranges: ClassVar = {"trace_percent": (0, 100, " (the percent of examples that write the trace)")}
    min_digits: int = 1
    max_digits: int = 10
    trace_percent: int = 100

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
        # The extra draw happens only below 100%, so the default keeps the examples of every seed.
        if self.trace_percent < 100 and rng.randrange(100) >= self.trace_percent:
            return Example(f"add {a}+{b} :", f" => {a + b}")
        return Example(f"add {a}+{b} :", " " + ", ".join(steps) + f" => {a + b}")


@dataclass(frozen=True)
class SumMod(_MovesTask):
    """Running sum of digits modulo k: `summod 3104 : 3` (3+1+0+4 = 8 = 3 mod 5). Digits are 0..k-1.
    With `trace` the answer lists the running sum after every digit, then `=> final`."""

    name = "summod"
    ranges: ClassVar = {"modulus": (2, 10, " (one digit per step)")}
    modulus: int = 5
    min_len: int = 8
    max_len: int = 32
    trace: bool = False

    def draw_moves(self, rng: random.Random) -> str:
        return "".join(str(rng.randrange(self.modulus)) for _ in range(rng.randint(self.min_len, self.max_len)))

    def states(self, moves: str) -> list[str]:
        states, acc = [], 0
        for digit in moves:
            acc = (acc + int(digit)) % self.modulus
            states.append(str(acc))
        return states


@dataclass(frozen=True)
class FlipFlop(_MovesTask):
    """Flip-flop (Liu et al. 2023) with the read at the end: `flipflop 1..0..... : 0`. Each step is a
    write of a bit (`0`, `1`; probability `write_percent`%) or an ignore (`.`); the answer is the last
    written bit. The first step is always a write, so the gap from the last write to the read can span
    the whole sequence. With `trace` the answer lists the stored bit after every step, then `=> final`."""

    name = "flipflop"
    ranges: ClassVar = {"write_percent": (1, 100, "")}
    write_percent: int = 10
    min_len: int = 8
    max_len: int = 32
    trace: bool = False

    def draw_moves(self, rng: random.Random) -> str:
        return "".join(str(rng.randint(0, 1)) if i == 0 or rng.random() < self.write_percent / 100 else "."
                       for i in range(rng.randint(self.min_len, self.max_len)))

    def states(self, moves: str) -> list[str]:
        states, bit = [], ""
        for step in moves:
            bit = bit if step == "." else step
            states.append(bit)
        return states


@dataclass(frozen=True)
class Cycle(_MovesTask):
    """Cycle navigation (Delétang et al. 2023): start at 0 on a cycle of `size` positions; each step is
    `+` (one forward), `-` (one back) or `=` (stay); the answer is the final position: `cycle ++-+= : 2`.
    With `trace` the answer lists the position after every step, then `=> final`."""

    name = "cycle"
    ranges: ClassVar = {"size": (2, 10, " (one digit per position)")}
    size: int = 5
    min_len: int = 8
    max_len: int = 32
    trace: bool = False

    def draw_moves(self, rng: random.Random) -> str:
        return "".join(rng.choice("+-=") for _ in range(rng.randint(self.min_len, self.max_len)))

    def states(self, moves: str) -> list[str]:
        states, pos = [], 0
        for step in moves:
            pos = (pos + {"+": 1, "-": -1, "=": 0}[step]) % self.size
            states.append(str(pos))
        return states


@dataclass(frozen=True)
class Completion(SyntheticTask):
    """Completion tracking: a checklist of the first `items` letters; each step marks one letter done
    (repeats allowed); the state is how many distinct letters are done, and the answer is that count at
    the end: `completion 4 : bdbad : 3`. Lengths are drawn so that about half the lists get complete."""

    name = "completion"
    ranges: ClassVar = {"items": (2, 9, " (one digit per count)")}
    items: int = 4
    min_len: int = 2
    max_len: int = 16

    def generate(self, rng: random.Random) -> Example:
        letters = "abcdefghi"[: self.items]
        steps = "".join(rng.choice(letters) for _ in range(rng.randint(self.min_len, self.max_len)))
        return Example(f"completion {self.items} : {steps} :", f" {len(set(steps))}")

    def targets(self, example: Example) -> list[tuple[int, str]]:
        start, steps = _counted_moves(example)
        return [(start + i, str(len(set(steps[: i + 1])))) for i in range(len(steps))]


@dataclass(frozen=True)
class Delayed(SyntheticTask):
    """Delayed memory: a stream of digits; the state at each step is the digit read `delay` steps earlier,
    and the answer is that digit at the end: `delayed 3 : 4819237 :` -> ` 9` (the digit 3 steps before
    the last one, counting the last as 0 steps before)."""

    name = "delayed"
    delay: int = 3
    min_len: int = 8
    max_len: int = 32

    def __post_init__(self) -> None:
        if not 1 <= self.delay < self.min_len:
            raise ConfigError(f"Synthetic task delayed: need 1 <= delay < min_len, got delay={self.delay}.")

    def generate(self, rng: random.Random) -> Example:
        digits = "".join(str(rng.randint(0, 9)) for _ in range(rng.randint(self.min_len, self.max_len)))
        return Example(f"delayed {self.delay} : {digits} :", f" {digits[-1 - self.delay]}")

    def targets(self, example: Example) -> list[tuple[int, str]]:
        start, digits = _counted_moves(example)
        return [(start + i, digits[i - self.delay]) for i in range(self.delay, len(digits))]


SYNTHETIC_TASKS: dict[str, SyntheticTask] = {
    t.name: t for t in (Parity(), S5(), S3(), Registers(), Addition(), SumMod(), FlipFlop(), Cycle(), Completion(),
                        Delayed())
}

# The tasks whose answer is a running state after a sequence of moves (each takes `trace=false` for the
# final-answer-only format), and the field that sets their length in moves.
STATE_TRACKING_TASKS = {"parity": "len", "summod": "len", "flipflop": "len", "cycle": "len", "s3": "steps",
                        "s5": "steps"}


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


def state_tracking_task(name: str, min_moves: int, max_moves: int, trace: bool = False,
                        options: str = "") -> SyntheticTask:
    """A state-tracking task with one token per move (S3/S5 as generator words) and `min_moves..max_moves`
    moves, in the final-answer-only format unless `trace`; `options` ("key=value,...") sets other fields,
    e.g. "size=3" for cycle navigation on 3 positions or "modulus=3" for sum mod 3."""
    if name not in STATE_TRACKING_TASKS:
        raise ConfigError(f"{name!r} is not a state-tracking task; choose one of {', '.join(STATE_TRACKING_TASKS)}.")
    field = STATE_TRACKING_TASKS[name]
    spec = f"{name}:min_{field}={min_moves},max_{field}={max_moves},trace={str(trace).lower()}"
    if name in ("s3", "s5"):
        spec += ",generators=true"
    return get_task(spec + (f",{options}" if options else ""))


def export_jsonl(task: str | SyntheticTask, path: str | Path, n: int, seed: int) -> Path:
    """Write `n` examples as `{"prompt": ..., "answer": ...}` lines (the record format `fullband train`
    reads from .jsonl sources). Same task and seed, same file."""
    return write_jsonl(({"prompt": ex.prompt, "answer": ex.answer} for ex in synthetic_examples(task, n, seed)), path)


def write_jsonl(records: Iterable[dict], path: str | Path) -> Path:
    """Write records as JSON Lines, to a temporary file first, so an interrupted write leaves no half-written
    file under `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with partial.open("w") as f:
        f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    partial.replace(path)
    return path
