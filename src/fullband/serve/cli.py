"""``fullband serve MODEL``: the OpenAI-compatible server with continuous batching, and the chat page."""

from __future__ import annotations

import argparse
from pathlib import Path

from fullband.architectures import refuse_arch
from fullband.cli_options import add_decode_options, add_device_options, decode_from_args, decode_overrides, model_dtype
from fullband.engine import Engine
from fullband.errors import FullbandError
from fullband.loading import load_model


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="serve a model over the OpenAI API (continuous batching, every decode mode) with a chat page")
    p.add_argument("model", help="run directory, checkpoint, model directory or Hugging Face export (export-hf)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    add_decode_options(p, "a request that does not give its own settings")
    p.add_argument("--max-batch", type=int, default=16, help="sequences decoded together (default: 16)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="sequences waiting for a slot before requests get 429 (default: 256)")
    p.add_argument("--model-name", help="the model id clients send (default: the model directory's name)")
    add_device_options(p)
    p.add_argument("--log-level", default="info", help="uvicorn log level (default: info)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> None:
    try:
        import uvicorn

        from fullband.serve.app import create_app
    except ImportError as exc:
        raise FullbandError(f"fullband serve needs the serve extra ({exc}): pip install 'fullband[serve]'") from exc
    if args.max_batch < 1 or args.max_queue < 0:
        raise FullbandError("--max-batch must be >= 1, --max-queue >= 0")
    decode_overrides(args)  # a bad value fails before the model is loaded
    model, tokenizer = load_model(args.model, args.device, model_dtype(args))
    refuse_arch(model, "fullband serve")  # its batching engine shares one transformer KV cache between requests
    decode = decode_from_args(model, args)
    name = args.model_name or Path(args.model).resolve().name
    engine = Engine(model.eval(), max_batch=args.max_batch, max_queue=args.max_queue)
    app = create_app(engine, tokenizer, name, decode)
    print(f"serving {name!r} ({model.num_parameters():,} parameters, context {model.config.max_seq_len}, "
          f"{model.device}, decoding {decode.describe()} unless a request says otherwise) on "
          f"http://{args.host}:{args.port}/ (chat page) and http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
