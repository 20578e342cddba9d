"""`streamtally tokens get REQUEST_ID [--tenant T]`: a finished request's Tokens JSON, from Redis.

Also home of the small Redis helpers the read commands share (`add_redis_url`,
`run_redis`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import AuthenticationError as RedisAuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from streamtally.cli._output import escape, safe_json
from streamtally.core.identity import RequestRef
from streamtally.errors import InputError, StackError
from streamtally.redact import redact_text, redact_url, scrub, url_secrets
from streamtally.settings import Settings
from streamtally.store import RedisStore

__all__ = ["add_parser", "add_redis_url", "redacted_error", "run_redis"]

T = TypeVar("T")

_EPILOG = """\
A request is its tenant and its request id: two tenants may use one id.
Without --tenant the id must belong to one tenant only (found by SCAN).
exit status: 0 printed, 2 not found (unknown request, or still streaming),
             the id held by several tenants and no --tenant, Redis
             unreachable or a bad argument (message on stderr)
"""


def add_redis_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--redis-url",
        metavar="URL",
        help="Redis to read (default: $REDIS_URL, else the local stack's redis://127.0.0.1:6379/0)",
    )


def run_redis(
    url: str,
    work: Callable[[RedisStore], Awaitable[T]],
    *,
    cluster: bool = False,
    state_ttl_s: int = 0,
) -> T:
    """Run `work` with the store of the Redis at `url`, with clear errors.

    Raises `StackError` when Redis cannot be reached or fails, `InputError`
    for a URL that is not a Redis URL; their messages show the URL without its
    password (`redacted_error`).  `state_ttl_s`: how long what the store writes
    is kept (`RedisStore`; only commands that write need it).  `cluster`: `url`
    names a node of a Redis Cluster (the ``REDIS_CLUSTER`` setting).
    """
    target = url
    shown = redact_url(url)

    def detail(exc: BaseException) -> str:
        return redacted_error(exc, url)

    async def main() -> T:
        try:
            store = RedisStore.from_url(
                target, cluster=cluster, connect_timeout=5, timeout=30, state_ttl_s=state_ttl_s
            )
        except ValueError as exc:
            raise InputError(f"bad Redis URL {shown!r}: {detail(exc)}") from exc
        try:
            return await work(store)
        except RedisAuthenticationError as exc:  # a ConnectionError: before those
            raise StackError(
                f"Redis at {shown} refused the credentials ({detail(exc)}): check the "
                "password of --redis-url / REDIS_URL"
            ) from exc
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise StackError(
                f"cannot reach Redis at {shown} ({detail(exc)}): start the local stack with "
                "`streamtally stack up`, or pass --redis-url / set REDIS_URL"
            ) from exc
        except RedisError as exc:
            raise StackError(f"Redis at {shown} failed: {detail(exc)}") from exc
        except UnicodeDecodeError as exc:  # not written by streamtally: say so, no traceback
            raise StackError(
                f"Redis at {shown} holds text that is not UTF-8: {detail(exc)}"
            ) from exc
        finally:
            await store.aclose()

    return asyncio.run(main())


def redacted_error(exc: BaseException, url: str) -> str:
    """``str(exc)`` of a Redis client of `url`, with no credential of `url` in it.

    redis-py's messages may quote the URL, or a part of it, or its decoded password.
    """
    return scrub(redact_text(str(exc)), url_secrets(url))


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "tokens",
        help="read finished requests' Tokens from Redis",
        description="Read the Tokens the worker stored in Redis for finished requests.",
    )
    commands = parser.add_subparsers(dest="tokens_command", metavar="{get}", required=True)
    get = commands.add_parser(
        "get",
        help="print one request's Tokens JSON",
        description=(
            "Print the stored Tokens JSON of REQUEST_ID (as stored; control, line-separator "
            "and bidi characters as \\uXXXX escapes) and a newline."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    get.add_argument("request_id", metavar="REQUEST_ID", help="the request id")
    get.add_argument(
        "--tenant",
        metavar="TENANT",
        help="the request's tenant (needed when several tenants used REQUEST_ID)",
    )
    add_redis_url(get)
    get.set_defaults(func=run_get)


def run_get(args: argparse.Namespace, settings: Settings) -> int:
    request_id: str = args.request_id
    if not request_id:
        raise InputError("REQUEST_ID must not be empty")
    tenant: str | None = args.tenant

    async def lookup(store: RedisStore) -> str | None:
        if tenant is not None:
            return await store.tokens_text(RequestRef(tenant, request_id))
        tenants = await store.tenants_of(request_id)
        if len(tenants) > 1:
            listed = ", ".join(escape(t) for t in tenants[:10])
            raise InputError(
                f"{escape(request_id)} is a request of {len(tenants)} tenants ({listed}"
                f"{', ...' if len(tenants) > 10 else ''}): pass --tenant"
            )
        return await store.tokens_text(RequestRef(tenants[0], request_id)) if tenants else None

    text = run_redis(args.redis_url or settings.redis_url, lookup, cluster=settings.redis_cluster)
    if text is None:
        whose = "" if tenant is None else f" of tenant {escape(tenant)}"
        raise InputError(f"{escape(request_id)}{whose} not found (unknown, or still streaming)")
    # The stored JSON, whatever the locale; the characters a line reader or a terminal
    # would act on are written as the \uXXXX escapes `fold` prints (the same value).
    try:
        sys.stdout.flush()
        sys.stdout.buffer.write(safe_json(text).encode("utf-8") + b"\n")
        sys.stdout.buffer.flush()
    except BrokenPipeError:  # `| head`: the reader has all it wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
