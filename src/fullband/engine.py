"""The one decode loop: a batch of sequences stepped together, each prefilled, its logits adjusted, its token chosen
(or given, when scoring), its top state fed back. ``generate`` and scoring run it over a fixed batch, the server
with continuous batching (how rows join, share one cache and leave: docs/serving.md)."""

from __future__ import annotations

import logging
import threading
from collections import abc, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fullband.architectures import LanguageModel, ModelCache
from fullband.decoding import DecodeSettings
from fullband.kv_cache import KVCache
from fullband.sampling import (
    BatchAdjuster,
    LogitsAdjustments,
    RequestLimits,
    SamplingParams,
    check_request,
    sample_rows,
    token_logprobs,
)


def left_pad(input_ids: torch.Tensor | abc.Sequence[abc.Sequence[int]], attention_mask: torch.Tensor | None = None,
             pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise prompts to a left-padded (B, T) id tensor and its (B, T) bool mask: a 1-D or 2-D tensor (with an
    optional attention mask, padded on either side) or token-id lists of any lengths."""
    device = None
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids.unsqueeze(0) if input_ids.dim() == 1 else input_ids
        device = input_ids.device
        if ids.dim() != 2:
            raise ValueError(f"input_ids must be 1-D or 2-D, got shape {tuple(input_ids.shape)}")
        if attention_mask is None:
            rows = ids.tolist()
        elif attention_mask.shape == ids.shape:
            rows = [row[m.bool()].tolist() for row, m in zip(ids, attention_mask)]
        else:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                             f"{tuple(ids.shape)}")
    else:
        rows = [list(row) for row in input_ids]
    if not rows:
        raise ValueError("generate() needs at least one prompt")
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows], dtype=torch.bool, device=device)
    return ids, mask


log = logging.getLogger(__name__)

# Padded prompt positions per prefill call: joining prompts are prefilled together up to this size (the
# attention mask of a call grows with its square).
PREFILL_TOKENS = 8192
NO_LIMITS = RequestLimits()  # a door that allows no more than the model's own limits


class QueueFull(RuntimeError):
    """The server already holds ``max_batch`` running and ``max_queue`` waiting sequences."""


@dataclass
class Event:
    """One generated token (``token`` set), or the end of a sequence that failed (``error`` set).
    ``finish_reason`` ("stop" / "length") is set on a sequence's last token."""

    token: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    is_stop_token: bool = False
    error: str | None = None
    greedy: bool | None = None  # with logprobs: whether the token was the most likely one


@dataclass(eq=False)
class Sequence:
    """One sequence to generate; ``sink`` receives its events on the scheduler thread. ``forced``: the tokens to
    emit instead of sampling (scoring a given continuation: each event then carries its log-probability)."""

    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[Event], None]
    decode: DecodeSettings = DecodeSettings()
    forced: list[int] | None = None
    generated: int = 0
    cancelled: bool = False
    finished: bool = False
    generator: torch.Generator | None = None
    adjustments: LogitsAdjustments = LogitsAdjustments()  # params' sampling fields, checked when submitted
    prefill_passes: int = 0  # the fused passes its prefill ran (fused:exact: the Jacobi passes it stands for)
    prefill_converged: bool | None = None  # fused:auto: whether its states met fused_tol before the cap


class Engine:
    """The scheduler. ``start()`` runs it on a background thread (the server); ``step()`` runs one iteration
    (``generate`` and scoring call it until their sequences finish). ``prefill_tokens``: padded positions per prefill
    call (None: every joining sequence with the same prefill in one call, as a fixed batch needs)."""

    def __init__(self, model: LanguageModel, max_batch: int = 16, max_queue: int = 256,
                 prefill_tokens: int | None = PREFILL_TOKENS):
        self.model = model
        self.max_batch, self.max_queue, self.prefill_tokens = max_batch, max_queue, prefill_tokens
        self.device = model.device
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._clear_batch()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.counters = {"completed": 0, "cancelled": 0, "failed": 0, "generated_tokens": 0, "compactions": 0,
                         "peak_batch": 0}

    def submit(self, sequences: list[Sequence], limits: RequestLimits | None = NO_LIMITS) -> None:
        """Queue sequences (all or none); raise RequestError (``fullband.sampling``, naming the parameter) for one
        that cannot be served within the door's ``limits`` (None: the door has checked them), QueueFull when there
        is no room for all of them."""
        for seq in sequences:
            if limits is not None:
                seq.adjustments = check_request(self.model.config, [seq.prompt_ids], seq.params, limits)
        with self._cond:
            free = self.max_batch + self.max_queue - len(self._rows) - len(self._waiting)
            if len(sequences) > free:
                raise QueueFull(
                    f"the server is busy: {len(self._rows)} sequences running and {len(self._waiting)} waiting "
                    f"(max_batch {self.max_batch}, max_queue {self.max_queue}); retry later"
                )
            self._waiting.extend(sequences)
            self._cond.notify()

    def cancel(self, seq: Sequence) -> None:
        """Stop a sequence (its client went away or has what it needs); its slot frees at the next step."""
        with self._cond:
            if seq.finished:
                return
            seq.cancelled = True
            self._cond.notify()

    def stats(self) -> dict[str, int]:
        with self._cond:
            # A row that has sent its last token leaves the batch a moment later; it no longer counts.
            running = sum(not s.finished for s in self._rows)
            return {"running": running, "waiting": len(self._waiting), "max_batch": self.max_batch,
                    "max_queue": self.max_queue, **self.counters}

    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="fullband-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._rows and not self._waiting:
                    self._cond.wait()
                if self._stopping:
                    break
            try:
                self.step()
            except Exception as exc:  # never let one bad step kill the server: fail the batch, go on
                log.exception("scheduler step failed")
                self._fail_all(f"internal error while generating: {exc}")

    @torch.no_grad()
    def step(self) -> None:
        """Admit waiting sequences, sample one token for every row, drop finished rows, run the forward."""
        self._admit()
        if not self._rows:
            return
        tokens = self._sample()
        self._adjuster.record(tokens)
        keep = self._emit(tokens)
        if len(keep) < len(self._rows):
            self._remove_rows(keep)
            if not self._rows:
                return
            tokens = tokens[torch.tensor(keep, device=self.device)]
        self._forward(tokens)

    def _admit(self) -> None:
        """Prefill the waiting sequences that fit in the batch and let them join it: those that need the same
        prefill together, left-padded, up to ``prefill_tokens`` padded positions per call."""
        if not self._waiting:  # the common step: nothing queued, no lock taken
            return
        with self._cond:
            for seq in [s for s in self._waiting if s.cancelled]:
                self._waiting.remove(seq)
                seq.finished = True
                self.counters["cancelled"] += 1
            room = self.max_batch - len(self._rows)
            joining = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
        groups: dict[tuple[int | str, float, int], list[list[Sequence]]] = {}
        for seq in joining:
            decode = seq.decode
            chunks = groups.setdefault((decode.prefill_passes, decode.fused_tol, decode.fused_max_passes), [[]])
            longest = max([len(seq.prompt_ids), *(len(s.prompt_ids) for s in chunks[-1])])
            limit = self.prefill_tokens
            if chunks[-1] and limit is not None and (len(chunks[-1]) + 1) * longest > limit:
                chunks.append([])
            chunks[-1].append(seq)
        for prefill, chunks in groups.items():
            for group in chunks:
                try:
                    self._prefill_and_join(group, *prefill)
                except Exception as exc:  # requests that fail alone must not take the batch down
                    log.exception("prefill failed")
                    for seq in group:
                        self._finish(seq, "failed")
                        seq.sink(Event(error=f"internal error while reading the prompt: {exc}"))

    def _prefill_and_join(self, group: list[Sequence], passes: int | str, tol: float, max_passes: int) -> None:
        ids, mask = left_pad([seq.prompt_ids for seq in group])
        ids, mask = ids.to(self.device), mask.to(self.device)
        # The first sequences of an empty batch keep this cache as the batch's: room for their whole generation.
        room = max(seq.params.max_tokens for seq in group) if self._cache is None else 0
        own = self.model.new_cache(len(group), ids.shape[1] + room)
        out = self.model.prefill(ids, passes, attention_mask=mask, past_key_values=own, use_cache=True,
                                 logits_to_keep=1, fused_tol=tol, fused_max_passes=max_passes)
        for i, seq in enumerate(group):
            # Unseeded: a seed from torch's global generator, so that torch.manual_seed makes a run repeatable.
            seed = int(torch.randint(2**62, (1,))) if seq.params.seed is None else seq.params.seed
            seq.generator = torch.Generator(device=self.device).manual_seed(seed)
            seq.prefill_passes = int(out.fused_passes[i])
            if out.converged is not None:
                seq.prefill_converged = bool(out.converged[i])
        adjuster = BatchAdjuster([seq.adjustments for seq in group], ids, mask,
                                 [seq.params.stop_token_ids for seq in group], self.model.config.vocab_size)
        self._join(group, own, out.logits[:, -1], out.hidden[:, -1:], adjuster)

    def _join(self, group: list[Sequence], prefilled: ModelCache, logits: torch.Tensor, state: torch.Tensor,
              adjuster: BatchAdjuster) -> None:
        """Add prefilled sequences to the batch: each one's cached positions end at the write position."""
        positions = torch.tensor([[len(seq.prompt_ids)] for seq in group], device=self.device)
        plain = torch.tensor([[seq.decode.mode == "standard"] for seq in group], device=self.device)
        if self._cache is None:
            self._cache = prefilled
        else:
            cache, width = self._cache, prefilled.length
            # A longer prompt moves the batch right; then leave as much room again, so joins rarely reallocate.
            cache.join(prefilled, max(cache.max_len, 2 * width) if cache.length < width else None)
        for name, value in (("_logits", logits), ("_state", state), ("_positions", positions), ("_plain", plain)):
            current = getattr(self, name)
            setattr(self, name, value if current is None else torch.cat([current, value]))
        if self._adjuster is None:
            self._adjuster = adjuster
        else:
            self._adjuster.extend(adjuster)
        self._rows.extend(group)
        self._n_standard += sum(seq.decode.mode == "standard" for seq in group)
        self.counters["peak_batch"] = max(self.counters["peak_batch"], len(self._rows))

    def _ensure_room(self) -> None:
        """Before a decode step: one free column at the write position. A full cache drops the columns that are
        padding for every row, and grows when that leaves less than half of it free."""
        cache = self._cache
        if not isinstance(cache, KVCache) or cache.length < cache.max_len:  # a recurrent state never fills
            return
        cache.compact()
        if 2 * cache.length >= cache.max_len:
            cache.grow(2 * (cache.length + 1))
        self.counters["compactions"] += 1

    def _sample(self) -> torch.Tensor:
        logits = self._adjuster.adjust(self._logits)
        tokens = sample_rows(logits, [seq.params for seq in self._rows], [seq.generator for seq in self._rows])
        forced = [(i, seq.forced[seq.generated]) for i, seq in enumerate(self._rows) if seq.forced is not None]
        if forced:
            rows, given = zip(*forced)
            tokens[list(rows)] = torch.tensor(given, device=tokens.device)
        return tokens

    def _emit(self, tokens: torch.Tensor) -> list[int]:
        """Send each row its token; return the indices of the rows that continue."""
        token_list = tokens.tolist()
        want_logprobs = [i for i, s in enumerate(self._rows) if s.params.logprobs is not None]
        logprobs = picked = greedy = None
        if want_logprobs:
            logprobs, picked, greedy = token_logprobs(self._logits[want_logprobs], tokens[want_logprobs])
            picked, greedy = picked.tolist(), greedy.tolist()
        keep = []
        for i, (seq, token) in enumerate(zip(self._rows, token_list)):
            if seq.cancelled:
                self._finish(seq, "cancelled")
                continue
            seq.generated += 1
            self.counters["generated_tokens"] += 1
            event = Event(token=token)
            if seq.params.logprobs is not None:
                at = want_logprobs.index(i)
                event.logprob, event.greedy = picked[at], greedy[at]
                if seq.params.logprobs > 0:
                    top = logprobs[at].topk(seq.params.logprobs)
                    event.top_logprobs = list(zip(top.indices.tolist(), top.values.tolist()))
            if token in seq.params.stop_token_ids:
                event.finish_reason, event.is_stop_token = "stop", True
            elif seq.generated >= seq.params.max_tokens:
                event.finish_reason = "length"
            if event.finish_reason is not None:
                self._finish(seq, "completed")  # before the client hears of it, so /health agrees
            else:
                keep.append(i)
            seq.sink(event)
        return keep

    def _finish(self, seq: Sequence, counter: str) -> None:
        with self._cond:
            seq.finished = True
            self.counters[counter] += 1

    def _clear_batch(self) -> None:
        self._rows: list[Sequence] = []
        self._cache: ModelCache | None = None  # a KV cache, or a recurrent baseline's state
        self._adjuster: BatchAdjuster | None = None  # the rows' sampling fields and token history
        # Per-row tensors of the running batch, in the order of self._rows.
        self._logits = self._state = self._positions = self._plain = None
        self._n_standard = 0  # rows in standard mode: counted as rows join and leave, not at every step

    def _remove_rows(self, keep: list[int]) -> None:
        if not keep:
            self._clear_batch()
            return
        self._rows = [self._rows[i] for i in keep]
        self._n_standard = sum(seq.decode.mode == "standard" for seq in self._rows)
        index = torch.tensor(keep, device=self.device)
        self._cache.select_rows(index)
        self._adjuster.select(keep)
        for name in ("_logits", "_state", "_positions", "_plain"):
            setattr(self, name, getattr(self, name).index_select(0, index))

    def _forward(self, tokens: torch.Tensor) -> None:
        self._ensure_room()
        standard, rows = self._n_standard, len(self._rows)
        out = self.model(
            tokens.unsqueeze(1),
            feedback=None if standard == rows else self._state,
            plain_mask=self._plain if 0 < standard < rows else None,
            position_ids=self._positions,
            past_key_values=self._cache,
            use_cache=True,
        )
        self._logits, self._state = out.logits[:, -1], out.hidden
        self._positions = self._positions + 1

    def _fail_all(self, message: str) -> None:
        rows = self._rows
        self._clear_batch()
        for seq in rows:
            self._finish(seq, "failed")
            seq.sink(Event(error=message))
