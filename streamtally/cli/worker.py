"""`streamtally worker`: run the stream processors until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any, NoReturn

from streamtally.settings import Settings
from streamtally.topics import Topics
from streamtally.wire.kafka import ensure_topics

__all__ = ["add_parser"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "worker",
        help="run the stream processors (faust) until SIGTERM",
        description=(
            "Consume the raw topics, write chunks, completed Tokens, billing events and "
            "dead letters to their topics and Tokens and usage rows to Redis. Settings come "
            "from the environment: KAFKA_BOOTSTRAP_SERVERS, REDIS_URL, STREAMTALLY_PRICES, "
            "STREAMTALLY_REQUEST_TIMEOUT (seconds), STREAMTALLY_BATCH_SIZE."
        ),
    )
    parser.add_argument("--loglevel", default="warning", choices=("debug", "info", "warning"))
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Settings) -> NoReturn:
    import faust
    import redis.asyncio as aioredis

    from streamtally.processors.app import create_app
    from streamtally.processors.sinks import KafkaSink, RedisOutputs, Sinks

    topics = Topics.in_namespace(settings.namespace)
    asyncio.run(ensure_topics(settings.bootstrap_servers, topics.all))

    def make_sinks(app: Any) -> Sinks:
        redis_outputs = RedisOutputs(aioredis.from_url(settings.redis_url))
        del app  # the sinks have their own batching producer
        kafka = KafkaSink(settings.bootstrap_servers, topics)
        return Sinks(kafka, redis_outputs, lookup=redis_outputs.lookup)

    pipeline = create_app(settings, make_sinks)
    print(
        f"streamtally worker: kafka {settings.bootstrap_servers}, redis {settings.redis_url}, "
        f"prices {settings.prices_path or '(packaged)'}",
        file=sys.stderr,
    )
    worker = faust.Worker(pipeline.app, loglevel=args.loglevel.upper(), quiet=True)
    # faust's terminal spinner sets the root logger to DEBUG, so every debug line of
    # aiokafka (one per message sent) would be formatted: a fifth of the worker's CPU.
    worker.spinner = None
    worker.execute_from_commandline()  # runs until SIGTERM/SIGINT, then exits the process
