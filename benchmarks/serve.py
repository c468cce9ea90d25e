"""Throughput and latency of ``fullband serve`` under concurrent clients, standard against soft decoding.

A real server process (``python -m fullband serve``, continuous batching) serves a random-weight model with a
byte tokenizer; asyncio clients stream completions (``ignore_eos``, so every request yields exactly
``--max-tokens`` tokens). At each concurrency c, c clients each send ``--requests`` requests one after the
other, all in one decode mode. Per (concurrency, mode):

- throughput: generated tokens / wall time of the whole level (all clients),
- TTFT: time from sending a request to its first token (queueing and prefill included), median and p99,
- inter-token latency: gaps between consecutive tokens of a request, p50 and p99 over all requests.

Each repetition runs every (concurrency, mode) once, the two modes in an order rotated from repetition to
repetition; the soft/standard ratios are taken within a repetition (paired) and summarised by their median.
Clients and server share the machine, so the figures include the clients' own CPU time.

Usage:
    python benchmarks/serve.py            # full run (about a minute on 2 CPU cores)
    python benchmarks/serve.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from common import add_common_arguments, machine_info, print_header

from fullband.data.tokenizers import ByteTokenizer
from fullband.model import FullBandConfig, FullBandLM

MODEL = dict(vocab_size=259, d_model=512, n_layers=6, n_heads=8, d_ff=1536, max_seq_len=512)
QUICK_MODEL = dict(vocab_size=259, d_model=128, n_layers=2, n_heads=4, d_ff=384, max_seq_len=256)
MODES = ("standard", "soft")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def start_server(
    model_dir: Path, threads: int, max_batch: int, dtype: str, device: str
) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, "-m", "fullband", "serve", str(model_dir), "--port", str(port), "--max-batch",
               str(max_batch), "--dtype", dtype, "--device", device, "--log-level", "warning"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited: {process.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise SystemExit("the server did not start within 120 s")


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, extra: dict, max_tokens: int) -> dict:
    """One streamed greedy completion of ``max_tokens`` tokens (``extra``: the server's own fields); its time to the
    first token, the gaps between tokens and its latency."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True, **extra}
    start = time.perf_counter()
    times = []
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise SystemExit(f"request failed ({response.status_code}): {await response.aread()}")
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())  # one chunk per token
    return {"ttft": times[0] - start, "gaps": [b - a for a, b in zip(times, times[1:])],
            "latency": times[-1] - start, "tokens": len(times)}


async def level(url: str, prompts: list[str], mode: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    async def client_loop(client, worker):
        return [await one_request(client, url, prompts[(worker * requests + i) % len(prompts)],
                                  {"model": "bench", "decode_mode": mode}, max_tokens)
                for i in range(requests)]

    limits = httpx.Limits(max_connections=concurrency + 1)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(client_loop(client, w) for w in range(concurrency)))
        wall = time.perf_counter() - start
    done = [r for worker in results for r in worker]
    gaps = [g for r in done for g in r["gaps"]]
    tokens = sum(r["tokens"] for r in done)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_ms": 1e3 * statistics.median(r["ttft"] for r in done),
            "ttft_p99_ms": 1e3 * percentile([r["ttft"] for r in done], 99),
            "itl_p50_ms": 1e3 * percentile(gaps, 50), "itl_p99_ms": 1e3 * percentile(gaps, 99)}


def table(summary: dict) -> str:
    lines = ["| concurrency | mode | tokens/s | TTFT p50 (ms) | TTFT p99 (ms) | inter-token p50 (ms) | "
             "inter-token p99 (ms) |", "|---|---|---|---|---|---|---|"]
    for c, by_mode in summary.items():
        for mode in MODES:
            m = by_mode[mode]
            lines.append(f"| {c} | {mode} | {m['tokens_per_s']:.1f} | {m['ttft_p50_ms']:.1f} | "
                         f"{m['ttft_p99_ms']:.1f} | {m['itl_p50_ms']:.2f} | {m['itl_p99_ms']:.2f} |")
        r = by_mode["ratio_soft_over_standard"]
        lines.append(f"| {c} | soft / standard | {r['tokens_per_s']:.3f} | {r['ttft_p50_ms']:.3f} | "
                     f"{r['ttft_p99_ms']:.3f} | {r['itl_p50_ms']:.3f} | {r['itl_p99_ms']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(p, quick_help="a small model and short requests (smoke run)",
                         repeats_help="repetitions of every (concurrency, mode) (default 3; quick 1)",
                         dtypes=["float32", "bfloat16"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="client counts (default 1 4 16)")
    p.add_argument("--requests", type=int, default=2, help="requests per client at each level (default 2)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length in bytes (default 64)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 64; quick 16)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/serve[_quick].json)")
    args = p.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    max_tokens = args.max_tokens or (16 if args.quick else 64)
    out = Path(args.out or "benchmarks/results/serve" + ("_quick" if args.quick else "") + ".json")
    machine = machine_info(args.threads, args.device)
    command = print_header("fullband serve: throughput and latency, standard vs soft", argv, machine, args)
    config = FullBandConfig(**(QUICK_MODEL if args.quick else MODEL))
    if args.prompt_tokens + max_tokens > config.max_seq_len:
        p.error(f"--prompt-tokens + --max-tokens must fit the model's context {config.max_seq_len}")

    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz     ,.\n"
    prompts = ["".join(rng.choice(alphabet) for _ in range(args.prompt_tokens - 1)) for _ in range(64)]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "bench"
        FullBandLM(config).save_pretrained(model_dir)
        ByteTokenizer().save(model_dir / "tokenizer")
        process, url = start_server(model_dir, args.threads, max(args.concurrency), args.dtype, args.device)
        try:
            asyncio.run(level(url, prompts, "soft", 2, 1, 8))  # warm-up: first requests pay one-off costs
            runs = {c: {m: [] for m in MODES} for c in args.concurrency}
            for rep in range(repeats):
                for c in args.concurrency:
                    order = MODES if rep % 2 == 0 else MODES[::-1]
                    for mode in order:
                        runs[c][mode].append(asyncio.run(level(url, prompts, mode, c, args.requests, max_tokens)))
        finally:
            process.terminate()
            process.wait()

    keys = ["tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"]
    summary = {}
    for c, by_mode in runs.items():
        summary[c] = {m: {k: statistics.median(r[k] for r in by_mode[m]) for k in keys} for m in MODES}
        summary[c]["ratio_soft_over_standard"] = {
            k: statistics.median(s[k] / b[k] for s, b in zip(by_mode["soft"], by_mode["standard"])) for k in keys}
    print(f"model {config.d_model}x{config.n_layers} (vocab {config.vocab_size}), prompts {args.prompt_tokens} "
          f"tokens, {max_tokens} new tokens per request, {args.requests} requests per client, {repeats} repetitions; "
          "medians over repetitions, ratios paired within a repetition\n")
    print(table(summary))
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"command": command, "machine": machine, "model": config.to_dict(), "prompt_tokens": args.prompt_tokens,
               "max_tokens": max_tokens, "requests_per_client": args.requests, "repeats": repeats,
               "summary": summary, "runs": runs}
    out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
