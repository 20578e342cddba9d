"""`streamtally proxy`: its options, checked, and the proxy served until SIGTERM.

The proxy itself, what it forwards, meters and tees, is `streamtally.producers.proxy`
(`server.py`); its manual is docs/tap.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import signal
from pathlib import Path
from typing import Final

from aiokafka.errors import KafkaError
from yarl import URL

from streamtally.cli._args import bootstrap_servers, kafka_of, positive
from streamtally.cli._output import say
from streamtally.cli.produce import add_key_file_argument, producer_key
from streamtally.connection import KafkaConnection
from streamtally.errors import InputError, StackError
from streamtally.producers import Tap
from streamtally.producers.proxy.api_keys import ApiKeyTenants
from streamtally.producers.proxy.server import (
    DEFAULT_CLIENT_TIMEOUT_S,
    DEFAULT_DRAIN_S,
    DEFAULT_MAX_CALLS_PER_TENANT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_REQUEST_BYTES,
    UNMETERED,
    Listen,
    ProxyOptions,
    ProxyServer,
    serve_metrics,
)
from streamtally.producers.proxy.tee import DEFAULT_MAX_BODY_BYTES
from streamtally.producers.tap import (
    DEFAULT_KEEPALIVE_S,
    DEFAULT_SPOOL_BYTES,
    DEFAULT_SPOOL_SYNC_MS,
    default_spool_dir,
)
from streamtally.settings import Settings
from streamtally.topics import Topics
from streamtally.wire.framing import framing_for
from streamtally.wire.kafka import ensure_topics
from streamtally.wire.tenant_keys import ProducerKey

__all__ = ["add_parser", "listen_address", "run", "upstream_url"]

#: `--sender`: where the spool's records are produced to Kafka.
SENDERS: Final = ("process", "inline")


def listen_address(value: str) -> Listen:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"not HOST:PORT: {value!r}")
    return Listen(host.strip("[]") or "127.0.0.1", int(port))


def upstream_url(value: str) -> str:
    url = URL(value)
    if url.scheme not in ("http", "https") or not url.host:
        raise argparse.ArgumentTypeError(f"not an http(s) URL: {value!r}")
    return value.rstrip("/")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "proxy",
        help="a reverse proxy that taps LLM API traffic to the raw topics",
        description=(
            "Forward every request to --upstream unchanged and stream the response back,\n"
            "teeing the SSE events (or the JSON body) of OpenAI, Anthropic and Gemini calls\n"
            "to the raw topics, billed to the tenant named by --tenant-header."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--upstream", required=True, type=upstream_url, metavar="URL", help="where to forward"
    )
    parser.add_argument(
        "--listen",
        type=listen_address,
        default=Listen("127.0.0.1", 8080),
        metavar="HOST:PORT",
        help="where to listen (default: 127.0.0.1:8080)",
    )
    parser.add_argument(
        "--tenant-header",
        default="X-Tenant",
        metavar="NAME",
        help="request header naming the tenant, sent once (default: X-Tenant); a call that "
        "sends it twice, or not at all without --default-tenant, is refused (400)",
    )
    parser.add_argument(
        "--default-tenant",
        metavar="TENANT",
        help="bill a call without the tenant header to TENANT (default: refuse it)",
    )
    parser.add_argument(
        "--api-keys",
        metavar="FILE",
        help="bill each call to the tenant its API key maps to (SHA-256 of each key -> "
        "tenant, JSON); a call with another key is refused, never forwarded; the tenant "
        "header is then ignored",
    )
    parser.add_argument(
        "--no-usage-request",
        dest="request_usage",
        action="store_false",
        help="do not ask OpenAI-compatible streams for their usage chunk (by default the "
        "proxy asks and hides it from a client that did not ask)",
    )
    parser.add_argument(
        "--drain-seconds",
        type=seconds,
        default=DEFAULT_DRAIN_S,
        metavar="S",
        help="after a client goes away, keep reading and teeing the upstream for at most S "
        f"seconds, so its usage is billed (default: {DEFAULT_DRAIN_S:g}; 0: cut at once)",
    )
    parser.add_argument(
        "--keepalive-seconds",
        type=seconds,
        default=DEFAULT_KEEPALIVE_S,
        metavar="S",
        help="while a tapped call is in flight and produced no record for S seconds, the "
        "tap sends a keep-alive record, so that the worker does not close a call waiting "
        "on a slow upstream (a reasoning model) as timed out (default: "
        f"{DEFAULT_KEEPALIVE_S:g}; 0: none); keep it well below the worker's "
        "STREAMTALLY_REQUEST_TIMEOUT",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=positive,
        default=DEFAULT_MAX_REQUEST_BYTES,
        metavar="N",
        help=f"largest request body of a metered call (default: {DEFAULT_MAX_REQUEST_BYTES}); "
        "larger: 413",
    )
    parser.add_argument(
        "--header-timeout",
        type=seconds,
        default=DEFAULT_CLIENT_TIMEOUT_S,
        metavar="S",
        help="seconds a connection may take to send its request headers, or stay idle "
        f"(default: {DEFAULT_CLIENT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--body-timeout",
        type=seconds,
        default=DEFAULT_CLIENT_TIMEOUT_S,
        metavar="S",
        help="seconds a client may take to send a metered call's body (default: "
        f"{DEFAULT_CLIENT_TIMEOUT_S:g}); slower: 408",
    )
    parser.add_argument(
        "--max-connections",
        type=positive,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help=f"calls served at once (default: {DEFAULT_MAX_CONNECTIONS}); one more: 503",
    )
    parser.add_argument(
        "--max-calls-per-tenant",
        type=positive,
        default=DEFAULT_MAX_CALLS_PER_TENANT,
        metavar="N",
        help="calls of one tenant served at once (default: "
        f"{DEFAULT_MAX_CALLS_PER_TENANT}); one more of it: 429, so that one tenant's burst "
        "leaves room for the others",
    )
    parser.add_argument(
        "--unmetered",
        choices=UNMETERED,
        default="forward",
        help="a call to a path the proxy does not meter: forward it (counted by path; the "
        "default) or reject it (403, not forwarded)",
    )
    parser.add_argument(
        "--metrics",
        type=listen_address,
        metavar="HOST:PORT",
        help="serve the proxy's Prometheus metrics (/metrics) and /health there "
        "(default: not served)",
    )
    parser.add_argument(
        "--spool-dir",
        metavar="DIR",
        help="the tap's write-ahead spool: every raw record is written there before its "
        "bytes go to the client, and sent to Kafka from there (default: "
        "<state dir>/spool/<namespace>; one proxy per directory)",
    )
    parser.add_argument(
        "--spool-bytes",
        type=positive,
        default=DEFAULT_SPOOL_BYTES,
        metavar="N",
        help=f"most bytes the spool holds unsent (default: {DEFAULT_SPOOL_BYTES}); past 90 %% "
        "new calls are refused (503, Retry-After) before anything goes upstream, calls in "
        "flight go on",
    )
    parser.add_argument(
        "--spool-sync-ms",
        type=seconds,
        default=DEFAULT_SPOOL_SYNC_MS,
        metavar="MS",
        help="group commit: how often the spool is synced to disk (default: "
        f"{DEFAULT_SPOOL_SYNC_MS:g}); a killed process loses nothing either way, a lost "
        "machine at most this much",
    )
    parser.add_argument(
        "--sender",
        choices=SENDERS,
        default="process",
        help="where the spool's records are produced to Kafka: a sender process of the "
        "proxy's own, which it starts and starts again should it die (the default: the "
        "Kafka client then shares neither the event loop nor the core of the client "
        "streams), or inline, in the proxy's process",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=positive,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="N",
        help="largest non-streaming body tapped whole, spooled to a temporary file "
        f"(default: {DEFAULT_MAX_BODY_BYTES}); a larger one is tapped as the usage, id and "
        "model found in its first and last 64 KiB, with a warning",
    )
    parser.add_argument(
        "--bootstrap-servers", type=bootstrap_servers, metavar="HOST:PORT", help="Kafka to use"
    )
    add_key_file_argument(parser)
    parser.set_defaults(func=run)


async def _serve(
    args: argparse.Namespace,
    servers: KafkaConnection,
    settings: Settings,
    key: ProducerKey | None,
    api_keys: ApiKeyTenants | None,
    *,
    proxy_options: ProxyOptions,
) -> int:
    namespace = settings.namespace
    await ensure_topics(servers, Topics.in_namespace(namespace).all)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    spool_dir = Path(args.spool_dir) if args.spool_dir else default_spool_dir(namespace, settings)
    # With STREAMTALLY_AVRO_FRAMING=confluent the raw topics' schemas are registered now.
    framing = await asyncio.to_thread(framing_for, settings, Topics.in_namespace(namespace).raw)
    async with Tap(
        servers,
        namespace=namespace,
        key=key,
        framing=framing,
        spool_dir=spool_dir,
        spool_bytes=args.spool_bytes,
        spool_sync_ms=args.spool_sync_ms,
        keepalive_s=args.keepalive_seconds or None,
        sender_process=args.sender == "process",
    ) as tap:
        proxy = ProxyServer(args.upstream, tap, api_keys=api_keys, options=proxy_options)
        try:
            port = await proxy.start(args.listen.host, args.listen.port)
        except OSError as exc:
            raise InputError(
                f"cannot listen on {args.listen.host}:{args.listen.port}: {exc}"
            ) from exc
        say(f"proxy: listening on {args.listen.host}:{port}, forwarding to {args.upstream}")
        metrics = None
        try:
            if args.metrics is not None:
                metrics, metrics_port = await serve_metrics(proxy, args.metrics)
                say(f"proxy: metrics on http://{args.metrics.host}:{metrics_port}/metrics")
            await stop.wait()
        finally:
            await proxy.stop()
            if metrics is not None:
                await metrics.cleanup()
    stats = tap.stats  # once the tap has sent what it had
    done = proxy.stats
    refused = ", ".join(f"{n} {reason}" for reason, n in sorted(done.refused.items())) or "none"
    say(
        f"proxy: {done.forwarded} calls forwarded, {done.tapped} tapped "
        f"({done.usage_asked} asked for usage; {done.clients_gone} clients gone, "
        f"{done.drains_cut} of them cut at --drain-seconds; {done.upstream_broke} upstreams "
        f"broke off); refused: {refused}; {proxy.oversize} bodies over --max-body-bytes "
        f"teed as their usage; unmetered {sum(done.unmetered.values())}; not "
        f"tapped for their encoding {sum(proxy.tees.stats.undecodable.values())}; records "
        f"appended to the spool {stats.appended} ({stats.keepalives} keep-alives), sent "
        f"{stats.sent}, failed {stats.failed}, "
        f"left in the spool {stats.spool_bytes} bytes; sender processes started again "
        f"{stats.sender_restarts}"
    )
    return 0


def seconds(text: str) -> float:
    """An argparse type: a finite number >= 0 (``nan`` and ``inf`` are refused)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number >= 0")
    return value


def options(args: argparse.Namespace) -> ProxyOptions:
    """The `ProxyOptions` the command line gives (an `InputError` names a bad one)."""
    try:
        return ProxyOptions(
            tenant_header=args.tenant_header,
            default_tenant=args.default_tenant,
            request_usage=args.request_usage,
            drain_s=args.drain_seconds,
            max_request_bytes=args.max_request_bytes,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            max_connections=args.max_connections,
            max_calls_per_tenant=args.max_calls_per_tenant,
            unmetered=args.unmetered,
            max_body_bytes=args.max_body_bytes,
        )
    except ValueError as exc:
        raise InputError(str(exc)) from exc


def run(args: argparse.Namespace, settings: Settings) -> int:
    if not 0 < args.spool_sync_ms <= 10_000:
        raise InputError("--spool-sync-ms must be a number of milliseconds in (0, 10000]")
    if args.keepalive_seconds and not 0.1 <= args.keepalive_seconds <= 24 * 3600:
        raise InputError(
            "--keepalive-seconds must be 0 (none) or a number of seconds in [0.1, 86400]"
        )
    proxy_options = options(args)  # checked before anything starts
    key = producer_key(args, settings)
    api_keys = None if args.api_keys is None else ApiKeyTenants.load(args.api_keys)
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    servers = kafka_of(args, settings)
    with contextlib.suppress(KeyboardInterrupt):
        try:
            return asyncio.run(
                _serve(args, servers, settings, key, api_keys, proxy_options=proxy_options)
            )
        except KafkaError as exc:
            raise StackError(f"Kafka at {servers} failed: {exc!r}") from exc
    return 0
