"""lm-evaluation-harness (0.4.x) adapter: ``import fullband.lm_eval`` registers the ``fullband`` model. Its
``model_args`` and the semantics of each request type are in docs/evaluation.md."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

import torch

try:  # the installed lm-evaluation-harness package (absolute import: this module is fullband.lm_eval)
    # lm-eval registers its own models (hf, vllm, ...) lazily, but only while its registry is empty; load
    # that table first, or registering "fullband" would hide them.
    import lm_eval.models  # noqa: F401
    import lm_eval.utils as lm_eval_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "fullband.lm_eval needs the lm-evaluation-harness package: pip install 'fullband[eval]'"
    ) from exc

from fullband.decoding import DecodeSettings
from fullband.errors import FullbandError
from fullband.generation import SCORINGS, decode_settings, generate_stream, score_continuations
from fullband.loading import DTYPES, default_device, load_model
from fullband.sampling import SamplingParams
from fullband.stop_strings import first_stop, tokens_until_stop

log = logging.getLogger(__name__)

GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's own default for tasks that do not set max_gen_toks


def _check_choice(name: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"fullband lm-eval model: {name}={value!r} is not one of {', '.join(allowed)}")


@register_model("fullband")
class FullbandLM(TemplateLM):
    """A fullband model (run, checkpoint or model directory) for lm-evaluation-harness."""

    def __init__(self, pretrained: str, decode_mode: str | None = None, fused_passes: int | str | None = None,
                 fused_tol: float | None = None, fused_max_passes: int | None = None, scoring: str = "decode",
                 batch_size: int | str = 8, max_batch_size: int | None = None, device: str | None = None,
                 dtype: str | None = None, max_length: int | None = None) -> None:
        super().__init__()
        _check_choice("scoring", scoring, SCORINGS)
        if dtype is not None:
            _check_choice("dtype", dtype, DTYPES)
        overrides = dict(decode_mode=decode_mode, fused_passes=fused_passes, fused_tol=fused_tol,
                         fused_max_passes=fused_max_passes)
        DecodeSettings().with_overrides(**overrides)  # a bad value fails before the model is loaded
        if isinstance(batch_size, str) and batch_size.isdigit():  # lm-eval's --batch_size arrives as text
            batch_size = int(batch_size)
        if not isinstance(batch_size, int) or batch_size < 1:
            # lm-eval's "auto" probes memory with HF models; a fixed size keeps results reproducible here.
            raise ValueError(f"fullband lm-eval model: batch_size={batch_size!r} must be a positive integer")
        if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's command line defaults to cuda:0; its hf model falls back to the CPU the same way.
            log.warning("fullband lm-eval model: %s is not available, using cpu", device)
            device = "cpu"
        # A run, checkpoint or model directory, or a `fullband export-hf` directory (loaded back into FullBandLM,
        # so every decode mode works on exports too).
        # dtype: as every door, default the dtype the weights are stored in.
        self.model, self.tokenizer_fb = load_model(pretrained, device or default_device(),
                                                   getattr(torch, dtype) if dtype else None)
        self.decode = decode_settings(self.model, **overrides)
        if scoring == "prefill" and self.decode.mode == "soft":
            raise ValueError("fullband lm-eval model: scoring=prefill runs a mode's prefill passes over the whole "
                             "text, which soft decoding does not have; give decode_mode=standard or fused")
        self.scoring = scoring
        log.info("fullband lm-eval model: decoding with %s", self.decode.describe())
        self.batch_size = batch_size
        limit = self.model.config.max_seq_len
        self.max_length = limit if max_length is None else int(max_length)
        if not 2 <= self.max_length <= limit:
            raise ValueError(f"fullband lm-eval model: max_length={max_length} must be in [2, max_seq_len={limit}]")
        self._device = self.model.device

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer_fb.eos_id

    @property
    def prefix_token_id(self) -> int:
        # Documents are trained BOS-first, so an empty context (and the first rolling window) is the BOS token.
        return self.tokenizer_fb.bos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        ids = self.tokenizer_fb.encode(string)
        return [self.tokenizer_fb.bos_id] + ids if add_special_tokens is not False else ids

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer_fb.decode(list(tokens))

    def _fit(self, context: list[int], continuation: list[int]) -> list[int]:
        """The context, truncated from the left so that context + continuation - 1 inputs fit max_length."""
        room = self.max_length - len(continuation) + 1
        if room < 1:
            raise ValueError(
                f"a continuation of {len(continuation)} tokens does not fit max_length={self.max_length}: "
                "use a model with a longer context or a task with shorter answers"
            )
        return context[-room:]

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Score (context, continuation) token pairs in batches of similar length; results in input order."""
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            contexts = [self._fit(*pairs[i]) for i in chunk]
            scored = score_continuations(
                self.model, contexts, [pairs[i][1] for i in chunk], scoring=self.scoring, decode=self.decode)
            for i, (logprobs, greedy) in zip(chunk, scored):
                results[i] = (float(logprobs.double().sum()), bool(greedy.all()))
        return results

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        results = self._score([(list(ctx), list(cont)) for _, ctx, cont in requests])
        for (key, _, _), answer in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows: list[tuple[list[int], list[int]]] = []
        owners: list[int] = []
        for index, (string,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(string, add_special_tokens=False)
            rolling = lm_eval_utils.get_rolling_token_windows(token_list=tokens, prefix_token=self.prefix_token_id,
                                                              max_seq_len=self.max_length, context_len=1)
            for window in map(lm_eval_utils.make_disjoint_window, rolling):
                windows.append(window)
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._score(windows)):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def _generation_options(self, gen_kwargs: dict[str, Any]) -> tuple[list[str], int, SamplingParams]:
        unknown = sorted(set(gen_kwargs) - set(GEN_KWARGS))
        if unknown:
            log.warning("fullband lm-eval model ignores generation arguments %s (it knows %s)", unknown, GEN_KWARGS)
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_gen_toks = int(gen_kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
        if max_gen_toks >= self.max_length:
            raise ValueError(
                f"max_gen_toks={max_gen_toks} leaves no room for a context in max_length={self.max_length}: "
                "use a model with a longer context or ask for fewer tokens"
            )
        temperature = float(gen_kwargs.get("temperature") or 0.0)
        # Without do_sample, a temperature above 0 samples; do_sample without one samples the model's distribution.
        if (do_sample := gen_kwargs.get("do_sample")) is not None:
            temperature = (temperature or 1.0) if do_sample else 0.0
        sampling = SamplingParams(max_tokens=max_gen_toks, temperature=temperature, top_k=gen_kwargs.get("top_k"),
                                  top_p=gen_kwargs.get("top_p"), stop_token_ids=(self.tokenizer_fb.eos_id,))
        return until, max_gen_toks, sampling

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        results: list[str] = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        for index, req in enumerate(requests):  # one batch shape per distinct set of generation arguments
            groups.setdefault(repr(sorted(req.args[1].items(), key=lambda kv: kv[0])), []).append(index)
        for indices in groups.values():
            until, max_gen_toks, sampling = self._generation_options(requests[indices[0]].args[1])
            indices = sorted(indices, key=lambda i: -len(requests[i].args[0]))
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start : start + self.batch_size]
                prompts = [self.tok_encode(requests[i].args[0])[-(self.max_length - max_gen_toks) :] for i in chunk]
                for i, text in zip(chunk, self._generate(prompts, until, sampling)):
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return results

    def _generate(self, prompts: list[list[int]], until: list[str], sampling: SamplingParams) -> list[str]:
        """Decode a batch until every row has produced EOS or one of the ``until`` strings."""
        eos = self.tokenizer_fb.eos_id
        stream = generate_stream(self.model, prompts, sampling=sampling, decode=self.decode)
        texts = [self.tok_decode(ids) for ids in tokens_until_stop(stream, len(prompts), eos, self.tok_decode, until)]
        return [text[: first_stop(text, until)] for text in texts]


def lm_eval_main(argv: list[str]) -> None:
    """Run lm-eval's own command line (``lm-eval``) with ``argv``, the fullband model registered."""
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    except ValueError as exc:  # how lm-eval's command line reports its arguments' problems (an unknown task, ...)
        raise FullbandError(f"lm-eval: {exc}") from None
    finally:
        sys.argv = saved
