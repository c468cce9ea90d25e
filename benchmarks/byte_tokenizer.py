"""Why the byte tokenizer encodes bytes itself: its own encode against its `tokenizers` backend's, on the same text,
plain and with the chat extension (which splits on its special tokens). The ids are checked equal; median of the
repetitions, interleaved.

Usage:
    python benchmarks/byte_tokenizer.py              # ~10 MB of text, 3 repetitions
    python benchmarks/byte_tokenizer.py --quick      # ~0.5 MB, 1 repetition
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from common import machine_info, write_record

from fullband.data.tokenizers import ByteTokenizer

WORDS = ("alpha", "beta", "gamma", "délta", "θ", "<|im_start|>", "<|im_end|>", "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=None, help="default 3 (quick 1)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/byte_tokenizer[_quick].json)")
    args = p.parse_args()
    torch.set_num_threads(1)
    repeats = args.repeats or (1 if args.quick else 3)
    rng = random.Random(0)
    text = " ".join(rng.choice(WORDS) for _ in range(75_000 if args.quick else 1_500_000))
    rows = []
    for chat in (False, True):
        tok = ByteTokenizer(chat)
        own, lib = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            ids = tok.encode_batch([text])[0]
            own.append(time.perf_counter() - start)
            start = time.perf_counter()
            ref = tok._tok.encode_batch([text], add_special_tokens=False)[0].ids
            lib.append(time.perf_counter() - start)
            if list(ids) != ref:
                sys.exit("the byte tokenizer's ids differ from its backend's")
        rows.append({"chat": chat, "bytes_s": statistics.median(own), "tokenizers_s": statistics.median(lib)})
    mb = len(text.encode()) / 1e6
    print(f"| byte tokenizer ({mb:.1f} MB, 1 thread) | its own encode, s | tokenizers' encode, s | ratio |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {'chat extension' if r['chat'] else 'plain'} | {r['bytes_s']:.3f} | {r['tokenizers_s']:.2f} "
              f"| {r['tokenizers_s'] / r['bytes_s']:.0f}x |")
    out = Path(args.out or Path(__file__).parent / "results" / f"byte_tokenizer{'_quick' if args.quick else ''}.json")
    write_record(out, {"benchmark": "byte_tokenizer", "command": " ".join(["python", *sys.argv]),
                       "machine": machine_info(1, "cpu"), "megabytes": mb, "repeats": repeats, "results": rows})


if __name__ == "__main__":
    main()
