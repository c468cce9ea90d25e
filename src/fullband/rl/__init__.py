"""Reinforcement learning with verifiable rewards (GRPO, DAPO's options) for fullband models, with the
log-probabilities of the decode mode that sampled each rollout (docs/rl.md).

- ``rollout_logprobs``: per-token log-probabilities of completions under standard, soft, fused:N, fused:auto or
  fused:exact decoding, differentiable (``fullband.rl.logprobs``);
- reward functions: exact match, regex, Math-Verify, sandboxed unit tests (``fullband.rl.rewards``);
- the GRPO loss and group-relative advantages (``fullband.rl.grpo``);
- the training loop of ``fullband rl`` (``fullband.rl.trainer``).
"""

from fullband.rl.grpo import GRPOLoss, group_advantages, grpo_loss, informative_groups
from fullband.rl.logprobs import completion_logits, rollout_logprobs, rollout_logprobs_and_entropies
from fullband.rl.rewards import (
    CodeTestReward,
    ExactMatchReward,
    MathVerifyReward,
    RegexReward,
    RewardFunction,
    make_reward,
)

__all__ = ["CodeTestReward", "ExactMatchReward", "GRPOLoss", "MathVerifyReward", "RegexReward", "RewardFunction",
           "completion_logits", "group_advantages", "grpo_loss", "informative_groups", "make_reward",
           "rollout_logprobs", "rollout_logprobs_and_entropies"]
