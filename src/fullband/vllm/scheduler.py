"""vLLM's scheduler with the chunk rule the feedback modes need (docs/serving.md): a preempted request comes back
as its prompt in one chunk and its generated tokens one per step, so each is fed the state it was generated with;
fused:exact schedules the prompt one token per step."""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from fullband.decoding import EXACT


class _FeedbackChunks:
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        settings = self.vllm_config.model_config.hf_config.decode_settings()
        self.one_token_steps = settings.mode == "fused" and settings.fused_passes == EXACT
        # vLLM's hook for clipping chunks (its Mamba prefix caching uses it); prefix caching is off here.
        self.need_mamba_block_aligned_split = True

    def _mamba_block_aligned_split(self, request, num_new_tokens: int, num_new_local_computed_tokens: int = 0,
                                   num_external_computed_tokens: int = 0) -> int:
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        if self.one_token_steps or start >= request.num_prompt_tokens:
            return min(num_new_tokens, 1)
        return min(num_new_tokens, request.num_prompt_tokens - start)


class FeedbackScheduler(_FeedbackChunks, Scheduler):
    """The scheduler of an engine serving a feedback mode; with async scheduling, its async subclass."""

    def __new__(cls, *args, vllm_config, **kwargs):
        if cls is FeedbackScheduler and vllm_config.scheduler_config.async_scheduling:
            cls = AsyncFeedbackScheduler
        return super().__new__(cls)


class AsyncFeedbackScheduler(FeedbackScheduler, AsyncScheduler):
    pass
