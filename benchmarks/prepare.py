"""`fullband prepare` at corpus scale: tokens/s with 1 and 2 worker processes, byte and BPE tokenizer, and
peak memory (proportional set size of the whole process tree) on a corpus and on the same corpus 10 times over.

The corpus is real text: the Python standard library's .py files as JSON Lines documents (one file per
document), cut into files of about 2 MB. Every measurement runs in a fresh process that imports fullband
and starts its worker pool first (a tiny prepare, timed separately as the cold start), so tokens/s is the
throughput of the work itself. Runs are interleaved (repeat r of every configuration before repeat r + 1),
and the BPE tokenizer is trained once beforehand and loaded from its directory, as a corpus-scale run
would. TOKENIZERS_PARALLELISM=false: one worker is one core, so per-core throughput can be projected.

    python benchmarks/prepare.py            # ~2 minutes on 2 cores; --quick for a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from fullband.data import DataConfig, prepare_dataset, shards
from fullband.data.sources import pystdlib_files

RESULTS = Path(__file__).resolve().parent / "results"


def tree_pss(root: int) -> int:
    """Proportional set size in bytes of `root` and all its descendants (the forkserver and the workers), from
    /proc. PSS, not RSS: forked workers share their parent's pages, which RSS would count once per process."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we looked
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, parent in parents.items() if parent == pid]
        tree.update(kids)
        frontier += kids
    total = 0
    for pid in tree:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except (OSError, IndexError, ValueError):
            continue
    return total


def write_corpus(directory: Path, copies: int, target_bytes: int) -> tuple[int, int]:
    """`copies` copies of the stdlib corpus (each about target_bytes) as ~2 MB .jsonl files; (files, bytes)."""
    root, files = pystdlib_files()
    directory.mkdir(parents=True, exist_ok=True)
    docs, size = [], 0
    for rel in files:
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        docs.append(json.dumps({"text": text}) + "\n")
        size += len(docs[-1])
        if size >= target_bytes:
            break
    n_files, total = 0, 0
    for copy in range(copies):
        chunk, chunk_bytes = [], 0
        for line in docs + [None]:
            if line is not None:
                chunk.append(line)
                chunk_bytes += len(line)
            if chunk and (line is None or chunk_bytes >= 2 * 2**20):
                (directory / f"c{copy:03d}_{n_files:05d}.jsonl").write_text("".join(chunk))
                n_files, total = n_files + 1, total + chunk_bytes
                chunk, chunk_bytes = [], 0
    return n_files, total


def child(args: argparse.Namespace) -> None:
    """One measurement in this fresh process: warm up the pool, then prepare with PSS sampled every 20 ms."""
    warm = Path(args.out + "_warm")
    (warm / "src").mkdir(parents=True, exist_ok=True)
    for i in range(4):
        (warm / "src" / f"w{i}.txt").write_text("warm up " * 50)
    t0 = time.perf_counter()
    prepare_dataset(DataConfig(source=str(warm / "src"), tokenizer=args.tokenizer), warm / "out",
                    workers=args.workers, unit_bytes=100, overwrite=True)
    cold = time.perf_counter() - t0
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], tree_pss(os.getpid()))
            stop.wait(0.02)

    # The stitching of units into shards runs in the main process alone: timed apart, it is the serial
    # part of a projection to many cores (Amdahl).
    stitch = [0.0]
    assemble = shards._assemble_split

    def timed_assemble(*a, **k):
        t = time.perf_counter()
        try:
            return assemble(*a, **k)
        finally:
            stitch[0] += time.perf_counter() - t

    shards._assemble_split = timed_assemble
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    ds = prepare_dataset(DataConfig(source=args.source, tokenizer=args.tokenizer), args.out, workers=args.workers,
                         overwrite=True)
    elapsed = time.perf_counter() - t0
    stop.set()
    sampler.join()
    tokens = sum(s["tokens"] for s in ds.manifest["splits"].values())
    text = sum(s["text_bytes"] for s in ds.manifest["splits"].values())
    main_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB; the main process alone
    print(json.dumps({"seconds": elapsed, "tokens": tokens, "text_bytes": text, "peak_pss": peak[0],
                      "main_rss": main_rss, "cold_start_s": cold, "stitch_s": stitch[0]}))


BUSY = [sys.executable, "-c", "sum(range(5 * 10**7))"]  # ~1 s of one core, no I/O


def available_speedup() -> float:
    """How much faster two independent CPU-bound processes finish than one, right now: 2.0 on two idle cores,
    less when other jobs share them. The workers' speed-up is read against it."""
    t0 = time.perf_counter()
    subprocess.run(BUSY, check=True)
    one = time.perf_counter() - t0
    t0 = time.perf_counter()
    pair = [subprocess.Popen(BUSY) for _ in range(2)]
    for proc in pair:
        proc.wait()
    return 2 * one / (time.perf_counter() - t0)


def measure(source: str, tokenizer: str, workers: int, out: Path) -> dict:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--child", "--source", source, "--tokenizer", tokenizer,
           "--workers", str(workers), "--out", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"measurement failed: {' '.join(cmd)}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a 2 MB corpus and one repeat (smoke test)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats of each throughput run (default 3)")
    p.add_argument("--corpus-mb", type=float, default=None,
                   help="size of the 1x corpus (default 16: all of the stdlib's .py files, about 12 MB)")
    p.add_argument("--json", help="where to write the results (default benchmarks/results/prepare.json, "
                   "prepare_quick.json with --quick)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--source", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return
    repeats = args.repeats or (1 if args.quick else 3)
    args.json = args.json or str(RESULTS / ("prepare_quick.json" if args.quick else "prepare.json"))
    corpus_mb = args.corpus_mb or (2 if args.quick else 16)
    command = "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    with tempfile.TemporaryDirectory(prefix="fullband-prepare-bench-") as tmp:
        work = Path(tmp)
        n1, b1 = write_corpus(work / "x1", 1, int(corpus_mb * 2**20))
        n10, b10 = write_corpus(work / "x10", 10, int(corpus_mb * 2**20))
        t0 = time.perf_counter()
        bpe = prepare_dataset(DataConfig(source=str(work / "x1"), tokenizer="bpe", bpe_vocab_size=8192), work / "bpe")
        bpe_train_s = time.perf_counter() - t0  # trains on the train split, then tokenizes: an upper bound
        tokenizers = {"byte": "byte", "bpe": str(bpe.path / "tokenizer")}
        runs: dict[str, list[dict]] = {}
        available = []
        for _ in range(repeats):
            available.append(available_speedup())
            for name, tok in tokenizers.items():
                for workers in (1, 2):
                    runs.setdefault(f"{name}/{workers}", []).append(
                        measure(str(work / "x1"), tok, workers, work / "out"))
        memory = {}
        for scale, corpus in (("1x", "x1"), ("10x", "x10")):
            for workers in (1, 2):
                memory[f"{scale}/{workers}"] = measure(str(work / corpus), "byte", workers, work / "out")

    machine = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
               "load_average_at_end": os.getloadavg()}
    rows = []
    for key, results in runs.items():
        name, workers = key.split("/")
        seconds = statistics.median(r["seconds"] for r in results)
        tokens = results[0]["tokens"]
        rows.append({"tokenizer": name, "workers": int(workers), "tokens": tokens, "median_s": seconds,
                     "tokens_per_s": tokens / seconds, "mb_per_s": results[0]["text_bytes"] / seconds / 2**20,
                     "cold_start_s": statistics.median(r["cold_start_s"] for r in results),
                     "stitch_s": statistics.median(r["stitch_s"] for r in results),
                     "seconds_all": [r["seconds"] for r in results]})
    for row in rows:
        one = next(r for r in rows if r["tokenizer"] == row["tokenizer"] and r["workers"] == 1)
        row["speedup_vs_1"] = row["tokens_per_s"] / one["tokens_per_s"]
    mem_rows = [{"corpus": key.split("/")[0], "workers": int(key.split("/")[1]), "text_mb": r["text_bytes"] / 2**20,
                 "tokens": r["tokens"], "stitch_s": r["stitch_s"], "peak_pss_mb": r["peak_pss"] / 2**20,
                 "main_peak_rss_mb": r["main_rss"] / 2**20, "seconds": r["seconds"]}
                for key, r in memory.items()]
    result = {"command": command, "machine": machine, "corpus": {"1x_files": n1, "1x_bytes": b1, "10x_files": n10,
              "10x_bytes": b10, "what": "Python stdlib .py files as JSON Lines documents"},
              "repeats": repeats, "available_speedup_2_processes": available,
              "bpe_vocab_size": 8192, "bpe_prepare_with_training_s": bpe_train_s,
              "throughput": rows, "memory": mem_rows}
    print(f"# fullband prepare\n\ncommand: `{command}`\n")
    print(f"machine: {machine['cpu_count']} cores visible, Python {machine['python']}, load average at end "
          f"{machine['load_average_at_end'][0]:.1f}; corpus 1x = {b1 / 2**20:.1f} MB in {n1} .jsonl files; two "
          f"independent busy processes ran {statistics.median(available):.2f}x as fast as one (median of "
          f"{', '.join(f'{a:.2f}' for a in available)}; 2.00 = two free cores)\n")
    print("| tokenizer | workers | tokens | median s | tokens/s | text MB/s | speed-up vs 1 | stitching s "
          "| pool cold start s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokenizer']} | {r['workers']} | {r['tokens']:,} | {r['median_s']:.2f} | {r['tokens_per_s']:,.0f} "
              f"| {r['mb_per_s']:.2f} | {r['speedup_vs_1']:.2f} | {r['stitch_s']:.2f} | {r['cold_start_s']:.2f} |")
    print("\n| corpus | text MB | workers | tokens | peak PSS of all processes, MB | peak RSS of the main process, MB "
          "| s |")
    print("|---|---|---|---|---|---|---|")
    for r in mem_rows:
        print(f"| {r['corpus']} | {r['text_mb']:.0f} | {r['workers']} | {r['tokens']:,} | {r['peak_pss_mb']:.0f} "
              f"| {r['main_peak_rss_mb']:.0f} | {r['seconds']:.1f} |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
