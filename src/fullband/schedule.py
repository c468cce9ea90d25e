"""The passes of a training step: how many (the pass schedule, docs/method.md §5) and which carry the loss
(``PASS_LOSSES``, §4). K is drawn per (seed, step), so every rank and a resumed run draw the same K. The run config
validates both, so they live below ``fullband.train``."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from fullband.errors import ConfigError

PRESETS: dict[str, list[dict[str, Any]]] = {
    # 75% single-pass, then 2 passes w.p. 0.88 and 3 w.p. 0.12: 75/22/3 of all batches (200B/400B runs).
    "paper": [{"until": 0.75, "passes": {1: 1.0}}, {"until": 1.0, "passes": {2: 0.88, 3: 0.12}}],
    # The 100B run: 75% 1-pass, 25% 3-pass.
    "paper-100b": [{"until": 0.75, "passes": {1: 1.0}}, {"until": 1.0, "passes": {3: 1.0}}],
    "standard": [{"until": 1.0, "passes": {1: 1.0}}],
    # Not the paper's: its late-phase mix from the first step (2.12 mean passes).
    "feedback-from-start": [{"until": 1.0, "passes": {2: 0.88, 3: 0.12}}],
}


@dataclass(frozen=True)
class Phase:
    until: float  # this phase covers steps whose budget fraction is < until
    passes: tuple[tuple[int, float], ...]  # (K, probability), probabilities sum to 1


EXACT = "exact"
# How the exact schedule computes its last pass (train.exact_mode): "jacobi", K passes over every position, or
# "sequential", the recurrence token by token (FullBandLM.recurrence).
EXACT_MODES = ("jacobi", "sequential")

# Which passes carry the loss: "paper" is Eq. 12, L1 + λ·mean(L2..LK); "last" is LK alone (with the exact
# schedule, the exact recurrence); "paper+last" is Eq. 12 + LK. The last two are beyond the paper.
PASS_LOSSES = ("paper", "last", "paper+last")


@dataclass(frozen=True)
class PassSchedule:
    phases: tuple[Phase, ...]
    exact: bool = False  # K per step = the batch's longest document (no phases)

    @classmethod
    def parse(cls, spec: Any) -> PassSchedule:
        """A preset name, 'fixed:K', 'exact', or a list of {until: fraction, passes: {K: probability}}."""
        if spec == EXACT:
            return cls((), exact=True)
        if isinstance(spec, str):
            if spec.startswith("fixed:"):
                try:
                    k = int(spec.removeprefix("fixed:"))
                except ValueError:
                    k = 0
                if k < 1:
                    raise ConfigError(f"train.schedule={spec!r}: fixed:K needs an integer K >= 1, e.g. fixed:3")
                spec = [{"until": 1.0, "passes": {k: 1.0}}]
            elif spec in PRESETS:
                spec = PRESETS[spec]
            else:
                raise ConfigError(
                    f"train.schedule={spec!r} is not a known schedule: use one of {', '.join(PRESETS)}, "
                    "fixed:K, exact, or a list of phases [{until: 0.75, passes: {1: 1.0}}, ...]"
                )
        if not isinstance(spec, list) or not spec:
            raise ConfigError("train.schedule must be a preset name or a non-empty list of phases")
        phases, previous = [], 0.0
        for i, raw in enumerate(spec):
            if not isinstance(raw, dict) or set(raw) != {"until", "passes"} or not isinstance(raw["passes"], dict):
                raise ConfigError(
                    f"train.schedule phase {i}: expected {{until: fraction, passes: {{K: prob}}}}, got {raw!r}"
                )
            try:
                until = float(raw["until"])
            except (TypeError, ValueError):
                raise ConfigError(f"train.schedule phase {i}: 'until' must be a number, got {raw['until']!r}") from None
            if not previous < until <= 1.0:
                raise ConfigError(f"train.schedule phase {i}: 'until' values must increase within (0, 1], got {until}")
            try:
                if any(isinstance(k, (bool, float)) or isinstance(p, bool) for k, p in raw["passes"].items()):
                    raise TypeError
                passes = tuple(sorted((int(k), float(p)) for k, p in raw["passes"].items()))
            except (TypeError, ValueError):
                raise ConfigError(f"train.schedule phase {i}: passes must map integers K to probabilities") from None
            total = sum(p for _, p in passes)
            # (written so that NaN probabilities fail too)
            if not passes or any(k < 1 or not 0 <= p <= 1 for k, p in passes) or not abs(total - 1.0) <= 1e-6:
                raise ConfigError(
                    f"train.schedule phase {i}: need K >= 1 and probabilities in [0, 1] that sum to 1, "
                    f"got {raw['passes']}"
                )
            phases.append(Phase(until, passes))
            previous = until
        if previous != 1.0:
            raise ConfigError("train.schedule: the last phase must end at until: 1.0")
        return cls(tuple(phases))

    def _refuse_exact(self, what: str) -> None:
        if self.exact:
            raise ConfigError(
                f"the exact schedule has no {what}: its K is the longest document of each step's batch (at most "
                "train.seq_len), known only from the data; a run's actual K per step is in metrics.jsonl (passes)"
            )

    def passes_for_step(self, step: int, total_steps: int, seed: int) -> int:
        """K for a 0-based optimizer step; the budget fraction is measured at the step's start."""
        self._refuse_exact("K per step without its batch")
        phase = next((phase for phase in self.phases if step / total_steps < phase.until), self.phases[-1])
        if len(phase.passes) == 1:
            return phase.passes[0][0]
        draw = random.Random(f"{seed}:{step}").random()
        cumulative = 0.0
        for k, p in phase.passes:
            cumulative += p
            if draw < cumulative:
                return k
        return phase.passes[-1][0]

    def mean_passes(self) -> float:
        """Expected passes per step over the whole run (token-equivalent compute = tokens × this)."""
        self._refuse_exact("expected passes")
        start, total = 0.0, 0.0
        for phase in self.phases:
            total += (phase.until - start) * sum(k * p for k, p in phase.passes)
            start = phase.until
        return total

    @property
    def max_passes(self) -> int:
        self._refuse_exact("maximum independent of train.seq_len")
        return max(k for phase in self.phases for k, _ in phase.passes)
