"""`streamtally api [--listen HOST:PORT] [--tokens FILE]`: serve the read-only usage API.

The server is uvicorn running `streamtally.api.create_app` on a socket this
command binds itself, so that a port already in use (or ``:0``, any free
port) is known before anything is served, and the line ``api: listening on
http://HOST:PORT`` names the real port.  Redis is pinged once first: an
unreachable Redis is one line and exit status 2, like every read command;
once serving, a Redis failure answers 503 and the server keeps running.

SIGTERM and SIGINT stop the server gracefully (requests in flight finish).
uvicorn re-raises the signal it caught once it has stopped, to end the process
the default way; the command puts a handler of its own on SIGTERM while it
serves, so that a SIGTERM ends it with status 0, as it does the worker.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from streamtally.cli._output import say
from streamtally.cli.proxy import listen_address
from streamtally.cli.tokens import add_redis_url, run_redis
from streamtally.errors import InputError
from streamtally.producers.proxy import Listen
from streamtally.settings import Settings
from streamtally.store import RedisStore

__all__ = ["add_parser"]

_DEFAULT_LISTEN = Listen("127.0.0.1", 8000)

_EPILOG = """\
endpoints (every call needs Authorization: Bearer TOKEN):
  GET /v1/usage?tenant=T&from=YYYY-MM-DD&to=YYYY-MM-DD   usage rows
  GET /v1/requests/REQUEST_ID[?tenant=T]                 a request's Tokens
  GET /docs, /openapi.json                               the OpenAPI description
the tokens file holds each token's SHA-256 and its tenant or "role": "operator"
(docs/api.md, "The usage API").
exit status: 0 stopped by SIGTERM, 130 by SIGINT, 2 a bad argument or tokens
             file, a port in use, or Redis unreachable at start (message on stderr)
"""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "api",
        help="serve the read-only usage API (usage rows, requests' Tokens) over HTTP",
        description=(
            "Serve GET /v1/usage and GET /v1/requests/{request_id} from Redis, behind\n"
            "per-tenant bearer tokens (an operator token reads every tenant), with\n"
            "OpenAPI docs at /docs."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--listen",
        type=listen_address,
        default=_DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help="where to listen (default: 127.0.0.1:8000; port 0: any free port)",
    )
    parser.add_argument(
        "--tokens",
        type=Path,
        metavar="FILE",
        help="the tokens file (default: $STREAMTALLY_API_TOKENS)",
    )
    add_redis_url(parser)
    parser.set_defaults(func=run)


def _bind(listen: Listen) -> socket.socket:
    family = socket.AF_INET6 if ":" in listen.host else socket.AF_INET
    try:
        return socket.create_server((listen.host, listen.port), family=family)
    except OSError as exc:
        raise InputError(
            f"cannot listen on {listen.host}:{listen.port}: {exc.strerror or exc}"
        ) from None


@contextmanager
def _sigterm_ends_cleanly() -> Iterator[None]:
    """While serving, a SIGTERM uvicorn re-raises after its graceful stop ends nothing."""

    def ignore(signum: int, frame: FrameType | None) -> None:
        del signum, frame

    previous = signal.signal(signal.SIGTERM, ignore)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace, settings: Settings) -> int:
    # The server's libraries are imported by this command only, not by every command's
    # parser (fastapi alone is a quarter of a second of start-up).
    import uvicorn

    from streamtally.api import TokenTable, create_app

    path: Path | None = args.tokens or settings.api_tokens_path
    if path is None:
        raise InputError("no tokens file: pass --tokens FILE or set STREAMTALLY_API_TOKENS")
    tokens = TokenTable.load(path)
    if not len(tokens):
        raise InputError(f"the API tokens file {path} holds no token: nobody could call")
    url: str = args.redis_url or settings.redis_url
    cluster = settings.redis_cluster

    async def ping(store: RedisStore) -> None:
        await store.ping(timeout=5)

    run_redis(url, ping, cluster=cluster)  # unreachable: one line, exit 2

    def open_store() -> RedisStore:
        return RedisStore.from_url(url, cluster=cluster, connect_timeout=5, timeout=30)

    listener = _bind(args.listen)
    config = uvicorn.Config(
        create_app(tokens, open_store),
        log_config=None,  # uvicorn's records go through the command's handler (--log-format)
        server_header=False,
        lifespan="on",
    )
    server = uvicorn.Server(config)
    host, port = listener.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    say(f"api: listening on http://{shown}:{port} ({len(tokens)} tokens; docs at /docs)")
    with listener, _sigterm_ends_cleanly():
        asyncio.run(server.serve(sockets=[listener]))
    say("api: stopped")
    return 0
