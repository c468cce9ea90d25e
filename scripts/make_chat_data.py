"""Write a small synthetic chat set (question/answer conversations from the synthetic tasks) as .jsonl
for trying instruction tuning: see docs/instruction-tuning.md.

    python scripts/make_chat_data.py --out data/chat.jsonl --conversations 4000
"""

from __future__ import annotations

import argparse

from fullband.data.chat_examples import CHAT_TASKS, synthetic_chat_records
from fullband.data.synthetic import write_jsonl
from fullband.errors import FullbandError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the .jsonl file to write")
    parser.add_argument("--conversations", type=int, default=4000, help="number of conversations (default: 4000)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default: 0)")
    parser.add_argument("--tasks", default=",".join(CHAT_TASKS),
                        help=f"comma-separated synthetic tasks (default: {','.join(CHAT_TASKS)})")
    args = parser.parse_args()
    if args.conversations < 1:
        parser.error("--conversations must be at least 1")
    try:
        records = synthetic_chat_records(args.conversations, args.seed, tuple(args.tasks.split(",")))
    except FullbandError as exc:  # an unknown task name: say which ones exist
        parser.error(str(exc))
    print(f"wrote {len(records)} conversations to {write_jsonl(records, args.out)}")


if __name__ == "__main__":
    main()
