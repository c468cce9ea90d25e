"""Time to the first token of ``fullband generate RUN`` on a run directory holding a ~300M-parameter model with its
AdamW state, against transformers' ``from_pretrained`` + ``generate`` on the same weights (its ``export-hf``
directory) as the anchor, and, with ``--before-src``, against another fullband source tree (e.g. a checkout of an
earlier revision) on the same run.

Each variant is one fresh process, timed from its start to the end of one greedy token (``--max-new-tokens 1``):
interpreter start, imports, finding and checking the checkpoint, building the model, reading the weights, the
prompt's prefill. The variants are interleaved, in an order rotated from repetition to repetition, after one
untimed warm-up of each, so every one reads the files from the page cache. The run is written by the trainer's own
checkpoint code (``fullband.train.checkpoint.write_checkpoint``: model directory, ``optimizer.pt`` with AdamW's two
moments, manifest with sha256 sums).

Usage:
    python benchmarks/load.py                                   # ~300M parameters, 3 repetitions (~2 min)
    mkdir /tmp/b && git archive REV src | tar -x -C /tmp/b && python benchmarks/load.py --before-src /tmp/b/src
    python benchmarks/load.py --quick                           # a tiny model: a smoke run (< 1 min)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import machine_info, write_record

from fullband.data import ByteTokenizer
from fullband.decoding import DecodeSettings
from fullband.hf import export_hf
from fullband.model import FullBandConfig, FullBandLM
from fullband.train.checkpoint import write_checkpoint

SIZES = {
    # ~302M parameters with the byte vocabulary (a byte tokenizer keeps the prompt and the token printable).
    "300M": {"d_model": 1024, "n_layers": 18, "n_heads": 16, "d_ff": 4096, "vocab_size": 259, "max_seq_len": 256},
    "quick": {"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 192, "vocab_size": 259, "max_seq_len": 64},
}
PROMPT = "def main():"
TRANSFORMERS = """
import sys
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.float32)
ids = torch.tensor([[256] + list(sys.argv[2].encode())])
print(model.generate(ids, max_new_tokens=1, do_sample=False)[0, -1].item())
"""


def build_run(root: Path, size: str) -> tuple[Path, Path, int]:
    """A run directory with one checkpoint of a random model and its AdamW state, and its export-hf directory."""
    torch.manual_seed(0)
    model = FullBandLM(FullBandConfig(**SIZES[size]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()  # AdamW's state: a step count and two moments per parameter
    run = root / "run"
    (run / "tokenizer").mkdir(parents=True)
    ByteTokenizer().save(run / "tokenizer")
    write_checkpoint(run, 1, model.state_dict(), model.config, DecodeSettings("soft"), run / "tokenizer",
                     optimizer.state_dict(), {"step": 1}, keep=1)
    export = export_hf(run, root / "export")
    return run, export, sum(p.numel() for p in model.parameters())


def commands(run: Path, export: Path, before_src: str | None) -> dict[str, tuple[list[str], dict[str, str]]]:
    generate = [sys.executable, "-m", "fullband", "generate", str(run), "--prompt", PROMPT, "--max-new-tokens", "1",
                "--device", "cpu"]
    env = dict(os.environ)
    variants = {"fullband generate": (generate, env),
                "transformers from_pretrained + generate": ([sys.executable, "-c", TRANSFORMERS, str(export), PROMPT],
                                                            env)}
    if before_src:
        variants["fullband generate (--before-src)"] = (generate, {**env, "PYTHONPATH": before_src})
    return variants


def time_once(command: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[:6])} ... failed:\n{done.stderr[-2000:]}")
    return elapsed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model, 1 repetition: a smoke run (< 1 min)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repetitions (default 3; quick 1)")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of every timed process (default 2)")
    p.add_argument("--before-src", default=None, metavar="DIR",
                   help="another fullband source tree (its src/), timed on the same run via PYTHONPATH")
    p.add_argument("--workdir", default=None, help="where the run is written (default: a temporary directory)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/load[_quick].json)")
    args = p.parse_args(argv)
    size = "quick" if args.quick else "300M"
    repeats = args.repeats or (1 if args.quick else 3)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    root = Path(tempfile.mkdtemp(prefix="fullband-load-", dir=args.workdir))
    try:
        run, export, n_params = build_run(root, size)
        sizes = {name: sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                 for name, path in (("run", run), ("export", export))}
        variants = commands(run, export, args.before_src)
        for command, env in variants.values():  # warm-up: imports compiled, files in the page cache
            time_once(command, env)
        times: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        for r in range(repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:
                times[name].append(time_once(*variants[name]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    anchor = "transformers from_pretrained + generate"
    rows = {name: {"seconds": t, "median_s": statistics.median(t),
                   "ratio_to_transformers": [a / b for a, b in zip(t, times[anchor])]} for name, t in times.items()}
    print(f"# Time to the first token: {n_params / 1e6:.0f}M parameters, run directory {sizes['run'] / 2**30:.2f} GiB "
          f"(optimizer state included), export {sizes['export'] / 2**30:.2f} GiB, {repeats} repetitions\n")
    print("| variant | median s | runs (s) | ratio to transformers (per repetition) |")
    print("|---|---|---|---|")
    for name, row in rows.items():
        runs = ", ".join(f"{x:.2f}" for x in row["seconds"])
        ratios = ", ".join(f"{x:.2f}" for x in row["ratio_to_transformers"])
        print(f"| {name} | {row['median_s']:.2f} | {runs} | {ratios} |")
    default = Path(__file__).parent / "results" / f"load{'_quick' if args.quick else ''}.json"
    out = Path(args.out) if args.out else default
    write_record(out, {"benchmark": "load", "command": "python " + " ".join(sys.argv), "size": size,
                       "parameters": n_params, "bytes": sizes, "repeats": repeats, "prompt": PROMPT,
                       "machine": machine_info(args.threads, "cpu"), "results": rows})


if __name__ == "__main__":
    main()
