"""``pipeserve serve``: the OpenAI-compatible HTTP server on uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pipeserve.entrypoints.args import add_engine_args, config_from_args
from pipeserve.server.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE
from pipeserve.server.reasoning import REASONING_PARSERS

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1; 0.0.0.0 exposes the server to the network)")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--api-key", default=os.environ.get("PIPESERVE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (default: $PIPESERVE_API_KEY)")
    server.add_argument("--max-queue", type=_non_negative, default=DEFAULT_MAX_QUEUE,
                        help="most sequences (prompts x n) the server handles at once (running + "
                        f"waiting); beyond it requests get 429 (default: {DEFAULT_MAX_QUEUE})")
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="the model name clients send and see (default: the --model value); with several, "
                        "clients may send any of them and responses carry the first, as in vLLM")
    server.add_argument("--max-request-bytes", type=_non_negative, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request body; bigger ones get 413")
    server.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="seconds in-flight requests get to finish on SIGINT/SIGTERM before "
                        "they are aborted")
    server.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                        help="report a thinking model's reasoning (<think>...</think>) as "
                        "message.reasoning_content apart from message.content, as vLLM's parser of "
                        "the same name: qwen3 | deepseek_r1 (default: none, all text is content)")
    server.add_argument("--allowed-origins", type=_origins, default=None,
                        help="origins of web pages that browsers may let call the API (CORS), comma-separated, "
                        "e.g. https://chat.example.com or * for any (default: none)")
    server.add_argument("--log-level", default="WARNING")
    add_engine_args(p)
    p.set_defaults(func=run)


def _origins(text: str) -> list[str]:
    origins = [o.strip() for o in text.split(",") if o.strip()]
    for origin in origins:
        if origin != "*" and not (origin.startswith(("http://", "https://")) and "/" not in origin.split("://", 1)[1]):
            raise argparse.ArgumentTypeError(f"{origin!r} is no origin: write scheme://host[:port] (no path), or *")
    return origins


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    from pipeserve.engine.async_engine import AsyncEngine
    from pipeserve.engine.llm_engine import LLMEngine
    from pipeserve.server.app import build_app
    from pipeserve.server.metrics import ServerMetrics
    from pipeserve.server.reasoning import reasoning_parser
    from pipeserve.server.runner import serve
    from pipeserve.server.serving import ServerState

    config = config_from_args(args)
    names = args.served_model_name or [config.model]
    name = names[0]
    engine = LLMEngine(config)
    metrics = ServerMetrics(name)
    async_engine = AsyncEngine(engine, observer=metrics.observe)
    state = ServerState(engine=async_engine, tokenizer=engine.tokenizer, model_name=name,
                        model_path=config.model, max_model_len=engine.max_model_len, metrics=metrics,
                        max_queue=args.max_queue, max_n=config.max_n,
                        max_body_bytes=args.max_request_bytes, reasoning=reasoning_parser(args.reasoning_parser),
                        aliases=tuple(dict.fromkeys(n for n in names[1:] if n != name)))
    app = build_app(state, api_key=args.api_key, allowed_origins=args.allowed_origins)
    print(f"pipeserve: serving {name} (pp={config.pipeline_parallel_size}) on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    try:
        serve(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
              shutdown_timeout=args.shutdown_timeout,
              on_timeout=async_engine.shutdown)  # returns after SIGINT/SIGTERM
    finally:
        async_engine.shutdown()  # idempotent: the app's lifespan normally did it already
    return 0
