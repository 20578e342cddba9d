"""`streamtally proxy`: a reverse proxy that taps the LLM traffic going through it.

Requests are forwarded to the upstream as they came (method, path and query,
headers but the hop-by-hop ones and the tenant header, body bytes);
responses come back unchanged, streamed chunk by chunk.  On the way, the
response of a metered API call is teed to the raw topic through a `Tap`:
each SSE event as it passes, or the JSON body of a non-streaming call once
it is complete (`streamtally.cli._tee` decides what is teed).  Metered, by
method and path: chat completions, legacy completions and embeddings
(openai), Responses create, retrieve and cancel, background mode included
(billed once per response), Messages, Gemini's generate and embed calls.  A
metered call asks the upstream only for encodings the tee decodes (gzip,
deflate, br, zstd).  A call to any other path is forwarded and counted as
unmetered by path, or refused (403) with ``--unmetered reject``.

Who pays.  The tenant is the value of a request header (`X-Tenant` by
default), sent exactly once: a call that sends it twice (a front gateway
that appends its own value to the client's) is refused with 400 and never
forwarded, and so is a call without it unless ``--default-tenant`` names
one.  With ``--api-keys`` the tenant is the one the call's API key maps to
(a call with another key is refused, never forwarded:
`streamtally.cli._api_keys`).  Every tapped call is keyed by an id of its
own (`streamtally.core.identity.new_call_id`: ``call-`` and a time-ordered
UUIDv7), so two calls whose provider ids collide are two requests and two
bills; the provider's id, found in the stream, stays on the Tokens and the
billing event (``provider_request_id``).  A Responses API background
response is keyed by its own id instead (billed once however many calls
carry it: `streamtally.cli._tee`).

What is billed.  An OpenAI-compatible streamed call that did not ask for its
usage is asked for it, and the client gets the stream it would have had
(`streamtally.cli._usage_ask`; ``--no-usage-request`` turns it off).  A
client that goes away does not stop the call: the upstream is still read and
teed to its end, for at most ``--drain-seconds``, and the request closes
`cancelled` with the provider's usage; when the bound cuts the upstream
first, it is billed with what came (``usage_source`` says so).  While a
call is in flight and its upstream silent (a reasoning model thinking), the
tap keeps it alive in the worker: a keep-alive record every
``--keepalive-seconds`` without a record (`streamtally.producers.tap`).  An upstream
that breaks off ends the request plainly (the worker closes it `error`) and
breaks the client's response off too.

Bounds.  A metered call's body is read whole, up to ``--max-request-bytes``
(413 past it) within ``--body-timeout`` (408); a connection must send its
headers within ``--header-timeout``; at most ``--max-connections`` calls are
served at once (503 with ``Retry-After`` past it).  Other calls' bodies are
streamed upstream as they come.

Secrets.  No log line or answer of the proxy quotes a credential: the HTTP
client's exceptions are described by their message with credential headers,
``Bearer`` tokens and ``key=`` parameters hidden (`describe`), and a 502
names only the kind of failure, never the upstream URL.

Sizes.  A non-streaming body is teed whole (in part records when it is over
512 KiB) up to ``--max-body-bytes`` (64 MiB by default; spooled to a
temporary file while it arrives); a larger one is teed as the usage found in
its first and last 64 KiB, with a warning, and counted.

Kafka.  The tap appends every record to its spool (``--spool-dir``) and a
sender produces them to Kafka from there: by default a sender process the
proxy starts (``--sender process``: `streamtally.producers.sender_process`),
so that the Kafka client shares neither the proxy's event loop nor its core;
the proxy starts it again should it die, and it exits when the proxy goes,
SIGKILL included.  ``--sender inline`` runs it in the proxy's event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import re
import signal
from collections import Counter as CounterOf
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from aiohttp import ClientError, ClientResponse, ClientSession, ClientTimeout, TCPConnector, web
from aiohttp.streams import StreamReader
from aiokafka.errors import KafkaError
from yarl import URL

from streamtally.cli._api_keys import ApiKeyTenants
from streamtally.cli._args import bootstrap_servers, kafka_of, positive
from streamtally.cli._output import redacted, say
from streamtally.cli._proxy_metrics import ProxyCollector, metrics_app
from streamtally.cli._proxy_stats import ProxyStats
from streamtally.cli._tee import (
    DEFAULT_MAX_BODY_BYTES,
    Call,
    Tee,
    Teeing,
    call_of,
    metered,
    source_of,
    upstream_headers,
)
from streamtally.cli._usage_ask import UsageStripper, ask_for_usage, asks_for_usage
from streamtally.cli.produce import add_key_file_argument, producer_key
from streamtally.connection import KafkaConnection
from streamtally.errors import InputError, StackError
from streamtally.producers import Tap
from streamtally.producers.tap import DEFAULT_KEEPALIVE_S, default_spool_dir
from streamtally.settings import Settings
from streamtally.topics import Topics
from streamtally.wire.framing import framing_for
from streamtally.wire.kafka import ensure_topics
from streamtally.wire.tenant_keys import ProducerKey

__all__ = ["ProxyOptions", "ProxyServer", "ProxyStats", "add_parser", "describe", "source_of"]

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
#: Default seconds the upstream is still read after its client went away.
DEFAULT_DRAIN_S: Final = 120.0
#: Default largest request body of a metered call (JSON; images inline as base64 included).
DEFAULT_MAX_REQUEST_BYTES: Final = 64 << 20
#: Default seconds a client may take for its request headers, and for its body.
DEFAULT_CLIENT_TIMEOUT_S: Final = 60.0
#: Default calls served at once.
DEFAULT_MAX_CONNECTIONS: Final = 4096
#: Default most bytes the tap's spool holds unsent, and how often it is synced.
DEFAULT_SPOOL_BYTES: Final = 1 << 30
DEFAULT_SPOOL_SYNC_MS: Final = 20.0
#: Retry-After of a call refused for a full spool (seconds, as the header says it).
SPOOL_FULL_RETRY_AFTER_S: Final = "5"
#: Default calls of one tenant served at once.
DEFAULT_MAX_CALLS_PER_TENANT: Final = 1024
#: Distinct paths the `unmetered` counts keep apart; the rest are ``other``.
MAX_UNMETERED_LABELS: Final = 100
#: An API version as a path segment: not an id.
_VERSION: Final = re.compile(r"v\d+(?:[a-z]+\d*)?")
#: Seconds between two looks at whether the client of a silent upstream is still there.
CLIENT_POLL_S: Final = 0.25
#: `--unmetered`: what a call to a path the proxy does not meter gets.
UNMETERED: Final = ("forward", "reject")
#: `--sender`: where the spool's records are produced to Kafka.
SENDERS: Final = ("process", "inline")
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


def upstream_url(value: str) -> str:
    url = URL(value)
    if url.scheme not in ("http", "https") or not url.host:
        raise argparse.ArgumentTypeError(f"not an http(s) URL: {value!r}")
    return value.rstrip("/")


@dataclass(frozen=True, slots=True)
class ProxyOptions:
    """What the proxy bills to whom, and its bounds: each a `streamtally proxy` option.

    Checked when made (`ValueError` names the option): every bound finite and in range.
    """

    #: Request header naming the tenant (sent once: twice is refused, never forwarded).
    tenant_header: str = "X-Tenant"
    #: Tenant of a call without the header; None: such a call is refused (400).
    default_tenant: str | None = None
    #: Ask OpenAI-compatible streams for their usage (`streamtally.cli._usage_ask`).
    request_usage: bool = True
    #: Seconds the upstream is still read, and teed, after its client went away (0: none).
    drain_s: float = DEFAULT_DRAIN_S
    #: Largest request body of a metered call (a larger one is answered 413).
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    #: Seconds a client may take to send its request headers, or to send its body.
    header_timeout_s: float = DEFAULT_CLIENT_TIMEOUT_S
    body_timeout_s: float = DEFAULT_CLIENT_TIMEOUT_S
    #: Calls served at once; one more is answered 503 with Retry-After.
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    #: Calls of one tenant served at once; one more of it is answered 429 with Retry-After.
    max_calls_per_tenant: int = DEFAULT_MAX_CALLS_PER_TENANT
    #: A call to a path the proxy does not meter: "forward" (counted) or "reject" (403).
    unmetered: str = "forward"
    #: Largest non-streaming body teed whole; past it, its usage only (`Tee`).
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if not self.tenant_header.strip():
            raise ValueError("--tenant-header must not be empty")
        if self.default_tenant is not None and not self.default_tenant.strip():
            raise ValueError("--default-tenant must not be empty")
        for name, value, low, high in (
            ("--drain-seconds", self.drain_s, 0.0, 24 * 3600.0),
            ("--header-timeout", self.header_timeout_s, 0.001, 24 * 3600.0),
            ("--body-timeout", self.body_timeout_s, 0.001, 24 * 3600.0),
        ):
            if not math.isfinite(value) or not low <= value <= high:
                raise ValueError(f"{name} must be a number of seconds in [{low:g}, {high:g}]")
        if not 1 <= self.max_request_bytes <= 1 << 40:
            raise ValueError("--max-request-bytes must be a whole number >= 1")
        if not 1 <= self.max_body_bytes <= 1 << 40:
            raise ValueError("--max-body-bytes must be a whole number >= 1")
        if self.unmetered not in UNMETERED:
            raise ValueError(f"--unmetered must be one of {', '.join(UNMETERED)}")
        if not 1 <= self.max_connections <= 1_000_000:
            raise ValueError("--max-connections must be a whole number in [1, 1000000]")
        if not 1 <= self.max_calls_per_tenant <= 1_000_000:
            raise ValueError("--max-calls-per-tenant must be a whole number in [1, 1000000]")


def unmetered_label(path: str, seen: CounterOf[str]) -> str:
    """The metric label of an unmetered call's path: its ids as ``{id}``, bounded.

    A segment holding a digit (but a version: ``v1``, ``v1beta``) or longer than 24
    characters is an id
    (``/v1/files/file-abc123`` -> ``/v1/files/{id}``); past `MAX_UNMETERED_LABELS`
    distinct labels every new one is ``other``, so no client can grow the metric
    without bound.
    """
    segments = [
        "{id}"
        if len(part) > 24 or (any(c.isdigit() for c in part) and not _VERSION.fullmatch(part))
        else part
        for part in path.split("/")
    ]
    label = "/".join(segments)[:200]
    if label in seen or len(seen) < MAX_UNMETERED_LABELS:
        return label
    return "other"


def describe(exc: BaseException) -> str:
    """An exception for a log line: its type and message, credentials hidden.

    An HTTP client's exceptions may quote the call they failed on: its URL (a
    ``key=`` parameter) and in their repr its headers (``Authorization``); only
    the message is used, through `redacted` (`streamtally.redact.redact_credentials`).
    """
    message = redacted(str(exc))
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


class ProxyServer:
    """The proxy: an aiohttp server whose every request goes to `upstream`, tapped."""

    def __init__(
        self,
        upstream: str,
        tap: Tap,
        *,
        api_keys: ApiKeyTenants | None = None,
        options: ProxyOptions | None = None,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.tap = tap
        self.options = ProxyOptions() if options is None else options
        #: With a map, the tenant is the API key's, and a call with no mapped key is refused.
        self.api_keys = api_keys
        self.stats = ProxyStats()
        #: The tee side: which responses are teed, how, and what it could not read.
        self.tees = Teeing(tap, max_body_bytes=self.options.max_body_bytes)
        self._session: ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._active = 0
        #: Calls in flight per tenant (one tenant's burst cannot take every slot).
        self._by_tenant: CounterOf[str] = CounterOf()

    @property
    def forwarded(self) -> int:
        return self.stats.forwarded

    @property
    def tapped(self) -> int:
        return self.stats.tapped

    @property
    def refused(self) -> int:
        return sum(self.stats.refused.values())

    @property
    def in_flight(self) -> int:
        """Calls being served now."""
        return self._active

    @property
    def oversize(self) -> int:
        """Tapped bodies over ``--max-body-bytes``, teed as the usage found in them."""
        return self.tees.stats.oversize

    async def start(self, host: str, port: int) -> int:
        """Listen on `host`:`port` (0: any free port); returns the port."""
        self._session = ClientSession(
            connector=TCPConnector(limit=0),
            auto_decompress=False,
            timeout=ClientTimeout(total=None, sock_connect=30),
        )
        app = web.Application(client_max_size=self.options.max_request_bytes)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # A client that goes away does not cancel its handler: the upstream is still read
        # to its end (at most --drain-seconds) and teed, so the call's usage is billed.
        # An idle connection, or one whose headers do not come, is closed after
        # --header-timeout (aiohttp's keep-alive timer runs from the connection's start).
        self._runner = web.AppRunner(
            app,
            handler_cancellation=False,
            access_log=None,
            keepalive_timeout=self.options.header_timeout_s,
        )
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

    def _refuse(self, reason: str, status: int, text: str, **headers: str) -> web.Response:
        self.stats.refused[reason] += 1
        return web.Response(status=status, text=f"streamtally proxy: {text}\n", headers=headers)

    def _tenant(self, request: web.Request) -> str | web.Response:
        """The call's tenant, or the answer that refuses it (never forwarded)."""
        if self.api_keys is not None:
            tenant = self.api_keys.tenant_of(request.headers, request.query)
            if tenant is None:
                return self._refuse(
                    "api_key", 403, "no API key, or one no tenant is billed for: not forwarded"
                )
            return tenant
        name = self.options.tenant_header
        values = request.headers.getall(name, [])
        if len(values) > 1:
            return self._refuse(
                "tenant_header_repeated",
                400,
                f"the {name} header was sent {len(values)} times; send it once: not forwarded",
            )
        tenant = values[0].strip() if values else ""
        if tenant:
            return tenant
        if self.options.default_tenant is not None:
            return self.options.default_tenant
        return self._refuse(
            "tenant_header_missing",
            400,
            f"no {name} header naming the tenant to bill (or start the proxy with "
            "--default-tenant): not forwarded",
        )

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        tenant = self._tenant(request)
        if isinstance(tenant, web.Response):
            return tenant
        if self._active >= self.options.max_connections:
            return self._refuse(
                "busy",
                503,
                f"{self._active} calls in flight, the limit (--max-connections): try again",
                **{"Retry-After": "1"},
            )
        limit = self.options.max_calls_per_tenant
        if self._by_tenant[tenant] >= limit:
            return self._refuse(
                "tenant_busy",
                429,
                f"{limit} calls of this tenant in flight, its limit (--max-calls-per-tenant): "
                "try again",
                **{"Retry-After": "1"},
            )
        self._active += 1
        self._by_tenant[tenant] += 1
        try:
            return await self._forward(request, tenant)
        finally:
            self._active -= 1
            left = self._by_tenant[tenant] - 1
            if left:
                self._by_tenant[tenant] = left
            else:
                del self._by_tenant[tenant]

    async def _read_body(self, request: web.Request) -> bytes | web.Response:
        """The body of a metered call, whole; or the answer to a body too large or too slow."""
        limit = self.options.max_request_bytes
        if request.content_length is not None and request.content_length > limit:
            return self._refuse(
                "too_large", 413, f"a request body over {limit} bytes (--max-request-bytes)"
            )
        try:
            async with asyncio.timeout(self.options.body_timeout_s):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self._refuse(
                "too_large", 413, f"a request body over {limit} bytes (--max-request-bytes)"
            )
        except TimeoutError:
            answer = self._refuse(
                "body_timeout",
                408,
                f"the request body did not come within {self.options.body_timeout_s:g}s",
            )
            answer.force_close()  # the rest of the body is not waited for
            return answer

    async def _forward(self, request: web.Request, tenant: str) -> web.StreamResponse:
        assert self._session is not None
        is_metered = metered(request.method, request.path)
        if not is_metered:
            self.stats.unmetered[unmetered_label(request.path, self.stats.unmetered)] += 1
            if self.options.unmetered == "reject":
                return self._refuse(
                    "unmetered",
                    403,
                    f"{request.method} {request.path} is not metered (--unmetered reject): "
                    "not forwarded",
                )
        elif self.tap.full:
            # Refused before anything goes upstream: nothing is billed that is not recorded.
            return self._refuse(
                "spool_full",
                503,
                "the tap's spool is full (Kafka is behind or down): not forwarded; try again",
                **{"Retry-After": SPOOL_FULL_RETRY_AFTER_S},
            )
        call: Call | None = None
        headers = [
            (k, v)
            for k, v in request.headers.items()
            if k.lower() not in _HOP_BY_HOP and k.lower() != self.options.tenant_header.lower()
        ]
        data: bytes | StreamReader | None
        stripper: UsageStripper | None = None
        if is_metered:
            body = await self._read_body(request)
            if isinstance(body, web.Response):
                return body
            call = call_of(request.method, request.path, body)
            asked = None
            if self.options.request_usage and asks_for_usage(request.method, request.path):
                asked = ask_for_usage(body)
            if asked is not None:
                body = asked
                stripper = UsageStripper()
                self.stats.usage_asked += 1
                # The stripper reads the stream's bytes: the client's offer goes, and the
                # upstream is asked for none of its encodings (identity).
                headers = [(k, v) for k, v in headers if k.lower() != "accept-encoding"]
            headers = upstream_headers(headers)  # only encodings the tee decodes
            data = body or None
        else:
            # Not metered: streamed through as it comes (a file upload may be large).
            data = request.content if request.body_exists else None
        url = URL(self.upstream + request.raw_path, encoded=True)
        try:
            upstream = await self._session.request(
                request.method,
                url,
                headers=headers,
                data=data,
                skip_auto_headers=_AUTO_HEADERS,
                allow_redirects=False,
            )
        except (ClientError, OSError, TimeoutError) as exc:
            log.warning(
                "upstream call %s %s failed: %s", request.method, request.path, describe(exc)
            )
            return web.Response(
                status=502,
                text=f"streamtally proxy: bad gateway: the upstream did not answer "
                f"({type(exc).__name__})\n",
            )
        self.stats.forwarded += 1
        async with upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in _HOP_BY_HOP or name.lower() == "content-length":
                    if stripper is not None and name.lower() == "content-length":
                        continue  # the client gets fewer bytes than the upstream sent
                    response.headers.add(name, value)
            tee = (
                None
                if call is None
                else self.tees.tee(call, tenant, upstream.status, upstream.headers)
            )
            with contextlib.suppress(ConnectionError):  # a client gone: drained all the same
                await response.prepare(request)
            await self._relay(request, upstream, response, tee, stripper)
        return response

    async def _relay(
        self,
        request: web.Request,
        upstream: ClientResponse,
        response: web.StreamResponse,
        tee: Tee | None,
        stripper: UsageStripper | None,
    ) -> None:
        """Upstream to client, teed; after the client leaves, the upstream is still read
        and teed to its end, for at most --drain-seconds (module docstring)."""
        if tee is not None:
            self.stats.tapped += 1
        loop = asyncio.get_running_loop()
        client = _Client(request, response)
        drain_until: float | None = None
        cancelled = False  # the END marker says cancelled: the client went away
        read: asyncio.Future[bytes] | None = None
        try:
            chunks = upstream.content.iter_any()
            while True:
                if drain_until is None and not client.there:
                    cancelled = True
                    self.stats.clients_gone += 1
                    drain_until = loop.time() + self.options.drain_s
                if read is None:
                    read = asyncio.ensure_future(anext(chunks, b""))
                # Waiting for the upstream, the client is looked at now and then: one that
                # left while the upstream was silent starts the drain's clock.
                wait = CLIENT_POLL_S
                if drain_until is not None:
                    wait = min(wait, max(0.0, drain_until - loop.time()))
                done, _ = await asyncio.wait((read,), timeout=wait)
                if not done:
                    if drain_until is not None and loop.time() >= drain_until:
                        self.stats.drains_cut += 1
                        log.warning(
                            "%s %s: the client went away and the upstream did not end within "
                            "%gs (--drain-seconds): cut, billed with what came",
                            request.method,
                            request.path,
                            self.options.drain_s,
                        )
                        upstream.close()
                        break
                    continue
                finished, read = read, None
                try:
                    chunk = finished.result()
                except (ClientError, OSError) as exc:
                    if not cancelled:
                        self.stats.upstream_broke += 1
                    log.warning(
                        "%s %s: the upstream broke off: %s",
                        request.method,
                        request.path,
                        describe(exc),
                    )
                    client.abort()  # the client's response breaks off too
                    break
                if not chunk:
                    if tee is not None:
                        await tee.close()
                    if client.there:
                        await client.finish(b"" if stripper is None else stripper.close())
                    break
                if tee is not None:
                    await tee.feed(chunk)
                if client.there:
                    await client.write(chunk if stripper is None else stripper.feed(chunk))
        except asyncio.CancelledError:
            cancelled = True  # the proxy is stopping: the call is cut here
            raise
        finally:
            if read is not None:
                read.cancel()
            if stripper is not None:
                self.stats.usage_chunks_held += stripper.dropped
            if tee is not None:
                tee.end(cancelled=cancelled)


class _Client:
    """The client's side of one call: writes that stop, without an error, once it is gone."""

    def __init__(self, request: web.Request, response: web.StreamResponse) -> None:
        self._request = request
        self._response = response
        self._gone = False
        #: The response was written whole, its end included.
        self.finished = False

    @property
    def there(self) -> bool:
        if self._gone:
            return False
        transport = self._request.transport
        if transport is None or transport.is_closing() or not self._response.prepared:
            self._gone = True
        return not self._gone

    async def write(self, data: bytes) -> None:
        if not data:
            return
        try:
            await self._response.write(data)
        except ConnectionError:
            self._gone = True

    async def finish(self, data: bytes) -> None:
        await self.write(data)
        if self._gone:
            return
        try:
            await self._response.write_eof()
        except ConnectionError:
            self._gone = True
            return
        self.finished = True

    def abort(self) -> None:
        """Break the client's connection off (the upstream broke off: so does its answer)."""
        transport = self._request.transport
        if transport is not None:
            transport.close()
        self._gone = True


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
                metrics = await serve_metrics(proxy, args.metrics)
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


async def serve_metrics(proxy: ProxyServer, where: Listen) -> web.AppRunner:
    """/metrics and /health of `proxy` on `where` (`streamtally.cli._proxy_metrics`)."""
    collector = ProxyCollector(
        lambda: proxy.stats,
        lambda: proxy.tap.stats,
        lambda: proxy.in_flight,
        lambda: proxy.tees.stats,
    )
    runner = web.AppRunner(metrics_app(collector, lambda: proxy.tap.full), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, where.host, where.port).start()
    except OSError as exc:
        await runner.cleanup()
        raise InputError(f"cannot serve metrics on {where.host}:{where.port}: {exc}") from exc
    bound = [address for address in runner.addresses if isinstance(address, tuple)]
    say(f"proxy: metrics on http://{where.host}:{bound[0][1] if bound else where.port}/metrics")
    return runner


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
