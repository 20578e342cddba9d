"""`streamtally api` against the real Redis, called over HTTP with a real client (aiohttp).

The data is written by the worker's own Redis write (`RedisBatch`, the flush
script): two tenants of this test (unique names), on two UTC days, with one
request id used by both.  The API runs as the real command (``python -m
streamtally.cli api --listen 127.0.0.1:0``, uvicorn) with a tokens file of
SHA-256s: a token per tenant and an operator token.  What each caller gets
is compared with what the store returns to ``streamtally usage`` and
``streamtally tokens get``: the same rows (cost as the exact decimal string)
and the same Tokens JSON.

The same command on a Redis Cluster (``REDIS_CLUSTER=1``) reads the same
rows and Tokens.  Every key written is deleted afterwards.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from streamtally.billing.events import bill
from streamtally.billing.pricing import PriceTable
from streamtally.core.identity import RequestRef
from streamtally.core.models import FinishReason, Source, Tokens, Usage
from streamtally.store import RedisBatch, RedisStore, closed_key, tokens_key

pytestmark = pytest.mark.integration

PRICES = PriceTable.from_dict(
    {
        "version": "api-1",
        "currency": "USD",
        "unit": 1_000_000,
        "models": {"gpt-4o-20*": {"input": "2.50", "cached_input": "1.25", "output": "10.00"}},
    }
)
MODEL = "gpt-4o-2024-08-06"
DAY1 = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)
DAY2 = datetime(2026, 11, 21, 23, 59, 59, tzinfo=UTC)
START_TIMEOUT_S = 30.0


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Written:
    """What a test wrote: two tenants, their requests (and days), each caller's token."""

    tag: str
    acme: str
    globex: str
    tokens: dict[RequestRef, Tokens]
    when: dict[RequestRef, datetime]
    acme_token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    globex_token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    operator_token: str = field(default_factory=lambda: secrets.token_urlsafe(32))

    @property
    def shared_id(self) -> str:
        return f"api-{self.tag}-shared"

    @property
    def acme_only_id(self) -> str:
        return f"api-{self.tag}-acme-1"

    @property
    def globex_only_id(self) -> str:
        return f"api-{self.tag}-globex-1"


def make_tokens(request_id: str, output: int, text: str) -> Tokens:
    return Tokens(
        request_id=request_id,
        source=Source.OPENAI,
        model=MODEL,
        text=text,
        reasoning="",
        tool_calls=(),
        usage=Usage(input_tokens=1000, cached_tokens=400, output_tokens=output),
        finish_reason=FinishReason.STOP,
        finish_reason_raw="stop",
        error=None,
        chunks=3,
    )


def plan() -> Written:
    """Five requests: acme two on day 2 and one on day 1, globex one each day; one shared id."""
    tag = uuid.uuid4().hex[:12]
    acme, globex = f"acme-{tag}", f"globex-{tag}"
    shared = f"api-{tag}-shared"
    requests = {
        RequestRef(acme, f"api-{tag}-acme-1"): (DAY1, 200, "Grüße aus acme, 世界"),
        RequestRef(acme, f"api-{tag}-acme-2"): (DAY2, 300, "acme on day two"),
        RequestRef(acme, shared): (DAY2, 10, "acme's use of the shared id"),
        RequestRef(globex, f"api-{tag}-globex-1"): (DAY1, 50, "globex secret answer"),
        RequestRef(globex, shared): (DAY2, 20, "globex's use of the shared id"),
    }
    return Written(
        tag=tag,
        acme=acme,
        globex=globex,
        tokens={
            ref: make_tokens(ref.request_id, out, text) for ref, (_, out, text) in requests.items()
        },
        when={ref: when for ref, (when, _, _) in requests.items()},
    )


async def write(store: RedisStore, written: Written) -> None:
    """The requests through the worker's Redis write: Tokens, close markers, usage rows."""
    await store.ensure_layout()
    sink = RedisBatch(store)
    for ref, tokens in written.tokens.items():
        sink.add(tokens, bill(tokens, ref.tenant, written.when[ref], PRICES))
    assert await sink.flush() == [True] * len(written.tokens)


async def forget(url: str, written: Written, *, cluster: bool = False) -> None:
    """Delete every key `write` wrote (Tokens, close markers, the two tenants' usage rows)."""
    client = RedisCluster.from_url(url) if cluster else aioredis.from_url(url)
    try:
        for ref in written.tokens:
            await client.delete(tokens_key(ref))
            await client.delete(closed_key(ref))
        await RedisStore(client).delete_usage([written.acme, written.globex])
    finally:
        await client.aclose()


def tokens_file(path: Path, written: Written) -> Path:
    path.write_text(
        json.dumps(
            {
                "tokens": [
                    {
                        "name": "acme-billing",
                        "sha256": sha(written.acme_token),
                        "tenant": written.acme,
                    },
                    {
                        "name": "globex",
                        "sha256": sha(written.globex_token),
                        "tenant": written.globex,
                    },
                    {"name": "ops", "sha256": sha(written.operator_token), "role": "operator"},
                ]
            }
        )
    )
    return path


class ApiProcess:
    """``streamtally api`` on a free port; `url` once it says where it listens."""

    def __init__(self, tokens: Path, redis_url: str, *, cluster: bool = False) -> None:
        env = {**os.environ, "REDIS_CLUSTER": "1" if cluster else "0"}
        env.pop("STREAMTALLY_API_TOKENS", None)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "streamtally.cli",
                "api",
                "--listen",
                "127.0.0.1:0",
                "--tokens",
                str(tokens),
                "--redis-url",
                redis_url,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.url = self._wait_listening()

    def _wait_listening(self) -> str:
        assert self.proc.stderr is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stderr], [], [], 0.5)
            if not ready:
                continue
            line = self.proc.stderr.readline()
            if not line:
                break
            if line.startswith("api: listening on "):
                return line.split()[3]
        self.proc.kill()
        _, err = self.proc.communicate()
        raise AssertionError(f"streamtally api did not start ({self.proc.returncode}): {err}")

    def stop(self) -> tuple[int, str, str]:
        """SIGTERM; its exit status and the rest of its output."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            out, err = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        return self.proc.returncode, out, err


@pytest.fixture(scope="module")
def written(redis_url: str) -> Iterator[Written]:
    data = plan()

    async def write_all() -> None:
        store = RedisStore.from_url(redis_url, connect_timeout=5)
        try:
            await write(store, data)
        finally:
            await store.aclose()

    asyncio.run(write_all())
    try:
        yield data
    finally:
        asyncio.run(forget(redis_url, data))


@pytest.fixture(scope="module")
def api(
    written: Written, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ApiProcess]:
    path = tokens_file(tmp_path_factory.mktemp("api") / "tokens.json", written)
    server = ApiProcess(path, redis_url)
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[RedisStore]:
    store = RedisStore.from_url(redis_url, connect_timeout=5)
    try:
        yield store
    finally:
        await store.aclose()


async def get(
    http: aiohttp.ClientSession, url: str, token: str | None, **params: str
) -> tuple[int, Any, aiohttp.ClientResponse]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    async with http.get(url, headers=headers, params=params) as response:
        body = await response.read()
        return response.status, json.loads(body) if body else None, response


def ours(rows: Sequence[dict[str, Any]], written: Written) -> list[dict[str, Any]]:
    return [row for row in rows if row["tenant"] in (written.acme, written.globex)]


# --------------------------------------------------------------------------- /v1/usage


async def test_the_operator_sees_every_tenant(
    api: ApiProcess, written: Written, http: aiohttp.ClientSession, store: RedisStore
) -> None:
    status, body, _ = await get(http, f"{api.url}/v1/usage", written.operator_token)
    assert status == 200
    assert (body["tenant"], body["from"], body["to"]) == (None, None, None)
    expected = ours(await store.usage_rows(), written)
    assert ours(body["rows"], written) == expected  # what `streamtally usage --json` shows
    assert {(r["tenant"], r["day"]) for r in expected} == {
        (written.acme, "2026-11-20"),
        (written.acme, "2026-11-21"),
        (written.globex, "2026-11-20"),
        (written.globex, "2026-11-21"),
    }
    acme_day2 = next(
        r for r in body["rows"] if (r["tenant"], r["day"]) == (written.acme, "2026-11-21")
    )
    # 2 requests: (2 * (600 * 2.50 + 400 * 1.25) + (300 + 10) * 10) / 1e6
    assert acme_day2["requests"] == 2
    assert acme_day2["output_tokens"] == 310
    assert acme_day2["cost"] == "0.007100000000"


async def test_the_operator_filters_by_tenant_and_days(
    api: ApiProcess, written: Written, http: aiohttp.ClientSession
) -> None:
    status, body, _ = await get(
        http,
        f"{api.url}/v1/usage",
        written.operator_token,
        tenant=written.globex,
        **{"from": "2026-11-21", "to": "2026-11-21"},
    )
    assert status == 200
    assert (body["tenant"], body["from"], body["to"]) == (
        written.globex,
        "2026-11-21",
        "2026-11-21",
    )
    assert [(r["tenant"], r["day"], r["requests"]) for r in body["rows"]] == [
        (written.globex, "2026-11-21", 1)
    ]
    status, body, _ = await get(
        http, f"{api.url}/v1/usage", written.operator_token, tenant=written.globex, to="2026-11-19"
    )
    assert (status, body["rows"]) == (200, [])


async def test_a_tenant_sees_its_own_rows_only(
    api: ApiProcess, written: Written, http: aiohttp.ClientSession, store: RedisStore
) -> None:
    status, body, _ = await get(http, f"{api.url}/v1/usage", written.acme_token)
    assert status == 200
    assert body["tenant"] == written.acme
    assert body["rows"] == await store.usage_rows(tenant=written.acme)
    assert {r["tenant"] for r in body["rows"]} == {written.acme}
    assert len(body["rows"]) == 2
    # naming itself is the same; a day range narrows it
    status, named, _ = await get(
        http,
        f"{api.url}/v1/usage",
        written.acme_token,
        tenant=written.acme,
        **{"from": "2026-11-21"},
    )
    assert status == 200
    assert named["rows"] == [r for r in body["rows"] if r["day"] == "2026-11-21"]


async def test_a_tenant_asking_for_another_tenants_rows_is_refused(
    api: ApiProcess, written: Written, http: aiohttp.ClientSession
) -> None:
    status, body, _ = await get(
        http, f"{api.url}/v1/usage", written.acme_token, tenant=written.globex
    )
    assert status == 403
    assert body == {"detail": "this token may not read another tenant's data"}
    assert written.globex not in json.dumps(body)


@pytest.mark.parametrize(
    ("params", "detail"),
    [
        ({"from": "2026-11-31"}, "from: '2026-11-31' is not a UTC day YYYY-MM-DD"),
        ({"to": "yesterday"}, "to: 'yesterday' is not a UTC day YYYY-MM-DD"),
        ({"from": "2026-11-22", "to": "2026-11-21"}, "from (2026-11-22) is after to (2026-11-21)"),
        ({"tenant": ""}, "tenant: must not be empty (leave it out instead)"),
    ],
)
async def test_bad_queries_are_400_with_the_reason(
    api: ApiProcess,
    written: Written,
    http: aiohttp.ClientSession,
    params: dict[str, str],
    detail: str,
) -> None:
    status, body, _ = await get(http, f"{api.url}/v1/usage", written.operator_token, **params)
    assert (status, body) == (400, {"detail": detail})


# --------------------------------------------------------------------------- /v1/requests


async def test_a_tenant_reads_its_request_as_stored(
    api: ApiProcess, written: Written, http: aiohttp.ClientSession, store: RedisStore
) -> None:
    ref = RequestRef(written.acme, written.acme_only_id)
    url = f"{api.url}/v1/requests/{written.acme_only_id}"
    async with http.get(url, headers={"Authorization": f"Bearer {written.acme_token}"}) as resp:
        assert resp.status == 200
        assert resp.content_type == "application/json"
        raw = (await resp.read()).decode("utf-8")
    stored = await store.tokens_text(ref)  # what `streamtally tokens get` prints
    assert stored is not None
    assert raw == f'{{"tenant":"{written.acme}","tokens":{stored}}}'
    assert json.loads(raw)["tokens"] == written.tokens[ref].to_json_dict()
    # the shared id, read by each tenant: its own request
    for tenant, token in (
        (written.acme, written.acme_token),
        (written.globex, written.globex_token),
    ):
        status, body, _ = await get(http, f"{api.url}/v1/requests/{written.shared_id}", token)
        assert status == 200
        assert body["tenant"] == tenant
        assert (
            body["tokens"] == written.tokens[RequestRef(tenant, written.shared_id)].to_json_dict()
        )


async def test_another_tenants_request_is_not_found_like_an_unknown_one(
    api: ApiProcess, written: Written, http: aiohttp.ClientSession
) -> None:
    other = await get(http, f"{api.url}/v1/requests/{written.globex_only_id}", written.acme_token)
    unknown = await get(http, f"{api.url}/v1/requests/api-{written.tag}-nope", written.acme_token)
    assert other[:2] == unknown[:2]
    assert other[0] == 404
    assert "globex secret answer" not in json.dumps(other[1])
    # naming the other tenant is refused outright, whether or not the request exists
    for request_id in (written.globex_only_id, f"api-{written.tag}-nope"):
        status, body, _ = await get(
            http, f"{api.url}/v1/requests/{request_id}", written.acme_token, tenant=written.globex
        )
        assert (status, body) == (403, {"detail": "this token may not read another tenant's data"})


async def test_the_operator_reads_any_request(
    api: ApiProcess, written: Written, http: aiohttp.ClientSession
) -> None:
    status, body, _ = await get(
        http, f"{api.url}/v1/requests/{written.globex_only_id}", written.operator_token
    )
    assert status == 200
    assert body["tenant"] == written.globex
    assert body["tokens"]["text"] == "globex secret answer"
    # an id two tenants used: which one must be said
    status, body, _ = await get(
        http, f"{api.url}/v1/requests/{written.shared_id}", written.operator_token
    )
    assert status == 409
    assert body["detail"].startswith("2 tenants used this request id")
    status, body, _ = await get(
        http,
        f"{api.url}/v1/requests/{written.shared_id}",
        written.operator_token,
        tenant=written.globex,
    )
    assert (status, body["tenant"]) == (200, written.globex)
    assert body["tokens"]["text"] == "globex's use of the shared id"


# --------------------------------------------------------------------------- auth, docs


@pytest.mark.parametrize("path", ["/v1/usage", "/v1/requests/x"])
async def test_no_token_or_a_bad_one_is_401(
    api: ApiProcess, written: Written, http: aiohttp.ClientSession, path: str
) -> None:
    bad = written.acme_token[:-2] + "zz"
    for headers in (
        {},
        {"Authorization": f"Bearer {bad}"},
        {"Authorization": f"Bearer {sha(written.operator_token)}"},
        {"Authorization": f"Basic {written.acme_token}"},
        {"Authorization": "Bearer"},
    ):
        async with http.get(f"{api.url}{path}", headers=headers) as response:
            assert response.status == 401, headers
            assert response.headers["WWW-Authenticate"] == "Bearer"
            body = await response.json()
            assert body == {"detail": "missing or unknown bearer token"}


async def test_openapi_documents_both_paths_and_the_models(
    api: ApiProcess, http: aiohttp.ClientSession
) -> None:
    async with http.get(f"{api.url}/openapi.json") as response:
        assert response.status == 200
        spec = await response.json()
    assert {"/v1/usage", "/v1/requests/{request_id}"} <= set(spec["paths"])
    usage = spec["paths"]["/v1/usage"]["get"]
    assert {p["name"] for p in usage["parameters"]} == {"tenant", "from", "to"}
    assert {"200", "400", "401", "403"} <= set(usage["responses"])
    assert {"UsageRow", "UsageResponse", "RequestTokens", "Tokens"} <= set(
        spec["components"]["schemas"]
    )
    assert spec["components"]["schemas"]["UsageRow"]["properties"]["cost"]["type"] == "string"
    assert "HTTPBearer" in spec["components"]["securitySchemes"]
    async with http.get(f"{api.url}/docs") as response:
        assert response.status == 200
        assert "swagger" in (await response.text()).lower()


def test_sigterm_stops_it_cleanly_and_no_token_is_ever_printed(
    written: Written, redis_url: str, tmp_path: Path
) -> None:
    server = ApiProcess(tokens_file(tmp_path / "tokens.json", written), redis_url)

    async def calls() -> None:
        async with aiohttp.ClientSession() as http:
            await get(http, f"{server.url}/v1/usage", written.acme_token)
            await get(http, f"{server.url}/v1/usage", written.acme_token + "x")

    asyncio.run(calls())
    code, out, err = server.stop()
    assert code == 0, err
    assert "api: stopped" in err
    for token in (written.acme_token, written.globex_token, written.operator_token):
        assert token not in out + err


def test_an_unreachable_redis_or_a_bad_file_is_one_line_and_status_2(
    written: Written, tmp_path: Path
) -> None:
    tokens = tokens_file(tmp_path / "tokens.json", written)
    (tmp_path / "bad.json").write_text('{"tokens": [{"name": "x"}]}')
    for argv in (
        ["--tokens", str(tokens), "--redis-url", "redis://:hunter22@127.0.0.1:1/0"],
        ["--tokens", str(tmp_path / "bad.json")],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "streamtally.cli", "api", "--listen", "127.0.0.1:0", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.splitlines()) == 1, done.stderr
        assert done.stderr.startswith("streamtally api: ")
        assert "hunter22" not in done.stderr


# --------------------------------------------------------------------------- Redis Cluster


async def test_on_a_redis_cluster(
    redis_cluster_url: str, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    data = plan()
    store = RedisStore.from_url(redis_cluster_url, cluster=True, connect_timeout=5)
    try:
        await write(store, data)
        tokens = tokens_file(tmp_path / "tokens.json", data)
        server = ApiProcess(tokens, redis_cluster_url, cluster=True)
        try:
            status, body, _ = await get(http, f"{server.url}/v1/usage", data.globex_token)
            assert status == 200
            assert body["rows"] == await store.usage_rows(tenant=data.globex)
            assert [r["requests"] for r in body["rows"]] == [1, 1]
            status, body, _ = await get(
                http, f"{server.url}/v1/requests/{data.shared_id}", data.operator_token
            )
            assert status == 409  # found on every master: both tenants
            status, body, _ = await get(
                http,
                f"{server.url}/v1/requests/{data.shared_id}",
                data.operator_token,
                tenant=data.acme,
            )
            assert (status, body["tokens"]["text"]) == (200, "acme's use of the shared id")
            status, _, _ = await get(
                http, f"{server.url}/v1/usage", data.globex_token, tenant=data.acme
            )
            assert status == 403
        finally:
            assert server.stop()[0] == 0
    finally:
        await store.aclose()
        await forget(redis_cluster_url, data, cluster=True)
