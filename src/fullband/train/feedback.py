"""Per-step settings of the feedback phase beyond the paper: the λ ramp, the fusion warm-up and the switch to
the last pass's loss.

All three are pure functions of the step (and the schedule), never of state carried between steps, so a resumed
run computes exactly what an uninterrupted one does."""

from __future__ import annotations

import math

from fullband.config import TrainConfig
from fullband.train.schedule import PassSchedule


def feedback_start_step(schedule: PassSchedule, total_steps: int) -> int | None:
    """The first 0-based step whose phase allows K > 1 (None if no phase does). The schedule places a step
    by the budget fraction at its start, ``step / total_steps``, as ``PassSchedule.passes_for_step`` does."""
    if schedule.exact:
        return 0  # every document holds bos and eos, so K = its longest document is >= 2 from the first step
    start = 0.0
    for phase in schedule.phases:
        if any(k > 1 for k, p in phase.passes if p > 0):
            step = max(0, math.ceil(start * total_steps) - 1)
            # ceil may be off by one in floating point: settle on the exact comparison phase_at makes.
            while step < total_steps and step / total_steps < start:
                step += 1
            return step if step < total_steps else None
        start = phase.until
    return None


def later_pass_weight_at(step: int, total_steps: int, schedule: PassSchedule, cfg: TrainConfig) -> float:
    """λ for ``step``: ``cfg.later_pass_weight``, ramped linearly from 0 over the first
    ``cfg.later_pass_weight_ramp`` fraction of the feedback phase when that is > 0."""
    start = feedback_start_step(schedule, total_steps)
    if cfg.later_pass_weight_ramp <= 0 or start is None:
        return cfg.later_pass_weight
    ramp_steps = cfg.later_pass_weight_ramp * (total_steps - start)
    return cfg.later_pass_weight * min(1.0, max(0.0, (step - start) / ramp_steps))


def fusion_warming_up(step: int, total_steps: int, schedule: PassSchedule, cfg: TrainConfig) -> bool:
    """Whether ``step`` is one of the first ``cfg.fusion_warmup_steps`` steps of the feedback phase, in which
    the fed-back states are detached: the fusion learns to read the states while the trunk's passes get no
    gradient through them."""
    start = feedback_start_step(schedule, total_steps)
    return start is not None and start <= step < start + cfg.fusion_warmup_steps


def pass_loss_at(step: int, total_steps: int, cfg: TrainConfig) -> str:
    """Which passes carry the loss at ``step`` (``FullBandLM.multipass``'s ``pass_loss``): ``cfg.pass_loss``,
    then 'last' from the ``cfg.last_pass_loss_from`` fraction of the steps on."""
    return "last" if step >= cfg.last_pass_loss_from * total_steps else cfg.pass_loss
