"""The continuous-batching scheduler against ``fullband.generation.generate``: same tokens and log-probabilities
when requests of every decode mode join and leave a running batch at arbitrary steps."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from conftest import make_model, reference_decode

from fullband.decoding import DecodeSettings
from fullband.engine import Engine, QueueFull, Sequence
from fullband.engine import SamplingParams as _SamplingParams
from fullband.generation import generate

MODES = [("standard", 1), ("soft", 1), ("fused", 1), ("fused", 3)]


@dataclasses.dataclass(frozen=True)
class Request:
    """A request as the engine takes it: its sampling parameters and its decode settings."""

    params: _SamplingParams
    decode: DecodeSettings


def SamplingParams(mode: str = "soft", fused_passes: int | str = 1, **kwargs) -> Request:
    """The engine's request parameters with the decode settings of ``mode`` and ``fused_passes``."""
    return Request(_SamplingParams(**kwargs), DecodeSettings(mode, fused_passes))


def collect(prompt: list[int], request: Request) -> tuple[Sequence, list]:
    events: list = []
    return Sequence(prompt, request.params, events.append, request.decode), events


def run_to_end(engine: Engine, sequences: list[Sequence]) -> None:
    for _ in range(10_000):
        if all(s.finished for s in sequences):
            return
        engine.step()
    raise AssertionError("sequences did not finish")


def reference(model, prompt, request: Request | Sequence) -> list[int]:
    """The greedy tokens of fullband.generation.generate for the same prompt and mode."""
    tokens = generate(model, [prompt], request.params.max_tokens, decode=request.decode)[0]
    return tokens.tolist()


def record_prefills(model, monkeypatch) -> list[tuple[int, int]]:
    """(rows, padded length) of every prefill call the engine makes."""
    shapes = []
    real_prefill = model.prefill
    monkeypatch.setattr(model, "prefill", lambda ids, *a, **k: shapes.append(tuple(ids.shape)) or real_prefill(
        ids, *a, **k))
    return shapes


@pytest.mark.parametrize("window", [False, True])
def test_staggered_joins_match_generate(single_thread, monkeypatch, window):
    extra = dict(n_kv_heads=2, sliding_window=5, full_attention_every=2) if window else {}
    model = make_model(seed=1, dtype=torch.float64, max_seq_len=48, **extra)
    g = torch.Generator().manual_seed(0)
    # Prompts of different lengths, modes mixed, joining at different steps, three at a time (prefilled
    # together when their fused passes agree); a long prompt joining a batch whose write position is behind
    # it forces the left shift, and the long run forces compactions.
    plan = []  # (join step, prompt, params)
    for i in range(12):
        mode, passes = MODES[i % len(MODES)]
        length = int(torch.randint(1, 20, (1,), generator=g))
        prompt = torch.randint(0, 64, (length,), generator=g).tolist()
        plan.append((5 * (i // 3), prompt, SamplingParams(max_tokens=int(torch.randint(1, 28, (1,), generator=g)),
                                                   mode=mode, fused_passes=passes, logprobs=2)))
    shapes = record_prefills(model, monkeypatch)
    engine = Engine(model, max_batch=6, max_queue=16)
    sequences = []
    for step in range(10_000):
        for join, prompt, params in plan:
            if join == step:
                seq, events = collect(prompt, params)
                engine.submit([seq])
                sequences.append((seq, events, prompt, params))
        if step > plan[-1][0] and all(s.finished for s, *_ in sequences):
            break
        engine.step()
    assert engine.counters["compactions"] > 0
    assert any(rows > 1 for rows, _ in shapes), shapes  # some sequences were prefilled together
    for _seq, events, prompt, params in sequences:
        got = [e.token for e in events]
        assert got == reference(model, prompt, params), params.decode
        assert events[-1].finish_reason == "length" and all(e.finish_reason is None for e in events[:-1])
        # Every step's distribution equals that of decoding without any cache, recomputing the whole sequence.
        _, step_logits = reference_decode(model, torch.tensor([prompt]), len(got), params.decode.mode,
                                         params.decode.fused_passes)
        expected = step_logits.log_softmax(-1)
        torch.testing.assert_close(torch.tensor([e.logprob for e in events], dtype=torch.float64),
                                   expected[torch.arange(len(got)), got], rtol=0, atol=1e-10)
        assert [[t for t, _ in e.top_logprobs] for e in events] == expected.topk(2).indices.tolist()
    assert engine.stats()["running"] == 0 and engine._cache is None


def test_joining_prompts_are_prefilled_in_bounded_groups(single_thread, monkeypatch):
    model = make_model(seed=6, dtype=torch.float64, max_seq_len=40)
    shapes = record_prefills(model, monkeypatch)
    engine = Engine(model, max_batch=8, prefill_tokens=20)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], list(range(11, 23)), [23, 24, 25], [26, 27]]
    modes = ["soft", "standard", "soft", "standard", "fused"]
    runs = [collect(p, SamplingParams(max_tokens=6, mode=m)) for p, m in zip(prompts, modes)]
    engine.submit([seq for seq, _ in runs])
    run_to_end(engine, [seq for seq, _ in runs])
    # Plain prefills: 5 + 5 together (2 x 5 <= 20), then 12 alone (3 x 12 > 20), then 3 (2 x 12 > 20); fused apart.
    assert shapes == [(2, 5), (1, 12), (1, 3), (1, 2)]
    for (seq, events), prompt in zip(runs, prompts):
        assert [e.token for e in events] == reference(model, prompt, seq)


def test_stop_tokens_cancel_and_queue_limits(single_thread):
    model = make_model(seed=2, dtype=torch.float64, max_seq_len=40)
    prompt = [1, 2, 3, 4]
    expected = reference(model, prompt, SamplingParams(max_tokens=12))
    engine = Engine(model, max_batch=1, max_queue=1)
    stop, stop_events = collect(prompt, SamplingParams(max_tokens=12, stop_token_ids=(expected[5],)))
    waiting, waiting_events = collect(prompt, SamplingParams(max_tokens=3, mode="standard"))
    engine.submit([stop])
    engine.submit([waiting])
    with pytest.raises(QueueFull, match="busy"):
        engine.submit([collect(prompt, SamplingParams(max_tokens=3))[0]])
    run_to_end(engine, [stop, waiting])
    first_stop = expected.index(expected[5])
    assert [e.token for e in stop_events] == expected[: first_stop + 1]
    assert stop_events[-1].finish_reason == "stop" and stop_events[-1].is_stop_token
    assert [e.token for e in waiting_events] == reference(model, prompt, waiting)

    # A cancelled running sequence leaves at the next step and frees its slot for the waiting one.
    long, long_events = collect(prompt, SamplingParams(max_tokens=30))
    queued, queued_events = collect(prompt, SamplingParams(max_tokens=2))
    engine.submit([long, queued])
    engine.step()
    engine.step()
    engine.cancel(long)
    run_to_end(engine, [long, queued])
    assert len(long_events) == 2 and len(queued_events) == 2
    assert engine.stats()["cancelled"] == 1 and engine.stats()["running"] == 0


def test_seeded_sampling_does_not_depend_on_the_batch(single_thread):
    model = make_model(seed=3, dtype=torch.float64, max_seq_len=40)
    params = SamplingParams(max_tokens=15, temperature=1.3, top_p=0.9, seed=7, mode="soft")
    alone, alone_events = collect([5, 6, 7], params)
    engine = Engine(model, max_batch=8)
    engine.submit([alone])
    run_to_end(engine, [alone])
    crowd = [collect([i + 1] * (i + 2), SamplingParams(max_tokens=20, temperature=1.0, seed=i)) for i in range(5)]
    engine.submit([s for s, _ in crowd[:3]])
    engine.step()
    again, again_events = collect([5, 6, 7], params)
    engine.submit([again] + [s for s, _ in crowd[3:]])
    run_to_end(engine, [again] + [s for s, _ in crowd])
    assert [e.token for e in again_events] == [e.token for e in alone_events]
    reseeded = dataclasses.replace(params, params=dataclasses.replace(params.params, seed=8))
    other, other_events = collect([5, 6, 7], reseeded)
    engine.submit([other])
    run_to_end(engine, [other])
    assert [e.token for e in other_events] != [e.token for e in alone_events]


def test_bad_requests_are_refused_before_queueing():
    model = make_model(seed=0, max_seq_len=16)
    engine = Engine(model)
    cases = [
        ([1] * 10, SamplingParams(max_tokens=7), "exceeds the model's context length 16"),
        ([1], SamplingParams(max_tokens=1, temperature=-1), "temperature"),
        ([1], SamplingParams(max_tokens=1, top_p=0), "top_p"),
        ([99], SamplingParams(max_tokens=1), "outside the model's vocabulary"),
        ([], SamplingParams(max_tokens=1), "empty"),
    ]
    for prompt, params, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.submit([collect(prompt, params)[0]])
    assert engine.stats()["waiting"] == 0


def test_a_failing_step_fails_its_sequences_and_the_scheduler_goes_on(single_thread, monkeypatch):
    model = make_model(seed=0, max_seq_len=32)
    engine = Engine(model, max_batch=4)
    engine.start()
    try:
        real_forward = engine._forward

        def broken_forward(tokens):
            monkeypatch.setattr(engine, "_forward", real_forward)  # fail once
            raise RuntimeError("boom")

        monkeypatch.setattr(engine, "_forward", broken_forward)
        done = threading.Event()
        events: list = []
        seq = Sequence([1, 2], _SamplingParams(max_tokens=5), lambda e: (events.append(e), e.error and done.set()))
        engine.submit([seq])
        assert done.wait(30)
        assert "boom" in events[-1].error and engine.stats()["failed"] == 1 and engine.stats()["running"] == 0

        finished = threading.Event()
        later: list = []
        seq = Sequence([1, 2], _SamplingParams(max_tokens=5),
                       lambda e: (later.append(e), e.finish_reason and finished.set()))
        engine.submit([seq])
        assert finished.wait(30)
        assert [e.token for e in later] == reference(model, [1, 2], seq)
    finally:
        engine.stop()


def test_a_seeded_request_samples_what_generate_samples_with_that_seed(single_thread):
    model = make_model(seed=4, dtype=torch.float64, max_seq_len=40)
    request = SamplingParams(max_tokens=12, temperature=1.1, top_p=0.9, seed=21, mode="soft")
    seq, events = collect([3, 1, 4, 1], request)
    engine = Engine(model, max_batch=4)
    crowd = [collect([i + 2] * 3, SamplingParams(max_tokens=8, temperature=1.0, seed=100 + i)) for i in range(2)]
    engine.submit([seq] + [s for s, _ in crowd])
    run_to_end(engine, [seq] + [s for s, _ in crowd])
    sampled = generate(model, [[3, 1, 4, 1]], 12, decode=request.decode, temperature=1.1, top_p=0.9, seed=21)
    assert [e.token for e in events] == sampled[0].tolist()
    assert sampled[0].tolist() != generate(model, [[3, 1, 4, 1]], 12, decode=request.decode)[0].tolist()
