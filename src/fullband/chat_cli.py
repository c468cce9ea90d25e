"""``fullband chat MODEL``: talk to an instruction-tuned model in the terminal, in any decode mode
(docs/instruction-tuning.md)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable

from fullband.cli_options import (
    add_decode_options,
    add_device_options,
    add_sampling_options,
    decode_from_args,
    model_dtype,
    sampling_params,
    write_answer,
)
from fullband.data.chat import apply_chat_template, end_of_turn_ids
from fullband.errors import FullbandError
from fullband.generation import generate_stream
from fullband.loading import load_model


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("chat", help="chat with an instruction-tuned model (see fullband sft)")
    p.add_argument("model", help="run directory, checkpoint or model directory")
    p.add_argument("--message", action="append", metavar="TEXT",
                   help="a user turn (repeat for several); without it, read turns from the terminal")
    p.add_argument("--system", metavar="TEXT", help="a system message opening the conversation")
    add_decode_options(p, "fullband chat")
    add_sampling_options(p, "longest answer in tokens (default: 200)")
    add_device_options(p)
    p.set_defaults(func=run)
    return p


def _user_turns(args: argparse.Namespace) -> Iterable[str]:
    if args.message:
        yield from args.message
        return
    while True:
        try:
            line = input("you> ")
        except EOFError:
            return
        if not line.strip():
            return
        yield line


def run(args: argparse.Namespace) -> None:
    model, tokenizer = load_model(args.model, args.device, model_dtype(args))
    decode = decode_from_args(model, args)
    # The turn ends at these: generate_stream also keeps them out until --min-tokens tokens are generated.
    sampling = sampling_params(args, args.max_new_tokens, end_of_turn_ids(tokenizer))
    stop = set(sampling.stop_token_ids)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    for turn in _user_turns(args):
        messages.append({"role": "user", "content": turn})
        prompt = apply_chat_template(tokenizer, messages)
        room = model.config.max_seq_len - len(prompt)
        if room < 1:
            raise FullbandError(f"the conversation is {len(prompt)} tokens, the model's max_seq_len is "
                                f"{model.config.max_seq_len}: start a new conversation")
        stream = generate_stream(model, [prompt], min(args.max_new_tokens, room), sampling=sampling, decode=decode)
        if args.message:  # echo scripted turns, so the transcript reads like the interactive one
            sys.stdout.write(f"you> {turn}\n")
        sys.stdout.write("assistant> ")
        messages.append({"role": "assistant", "content": write_answer(stream, tokenizer, stop)})
