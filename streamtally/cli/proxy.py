"""`streamtally proxy`: a reverse proxy that taps the LLM traffic going through it.

Requests are forwarded to the upstream as they came (method, path and query,
headers but the hop-by-hop ones, body bytes); responses come back unchanged,
streamed chunk by chunk.  On the way, the response of a known API call is
teed to the raw topic through a `Tap`: each SSE event as it passes, or the
JSON body of a non-streaming call once it is complete.  The tenant is the
value of a request header (`X-Tenant` by default), or with ``--api-keys`` the
tenant the call's API key maps to (a call with another key is refused, never
forwarded: `streamtally.cli._api_keys`); the request id is the provider's,
found in the stream.  A client that goes away mid-stream ends
its request as cancelled; an upstream that breaks off ends it plainly (the
worker closes it `error`).

Which calls are tapped (by path): `/chat/completions` (openai),
`/responses` (openai-responses), `/messages` (anthropic),
`:streamGenerateContent` and `:generateContent` (gemini); 2xx responses only,
not content-encoded ones other than gzip and deflate.  A non-streaming body is
tapped whole, as one event that every source's fold reads (in part records
when it is over 512 KiB), up to ``--max-body-bytes`` (64 MiB by default;
spooled to a temporary file while it arrives); a larger one is tapped as the
usage found in its first and last 64 KiB, with a warning, and counted (see
`streamtally.cli._tee`, which decides what is teed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web
from aiokafka.errors import KafkaError
from yarl import URL

from streamtally.cli._api_keys import ApiKeyTenants
from streamtally.cli._args import bootstrap_servers, kafka_of
from streamtally.cli._output import say
from streamtally.cli._tee import DEFAULT_MAX_BODY_BYTES, Tee, plan, source_of
from streamtally.cli.produce import add_key_file_argument, producer_key
from streamtally.connection import KafkaConnection
from streamtally.errors import InputError, StackError
from streamtally.producers import Tap
from streamtally.settings import Settings
from streamtally.topics import Topics
from streamtally.wire.kafka import ensure_topics
from streamtally.wire.tenant_keys import ProducerKey

__all__ = ["ProxyServer", "add_parser", "source_of"]

log = logging.getLogger("streamtally.cli.proxy")

#: Headers of one hop only (RFC 9110 7.6.1), never forwarded; Host and lengths are redone.
_HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
#: Headers aiohttp's client would add on its own: only those the client sent go upstream.
_AUTO_HEADERS: Final = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")


@dataclass(frozen=True, slots=True)
class Listen:
    host: str
    port: int


def listen_address(value: str) -> Listen:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"not HOST:PORT: {value!r}")
    return Listen(host.strip("[]") or "127.0.0.1", int(port))


def positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return number


def upstream_url(value: str) -> str:
    url = URL(value)
    if url.scheme not in ("http", "https") or not url.host:
        raise argparse.ArgumentTypeError(f"not an http(s) URL: {value!r}")
    return value.rstrip("/")


class ProxyServer:
    """The proxy: an aiohttp server whose every request goes to `upstream`, tapped."""

    def __init__(
        self,
        upstream: str,
        tap: Tap,
        *,
        tenant_header: str = "X-Tenant",
        api_keys: ApiKeyTenants | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.tap = tap
        self.tenant_header = tenant_header
        #: With a map, the tenant is the API key's, and a call with no mapped key is refused.
        self.api_keys = api_keys
        #: The largest non-streaming body teed whole; past it, its usage (`Tee`).
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.max_body_bytes = max_body_bytes
        self._session: ClientSession | None = None
        self._runner: web.AppRunner | None = None
        #: Requests forwarded, tapped ones (a `Tap` request each), refused (no mapped key).
        self.forwarded = 0
        self.tapped = 0
        self.refused = 0
        #: Tapped bodies over `max_body_bytes`, teed as the usage found in them.
        self.oversize = 0

    async def start(self, host: str, port: int) -> int:
        """Listen on `host`:`port` (0: any free port); returns the port."""
        self._session = ClientSession(
            connector=TCPConnector(limit=0),
            auto_decompress=False,
            timeout=ClientTimeout(total=None, sock_connect=30),
        )
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # A client that goes away cancels its handler: its request ends as cancelled.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = [address for address in self._runner.addresses if isinstance(address, tuple)]
        return int(bound[0][1]) if bound else port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def _tenant(self, request: web.Request) -> str | None:
        if self.api_keys is not None:
            return self.api_keys.tenant_of(request.headers, request.query)
        return request.headers.get(self.tenant_header) or "default"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        tenant = self._tenant(request)
        if tenant is None:
            self.refused += 1
            return web.Response(
                status=403,
                text="streamtally proxy: no API key, or one no tenant is billed for: "
                "not forwarded\n",
            )
        self.forwarded += 1
        body = await request.read()
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP]
        url = URL(self.upstream + request.raw_path, encoded=True)
        try:
            upstream = await self._session.request(
                request.method,
                url,
                headers=headers,
                data=body if body else None,
                skip_auto_headers=_AUTO_HEADERS,
                allow_redirects=False,
            )
        except (ClientError, OSError) as exc:
            log.warning("upstream %s failed: %r", self.upstream, exc)
            return web.Response(status=502, text=f"bad gateway: {exc}\n")
        async with upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in _HOP_BY_HOP or name.lower() == "content-length":
                    response.headers.add(name, value)
            await response.prepare(request)
            tee = self._tee(request, upstream.status, upstream.headers, tenant)
            if tee is None:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            else:
                await self._stream_tapped(request, upstream, response, tee)
            await response.write_eof()
        return response

    def _tee(self, request: web.Request, status: int, headers: Any, tenant: str) -> Tee | None:
        tee = plan(
            request.path,
            status,
            headers.get("Content-Type", ""),
            headers.get("Content-Encoding", "identity"),
            max_body_bytes=self.max_body_bytes,
        )
        if tee is None:
            return None
        return Tee(self.tap.request(tee.source, tenant=tenant), tee)

    async def _stream_tapped(
        self, request: web.Request, upstream: Any, response: web.StreamResponse, tee: Tee
    ) -> None:
        self.tapped += 1
        req = tee.request
        cancelled = True
        try:
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                    await tee.feed(chunk)
            except ClientError as exc:  # the upstream broke off: a plain end (`error`)
                log.warning("upstream broke off %s: %r", request.path, exc)
                cancelled = False
                raise
            await tee.close()
            if tee.oversize:
                self.oversize += 1
            cancelled = False
        finally:
            req.end(cancelled=cancelled)


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
        help="request header naming the tenant (default: X-Tenant; absent: default)",
    )
    parser.add_argument(
        "--api-keys",
        metavar="FILE",
        help="bill each call to the tenant its API key maps to (SHA-256 of each key -> "
        "tenant, JSON); a call with another key is refused, never forwarded; the tenant "
        "header is then ignored",
    )
    parser.add_argument(
        "--budget-ms",
        type=float,
        default=5.0,
        metavar="MS",
        help="longest wait of one event for room in the tap's buffer (default: 5)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=positive_int,
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
    namespace: str,
    key: ProducerKey | None,
    api_keys: ApiKeyTenants | None,
) -> int:
    await ensure_topics(servers, Topics.in_namespace(namespace).all)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with Tap(servers, namespace=namespace, budget_s=args.budget_ms / 1000, key=key) as tap:
        proxy = ProxyServer(
            args.upstream,
            tap,
            tenant_header=args.tenant_header,
            api_keys=api_keys,
            max_body_bytes=args.max_body_bytes,
        )
        try:
            port = await proxy.start(args.listen.host, args.listen.port)
        except OSError as exc:
            raise InputError(
                f"cannot listen on {args.listen.host}:{args.listen.port}: {exc}"
            ) from exc
        say(f"proxy: listening on {args.listen.host}:{port}, forwarding to {args.upstream}")
        try:
            await stop.wait()
        finally:
            await proxy.stop()
    stats = tap.stats  # once the tap has sent what it had
    say(
        f"proxy: {proxy.forwarded} requests forwarded, {proxy.tapped} tapped, "
        f"{proxy.refused} refused (no mapped API key), {proxy.oversize} bodies over "
        f"--max-body-bytes tapped as their usage; records "
        f"sent {stats.sent}, dropped over budget {stats.dropped_over_budget}, "
        f"failed {stats.failed}"
    )
    return 0


def run(args: argparse.Namespace, settings: Settings) -> int:
    if args.budget_ms < 0:
        raise InputError("--budget-ms must be >= 0")
    key = producer_key(args, settings)
    api_keys = None if args.api_keys is None else ApiKeyTenants.load(args.api_keys)
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    servers = kafka_of(args, settings)
    with contextlib.suppress(KeyboardInterrupt):
        try:
            return asyncio.run(_serve(args, servers, settings.namespace, key, api_keys))
        except KafkaError as exc:
            raise StackError(f"Kafka at {servers} failed: {exc!r}") from exc
    return 0
