"""The proxy of `streamtally proxy`: a reverse proxy that taps the LLM traffic going through it.

Requests are forwarded to the upstream as they came (method, path and query,
headers but the hop-by-hop ones and the tenant header, body bytes);
responses come back unchanged, streamed chunk by chunk.  On the way, the
response of a metered API call is teed to the raw topic through a `Tap`:
each SSE event as it passes, or the JSON body of a non-streaming call once
it is complete (`streamtally.producers.proxy.tee` decides what is teed).  Metered, by
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
`streamtally.producers.proxy.api_keys`).  Every tapped call is keyed by an id of its
own (`streamtally.core.identity.new_call_id`: ``call-`` and a time-ordered
UUIDv7), so two calls whose provider ids collide are two requests and two
bills; the provider's id, found in the stream, stays on the Tokens and the
billing event (``provider_request_id``).  A Responses API background
response is keyed by its own id instead (billed once however many calls
carry it: `streamtally.producers.proxy.tee`).

What is billed.  An OpenAI-compatible streamed call that did not ask for its
usage is asked for it, and the client gets the stream it would have had
(`streamtally.producers.proxy.usage_ask`; ``--no-usage-request`` turns it off).  A
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

import asyncio
import contextlib
import logging
import math
import re
from collections import Counter as CounterOf
from dataclasses import dataclass
from typing import Final

from aiohttp import ClientError, ClientResponse, ClientSession, ClientTimeout, TCPConnector, web
from aiohttp.streams import StreamReader
from yarl import URL

from streamtally.errors import InputError
from streamtally.producers import Tap
from streamtally.producers.proxy.api_keys import ApiKeyTenants
from streamtally.producers.proxy.metrics import ProxyCollector, metrics_app
from streamtally.producers.proxy.stats import ProxyStats
from streamtally.producers.proxy.tee import (
    DEFAULT_MAX_BODY_BYTES,
    Call,
    Tee,
    Teeing,
    call_of,
    metered,
    source_of,
    upstream_headers,
)
from streamtally.producers.proxy.usage_ask import UsageStripper, ask_for_usage, asks_for_usage
from streamtally.redact import redacted

__all__ = [
    "Listen",
    "ProxyOptions",
    "ProxyServer",
    "ProxyStats",
    "describe",
    "serve_metrics",
    "source_of",
    "unmetered_label",
]

log = logging.getLogger("streamtally.producers.proxy")

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
#: Headers aiohttp's client would add on its own: only those the client sent go upstream.
_AUTO_HEADERS: Final = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")


@dataclass(frozen=True, slots=True)
class Listen:
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class ProxyOptions:
    """What the proxy bills to whom, and its bounds: each a `streamtally proxy` option.

    Checked when made (`ValueError` names the option): every bound finite and in range.
    """

    #: Request header naming the tenant (sent once: twice is refused, never forwarded).
    tenant_header: str = "X-Tenant"
    #: Tenant of a call without the header; None: such a call is refused (400).
    default_tenant: str | None = None
    #: Ask OpenAI-compatible streams for their usage (`streamtally.producers.proxy.usage_ask`).
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


async def serve_metrics(proxy: ProxyServer, where: Listen) -> tuple[web.AppRunner, int]:
    """/metrics and /health of `proxy` on `where` (`streamtally.producers.proxy.metrics`), and
    the port they are served on (`where.port`, or the one chosen for port 0)."""
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
    return runner, int(bound[0][1]) if bound else where.port
