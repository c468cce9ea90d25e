"""Command-line options shared by several commands (config, data, device, decode and sampling options, and the streamed
answer), so that their modules do not import the ``fullband`` command itself."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Iterable
from typing import Any

import torch

from fullband.architectures import FBT, LanguageModel
from fullband.config import MODEL_CONFIGS, SECTIONS, field_help
from fullband.data import Tokenizer
from fullband.decoding import DecodeSettings
from fullband.detokenize import StreamingDetokenizer
from fullband.errors import ConfigError
from fullband.generation import decode_settings
from fullband.loading import DTYPES, PRESET_DIR
from fullband.sampling import SamplingParams

METAVARS = {int: "INT", float: "FLOAT", str: "STR", bool: "BOOL", dict: "YAML_MAPPING"}


def add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config file, or a preset name: "
                        + ", ".join(sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))))
    for section, cls in SECTIONS.items():
        # The model section's options: the fields of every model kind's config (model.arch defaults to the FBT).
        classes, defaults = (MODEL_CONFIGS, {"arch": FBT}) if section == "model" else ((cls,), None)
        add_field_options(parser.add_argument_group(f"{section} options"), section, classes, defaults)


def add_field_options(group: argparse._ArgumentGroup, section: str, classes: Iterable[type],
                      defaults: dict[str, Any] | None = None) -> None:
    """``--section.field VALUE`` for the fields of the config dataclasses ``classes``, with their help and defaults
    (``defaults`` replacing some); the value is checked when the config is built (``fullband.config.coerce``)."""
    seen = set()
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in seen:
                continue
            seen.add(f.name)
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            default = (defaults or {}).get(f.name, default)
            group.add_argument(
                f"--{section}.{f.name}", dest=f"{section}.{f.name}", default=argparse.SUPPRESS,
                metavar=METAVARS.get(hints[f.name], str(hints[f.name]).replace("typing.", "").upper()),
                help=f"{field_help(cls, f.name)} (default: {default!r})".replace("%", "%%"),
            )


def add_validation_data_options(parser: argparse.ArgumentParser, batches: int) -> None:
    """The checkpoint and held-out data options of the commands that score a checkpoint on its dataset
    (``fullband eval``, ``jacobi``)."""
    parser.add_argument("checkpoint", help="run directory, checkpoint or model directory")
    parser.add_argument("--data-dir", metavar="DIR",
                        help="prepared dataset (default: the one the checkpoint was trained on)")
    parser.add_argument("--split", default="val", help="dataset split (default: val)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: min(max_seq_len, 256))")
    parser.add_argument("--batches", type=int, default=batches, help=f"number of batches (default: {batches})")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per batch (default: 8)")
    parser.add_argument("--no-sequential", action="store_true", help="skip the (slow) exact sequential recurrence")
    add_device_options(parser)


def add_device_options(parser: argparse.ArgumentParser) -> None:
    """--device and --dtype of a command that opens a model: one rule for every door (``ModelDir.load``)."""
    parser.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    parser.add_argument("--dtype", choices=DTYPES, help="the weights' (and KV cache's) dtype (default: the dtype the "
                                                        "weights are stored in)")


def model_dtype(args: argparse.Namespace) -> torch.dtype | None:
    """The --dtype asked for (None: as stored)."""
    return getattr(torch, args.dtype) if args.dtype else None


def add_decode_options(parser: argparse.ArgumentParser, what: str = "generation") -> None:
    """--decode-mode, --fused-passes, --fused-tol and --fused-max-passes: each replaces one field of the decode
    settings stored with the model."""
    group = parser.add_argument_group(
        "decode settings", f"{what} decodes with the settings stored with the model (from how it was trained: "
        "standard for a model whose fusion was never trained, soft for the paper's schedule, fused:exact for the "
        "exact schedule); these options replace single fields")
    group.add_argument("--decode-mode", "--mode", dest="decode_mode", metavar="standard|soft|fused",
                       help="decode mode")
    group.add_argument("--fused-passes", metavar="N|auto|exact",
                       help="fused mode: extra fused prefill passes over the prompt, 'auto': until the prompt's "
                       "states change by at most --fused-tol in a pass, at most --fused-max-passes, or 'exact': the "
                       "exact recurrence over the prompt (the passes' fixed point), token by token")
    group.add_argument("--fused-tol", metavar="TOL", help="fused:auto: largest relative state change to stop at")
    group.add_argument("--fused-max-passes", metavar="N",
                       help="fused:auto: at most this many passes (and a server's bound per request)")


def decode_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The decode settings fields given on the command line (``add_decode_options``), checked: a bad value fails
    before the model is loaded."""
    given = {"decode_mode": args.decode_mode, "fused_passes": args.fused_passes,
             "fused_tol": args.fused_tol, "fused_max_passes": args.fused_max_passes}
    DecodeSettings().with_overrides(**given)
    return given


def decode_from_args(model: LanguageModel, args: argparse.Namespace) -> DecodeSettings:
    """What a command decodes with: the model's stored settings with the fields its command line gives replaced."""
    return decode_settings(model, **decode_overrides(args))


def _logit_bias_entry(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS (e.g. 50256=-100), got {text!r}") from None


def add_sampling_options(parser: argparse.ArgumentParser, max_new_tokens_help: str) -> None:
    """The sampling flags of ``fullband generate`` and ``chat``, and the OpenAI and vLLM sampling fields
    (``fullband.sampling``), applied as ``fullband serve`` applies them."""
    parser.add_argument("--max-new-tokens", type=int, default=200, help=max_new_tokens_help)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    parser.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1]")
    parser.add_argument("--seed", type=int, help="sampling seed")
    group = parser.add_argument_group("sampling fields", "adjust the logits before a token is chosen (greedy too), "
                                      "as the OpenAI and vLLM fields of the same names")
    group.add_argument("--logit-bias", action="append", type=_logit_bias_entry, metavar="TOKEN_ID=BIAS",
                       help="add BIAS in [-100, 100] to a token's logit (repeat for several tokens)")
    group.add_argument("--presence-penalty", type=float, default=0.0, metavar="P",
                       help="in [-2, 2]: subtract P from the logit of every token generated so far (default: 0)")
    group.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                       help="in [-2, 2]: subtract F times its count so far from a generated token's logit (default: 0)")
    group.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                       help="> 0: divide the positive logits of the tokens in the prompt or generated so far by R, "
                            "multiply their negative ones by R (default: 1 = off)")
    group.add_argument("--min-tokens", type=int, default=0, metavar="N",
                       help="do not end before N tokens: the end tokens are masked until then (default: 0)")
    group.add_argument("--stop-token-id", action="append", type=int, dest="stop_token_ids", metavar="ID",
                       help="also end at this token id (repeat for several)")


def sampling_params(args: argparse.Namespace, max_tokens: int, end_ids: Iterable[int] = ()) -> SamplingParams:
    """The request of a command's sampling flags (``add_sampling_options``), ending also at ``end_ids`` (the
    tokenizer's end tokens)."""
    bias: dict[int, float] = {}
    for token, value in args.logit_bias or []:
        if token in bias:
            raise ConfigError(f"--logit-bias names token {token} twice")
        bias[token] = value
    return SamplingParams(max_tokens=max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, logit_bias=bias, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                          min_tokens=args.min_tokens,
                          stop_token_ids=tuple(dict.fromkeys([*end_ids, *(args.stop_token_ids or ())])))


def write_answer(tokens: Iterable[torch.Tensor], tokenizer: Tokenizer, ends: set[int], stream: bool = True) -> str:
    """Write the text of generated tokens (rows of one sequence) up to the first of ``ends``, as it comes (``stream``)
    or all of it at the end, then a newline; return the text."""
    answer = StreamingDetokenizer(tokenizer)
    for token in tokens:
        if int(token[0]) in ends:
            break
        piece = answer.add(int(token[0]))
        if stream and piece:
            sys.stdout.write(piece)
            sys.stdout.flush()
    rest = answer.flush()
    sys.stdout.write((rest if stream else answer.text) + "\n")
    return answer.text
