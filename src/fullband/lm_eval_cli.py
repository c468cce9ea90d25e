"""``fullband lm-eval ARGS``: lm-evaluation-harness's own command line with the ``fullband`` model registered; kept
apart from ``fullband.lm_eval`` so that building the ``fullband`` parser does not import lm-eval."""

from __future__ import annotations

import argparse

from fullband.errors import FullbandError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    # prefix_chars="+" makes argparse treat lm-eval's --options as plain words, so all of them (and --help)
    # reach lm-eval in their original order.
    p = subparsers.add_parser(
        "lm-eval", add_help=False, prefix_chars="+",
        help="run lm-evaluation-harness (its own flags) with the 'fullband' model registered; needs fullband[eval]",
    )
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="arguments of lm-eval")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    try:
        from fullband.lm_eval import lm_eval_main
    except ImportError as exc:
        raise FullbandError(f"{exc} (the lm-eval command needs the eval extra: pip install 'fullband[eval]')") from exc
    lm_eval_main(args.lm_eval_args)
