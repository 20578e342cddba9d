"""Does every call the provider bills reach the books?  Issue 22's cases, tried as a client would.

Each case of issue 22 ("Measured on main (cf6d4af)") is made by a client of
`streamtally proxy` against a local upstream that speaks the providers' wire
formats and reports usage only the way the real provider does (an
OpenAI-compatible chat or completions stream carries ``"usage":null`` on its
chunks and a usage-only chunk at its end only when the request asks
``stream_options.include_usage``; the Gemini API's ``embedContent`` reports
no token count at all).  One line per case: what the upstream reported
(tokens in/out) against what streamtally billed, and a verdict.

Everything under test runs as a process of the checkout chosen by
``--python`` (default: this interpreter), driven through its command line
only, so that the same script measures an old and a new proxy:

- ``PYTHON -m streamtally.cli proxy --upstream URL --listen 127.0.0.1:0
  --bootstrap-servers ...`` (plus every ``--proxy-arg``), ready once it prints
  ``proxy: listening on HOST:PORT``;
- ``PYTHON -m streamtally.cli worker`` in the same namespace (a fresh
  ``STREAMTALLY_NAMESPACE`` per run, ``STREAMTALLY_REQUEST_TIMEOUT`` low so
  that a cut request closes soon), ready once faust logs ``[^Worker]: Ready``;
- the read commands ``billing export --json`` (the billed figures: every
  billing event of the run's namespace), ``usage --json`` and ``tokens get``
  (checked against them), ``deadletter --json --summary`` (the dead letters
  whose reason names a case's tenant).

Options of the new proxy go in as ``--proxy-arg=--drain-seconds
--proxy-arg=30`` (the ``=`` form, since they start with ``--``).

Every case has tenants of its own (``cap-RUN-CASE``).  A case's records are
awaited at most ``--record-timeout`` seconds after its traffic ended; none
then is reported as "no record".  Subprocesses are always stopped (SIGTERM,
then SIGKILL).  The upstream compresses only in the encoding case, so that
each case measures one thing.

    python -m benchmarks.tap_capture [--python PATH] [--proxy-arg ARG ...]
                                     [--cases 1,2,4] [--json] [--json-file PATH]
                                     [--log-dir DIR]

Before and after a change: run it from a checkout of the new code, once with
``--python`` of a worktree at the old commit (its own venv) and once without.
The brotli and zstandard packages (``pip install brotli zstandard``) are needed
for the encoding case only; without them that case says so.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import gzip
import importlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from aiohttp import ClientSession, ClientTimeout, web
from multidict import CIMultiDict

__all__ = ["CaseResult", "Run", "main", "measure"]

#: The header the upstream dispatches on (the proxy forwards it as it is).
CASE_HEADER: Final = "X-Capture-Case"
TENANT_HEADER: Final = "X-Tenant"
READY_LINE: Final = "[^Worker]: Ready"
_LISTENING: Final = re.compile(rb"proxy: listening on [^\s]*?:(\d+)")
#: Seconds a stopped process gets between SIGTERM and SIGKILL.
STOP_WAIT_S: Final = 15.0
#: Longest a case's traffic may take (its records are awaited after, `--record-timeout`).
CASE_TIMEOUT_S: Final = 45.0
CREATED: Final = 1_764_200_000
SYSTEM_FINGERPRINT: Final = "fp_c4a1d6e3f9"


@dataclass(frozen=True, slots=True)
class Counts:
    input_tokens: int
    output_tokens: int

    def text(self) -> str:
        return f"{self.input_tokens:,}/{self.output_tokens:,}"


@dataclass
class CaseResult:
    """One case: what the client and the upstream saw, what was billed, the verdict."""

    key: str
    title: str
    #: Tenants whose billing events count for this case (`other_tenants`: any unknown one).
    tenants: list[str]
    #: What the upstream reported for all the case's calls (None: nothing on the wire).
    upstream: Counts | None
    #: Calls the provider bills, so records expected (0 once the proxy refused them).
    calls: int
    other_tenants: bool = False
    client: dict[str, Any] = field(default_factory=dict)
    upstream_saw: list[dict[str, Any]] = field(default_factory=list)
    #: The proxy's own answers that refused a call (status codes).
    refused: list[int] = field(default_factory=list)
    error: str | None = None
    ended_at: float = 0.0
    records: list[dict[str, Any]] = field(default_factory=list)
    billed: Counts | None = None
    usage_rows: Counts | None = None
    tokens: list[dict[str, Any]] = field(default_factory=list)
    #: Dead letters whose reason names one of the case's tenants.
    dead_letters: int = 0
    verdict: str = ""
    ok: bool = False


@dataclass
class Run:
    python: str
    checkout: str | None
    commit: str | None
    namespace: str
    run: str
    proxy_args: list[str]
    seconds: float = 0.0
    proxy_summary: list[str] = field(default_factory=list)
    #: `deadletter --json --summary` of the run's namespace (or why it could not be read).
    deadletter: dict[str, Any] = field(default_factory=dict)
    #: What went wrong while reading the results (a failed read command).
    notes: list[str] = field(default_factory=list)
    cases: list[CaseResult] = field(default_factory=list)


# --------------------------------------------------------------------------- wire bodies


def openai_usage(counts: Counts) -> dict[str, Any]:
    return {
        "prompt_tokens": counts.input_tokens,
        "completion_tokens": counts.output_tokens,
        "total_tokens": counts.input_tokens + counts.output_tokens,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def chat_stream(
    call_id: str,
    model: str,
    pieces: Sequence[str],
    counts: Counts,
    *,
    include_usage: bool,
    ollama: bool = False,
) -> list[bytes]:
    """An OpenAI-compatible chat stream, usage as the provider sends it.

    OpenAI: every chunk has ``"usage":null`` and a usage-only chunk ends the
    stream only when the request asked for usage.  Ollama (`ollama`): no
    ``usage`` member on the other chunks, the usage chunk when asked.
    """

    def chunk(choices: list[dict[str, Any]], usage: Any = None) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "id": call_id,
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": model,
        }
        if not ollama:
            obj["service_tier"] = "default"
        obj["system_fingerprint"] = "fp_ollama" if ollama else SYSTEM_FINGERPRINT
        obj["choices"] = choices
        if include_usage and (usage is not None or not ollama):
            obj["usage"] = usage
        return obj

    def choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"index": 0, "delta": delta}
        if not ollama:
            out["logprobs"] = None
        out["finish_reason"] = finish
        return out

    first = {"role": "assistant", "content": ""} | ({} if ollama else {"refusal": None})
    events = [sse(chunk([choice(first)]))]
    events += [sse(chunk([choice({"content": piece})])) for piece in pieces]
    events.append(sse(chunk([choice({}, "stop")])))
    if include_usage:
        events.append(sse(chunk([], openai_usage(counts))))
    events.append(sse("[DONE]"))
    return events


def completions_stream(
    call_id: str, model: str, pieces: Sequence[str], counts: Counts, *, include_usage: bool
) -> list[bytes]:
    """A legacy `/v1/completions` stream (same usage rule as chat)."""

    def chunk(choices: list[dict[str, Any]], usage: Any = None) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "id": call_id,
            "object": "text_completion",
            "created": CREATED,
            "choices": choices,
            "model": model,
            "system_fingerprint": None,
        }
        if include_usage:
            obj["usage"] = usage
        return obj

    def choice(text: str, finish: str | None = None) -> dict[str, Any]:
        return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}

    events = [sse(chunk([choice(piece)])) for piece in pieces]
    events.append(sse(chunk([choice("", "stop")])))
    if include_usage:
        usage = {
            "prompt_tokens": counts.input_tokens,
            "completion_tokens": counts.output_tokens,
            "total_tokens": counts.input_tokens + counts.output_tokens,
        }
        events.append(sse(chunk([], usage)))
    events.append(sse("[DONE]"))
    return events


def chat_completion(
    call_id: str,
    model: str,
    text: str,
    counts: Counts,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "id": call_id,
        "object": "chat.completion",
        "created": CREATED,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": [],
                },
                "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
                "finish_reason": "stop",
            }
        ],
        "usage": openai_usage(counts),
        "service_tier": "default",
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }


_WORDS: Final = (
    " the", " partition", " offset", " consumer", " group", " keeps", " its", " own",
    " order", " and", " each", " record", " is", " read", " once", ",", ".",
)  # fmt: skip


def logprob_entry(index: int) -> dict[str, Any]:
    """One token of `logprobs.content`, with five alternatives (`top_logprobs: 5`)."""
    token = _WORDS[index % len(_WORDS)]

    def one(tok: str, rank: int) -> dict[str, Any]:
        value = -round(0.0001 * ((index * 7 + rank * 13) % 997) + rank * 1.37, 6)
        return {"token": tok, "logprob": value, "bytes": list(tok.encode())}

    alternatives = [one(_WORDS[(index + r) % len(_WORDS)], r) for r in range(5)]
    return {**one(token, 0), "top_logprobs": alternatives}


def big_completion(call_id: str, target_bytes: int, prompt_tokens: int) -> tuple[bytes, Counts]:
    """A `chat.completion` of about `target_bytes` (at least), padded by its logprobs."""
    sample = len(json.dumps(logprob_entry(0), separators=(",", ":"))) + 1
    tokens = max(1, target_bytes // sample)
    while True:
        entries = [logprob_entry(i) for i in range(tokens)]
        counts = Counts(prompt_tokens, tokens)
        text = "".join(entry["token"] for entry in entries)
        body = json.dumps(
            chat_completion(call_id, "gpt-4o-mini-2024-07-18", text, counts, entries),
            separators=(",", ":"),
        ).encode()
        if len(body) >= target_bytes:
            return body, counts
        tokens += (target_bytes - len(body)) // sample + 1


def response_object(
    response_id: str, status: str, counts: Counts | None, text: str = ""
) -> dict[str, Any]:
    """A Responses API `response` object (background mode)."""
    output: list[dict[str, Any]] = []
    if status == "completed":
        output = [
            {
                "id": "msg_" + response_id[5:],
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [
                    {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                ],
            }
        ]
    usage = None
    if counts is not None:
        usage = {
            "input_tokens": counts.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": counts.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts.input_tokens + counts.output_tokens,
        }
    return {
        "id": response_id,
        "object": "response",
        "created_at": CREATED,
        "status": status,
        "background": True,
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "max_output_tokens": None,
        "model": "gpt-4.1-2025-04-14",
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": True,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": usage,
        "user": None,
        "metadata": {},
    }


def _codec(name: str) -> Any:
    """The brotli or zstandard module, or None when it is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def encode(body: bytes, encoding: str) -> bytes:
    if encoding == "br":
        return bytes(_codec("brotli").compress(body))
    if encoding == "zstd":
        return bytes(_codec("zstandard").ZstdCompressor().compress(body))
    if encoding == "gzip":
        return gzip.compress(body)
    return body


def decode(body: bytes, encoding: str) -> bytes:
    encoding = encoding.strip().lower() or "identity"
    if encoding == "br":
        return bytes(_codec("brotli").decompress(body))
    if encoding == "zstd":
        return bytes(_codec("zstandard").ZstdDecompressor().decompressobj().decompress(body))
    if encoding == "gzip":
        return gzip.decompress(body)
    return body


def pick_encoding(accept: str) -> str:
    """What a provider's front answers: br, zstd, gzip as offered (and decodable here)."""
    offered = {part.split(";")[0].strip().lower() for part in accept.split(",")}
    for name, module in (("br", "brotli"), ("zstd", "zstandard"), ("gzip", None)):
        if name in offered and (module is None or _codec(module) is not None):
            return name
    return "identity"


# --------------------------------------------------------------------------- the upstream

Handler = Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]


async def write_events(
    request: web.Request,
    events: Sequence[bytes],
    saw: dict[str, Any],
    *,
    pace_s: float = 0.0,
    pause_before: int | None = None,
    pause_s: float = 0.0,
) -> web.StreamResponse:
    """Stream `events`; `saw["wrote_all"]` says whether every write went through."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    saw["wrote_all"] = False
    try:
        for index, event in enumerate(events):
            if index == pause_before:
                await asyncio.sleep(pause_s)
            await response.write(event)
            if pace_s:
                await asyncio.sleep(pace_s)
        await response.write_eof()
        saw["wrote_all"] = True
    except ConnectionError as exc:
        saw["write_error"] = type(exc).__name__
    return response


def asked_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


class Upstream:
    """The provider: one aiohttp app; each case's behaviour is chosen by `CASE_HEADER`."""

    def __init__(self) -> None:
        self.routes: dict[str, Handler] = {}
        self.saw: dict[str, list[dict[str, Any]]] = {}
        #: The provider id and usage of each call of the colliding-ids case, by its question.
        self.calls: dict[str, tuple[str, Counts]] = {}
        self.polls: dict[str, int] = {}
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        case = request.headers.get(CASE_HEADER, "")
        handler = self.routes.get(case)
        if handler is None:
            return web.json_response({"error": {"message": f"no case {case!r}"}}, status=404)
        saw: dict[str, Any] = {
            "method": request.method,
            "path": request.path,
            "tenant_header": request.headers.getall(TENANT_HEADER, []),
            "accept_encoding": request.headers.get("Accept-Encoding"),
        }
        self.saw.setdefault(case, []).append(saw)
        return await handler(request, saw)


# --------------------------------------------------------------------------- processes


def _stop_process(proc: subprocess.Popen[bytes]) -> int | None:
    """SIGTERM its process group, then SIGKILL after `STOP_WAIT_S`; its exit status."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(STOP_WAIT_S)
    return proc.returncode


class Processes:
    """The subprocesses of a run; `stop_all` ends every one still running."""

    def __init__(self, python: str, env: dict[str, str], log_dir: Path) -> None:
        self.python = python
        self.env = env
        self.log_dir = log_dir
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.log_dir / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [self.python, "-m", "streamtally.cli", *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.log_dir,
                start_new_session=True,
            )
        self.started.append(proc)
        return proc, log

    def stop_all(self) -> None:
        for proc in reversed(self.started):
            _stop_process(proc)

    async def command(self, *args: str, timeout: float = 60.0) -> tuple[int | None, str, str]:
        """``streamtally ARGS`` of the checkout under test: (exit status, stdout, stderr)."""
        proc = await asyncio.create_subprocess_exec(
            self.python,
            "-m",
            "streamtally.cli",
            *args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self.env,
            cwd=self.log_dir,
            start_new_session=True,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except (TimeoutError, asyncio.CancelledError):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise
        return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


async def wait_for_log(
    proc: subprocess.Popen[bytes], log: Path, pattern: re.Pattern[bytes], timeout: float
) -> re.Match[bytes]:
    deadline = time.monotonic() + timeout
    while True:
        found = pattern.search(log.read_bytes())
        if found:
            return found
        if proc.poll() is not None:
            raise SystemExit(f"{log.stem} exited with {proc.returncode}:\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{log.stem} not ready in {timeout:g} s:\n{_tail(log)}")
        await asyncio.sleep(0.1)


def _tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


# --------------------------------------------------------------------------- the cases


@dataclass
class Context:
    run: str
    base: str
    upstream: Upstream
    session: ClientSession
    procs: Processes
    proxy_log: Path
    upstream_port: int
    bootstrap_servers: str
    #: The option case 11 gives ``nan`` (`case_budget_nan`).
    nan_option: str = "--drain-seconds"
    known_tenants: set[str] = field(default_factory=set)

    def tenant(self, case: str) -> str:
        name = f"cap-{self.run}-{case}"
        self.known_tenants.add(name)
        return name

    def headers(self, case: str, tenant: str | None, **more: str) -> CIMultiDict[str]:
        headers: CIMultiDict[str] = CIMultiDict()
        headers[CASE_HEADER] = case
        headers["Authorization"] = f"Bearer sk-capture-{self.run}"
        if tenant is not None:
            headers[TENANT_HEADER] = tenant
        headers.update(more)
        return headers


def _refused(result: CaseResult, status: int) -> bool:
    """A 4xx/5xx answer is the proxy's own here (the upstream answers 200): noted."""
    if status >= 400:
        result.refused.append(status)
        return True
    return False


def _openai_client(ctx: Context, case: str, tenant: str) -> Any:
    from openai import AsyncOpenAI

    return AsyncOpenAI(
        api_key=f"sk-capture-{ctx.run}",
        base_url=f"{ctx.base}/v1",
        default_headers={TENANT_HEADER: tenant, CASE_HEADER: case},
        max_retries=0,
        timeout=30.0,
    )


async def _sdk_call(result: CaseResult, call: Callable[[], Awaitable[None]]) -> None:
    """Run an SDK call; a refusal of the proxy (an API status error) is noted, not raised."""
    from openai import APIStatusError

    try:
        await call()
    except APIStatusError as exc:
        _refused(result, exc.status_code)
        result.client["error"] = f"{exc.status_code}: {str(exc)[:200]}"


PIECES: Final = ("Partitions", " keep", " order;", " consumer", " groups", " keep", " offsets.")


async def case_sdk_stream(ctx: Context) -> CaseResult:
    """1: the openai SDK's default streamed call (no stream_options)."""
    key = "1"
    tenant = ctx.tenant("sdk-stream")
    counts = Counts(1187, 342)

    async def upstream(request: web.Request, saw: dict[str, Any]) -> web.StreamResponse:
        body = await request.json()
        saw["asked_usage"] = asked_usage(body)
        events = chat_stream(
            f"chatcmpl-{ctx.run}sdk", "gpt-4o-mini-2024-07-18", PIECES, counts,
            include_usage=saw["asked_usage"],
        )  # fmt: skip
        return await write_events(request, events, saw)

    ctx.upstream.routes[key] = upstream
    result = CaseResult(key, "openai SDK stream=True, default options", [tenant], counts, 1)
    client = _openai_client(ctx, key, tenant)

    async def call() -> None:
        stream = await client.chat.completions.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": "How does Kafka keep order?"}],
            stream=True,
        )
        text, chunks, usage_chunks = "", 0, 0
        async for chunk in stream:
            chunks += 1
            usage_chunks += chunk.usage is not None
            for choice in chunk.choices:
                text += choice.delta.content or ""
        result.client.update(
            chunks=chunks, usage_chunks_seen=usage_chunks, text_ok=text == "".join(PIECES)
        )

    try:
        await _sdk_call(result, call)
    finally:
        await client.close()
    return result


async def case_hangup_stream(ctx: Context) -> CaseResult:
    """2: a client that asks usage, then hangs up after the finish chunk, before the usage."""
    key = "2"
    tenant = ctx.tenant("hangup-stream")
    counts = Counts(812, 153)

    async def upstream(request: web.Request, saw: dict[str, Any]) -> web.StreamResponse:
        body = await request.json()
        saw["asked_usage"] = asked_usage(body)
        events = chat_stream(
            f"chatcmpl-{ctx.run}cut", "gpt-4o-mini-2024-07-18", PIECES, counts, include_usage=True
        )
        # the finish chunk is third from the end: then ~1 s, then the usage chunk and [DONE]
        return await write_events(request, events, saw, pause_before=len(events) - 2, pause_s=1.0)

    ctx.upstream.routes[key] = upstream
    result = CaseResult(key, "client gone after finish chunk (stream)", [tenant], counts, 1)
    body = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "How does Kafka keep order?"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with ctx.session.post(
        f"{ctx.base}/v1/chat/completions", json=body, headers=ctx.headers(key, tenant)
    ) as resp:
        if _refused(result, resp.status):
            return result
        got = b""
        while b'"finish_reason":"stop"' not in got:
            piece = await resp.content.readany()
            if not piece:
                break
            got += piece
        result.client["saw_finish"] = b'"finish_reason":"stop"' in got
        result.client["saw_usage"] = b'"prompt_tokens"' in got
        resp.close()  # hang up: the usage chunk has not come yet
    await asyncio.sleep(1.5)  # the upstream sends its usage meanwhile
    return result


async def case_hangup_body(ctx: Context) -> CaseResult:
    """3: a non-streaming client that hangs up after the last JSON byte, before the end."""
    key = "3"
    tenant = ctx.tenant("hangup-body")
    counts = Counts(640, 211)
    body_bytes = json.dumps(
        chat_completion(f"chatcmpl-{ctx.run}body", "gpt-4o-mini-2024-07-18", "".join(PIECES),
                        counts),
        separators=(",", ":"),
    ).encode()  # fmt: skip

    async def upstream(request: web.Request, saw: dict[str, Any]) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        saw["wrote_all"] = False
        try:
            half = len(body_bytes) // 2
            await response.write(body_bytes[:half])
            await response.write(body_bytes[half:])
            await asyncio.sleep(1.0)  # the body is complete; its end comes later
            await response.write_eof()
            saw["wrote_all"] = True
        except ConnectionError as exc:
            saw["write_error"] = type(exc).__name__
        return response

    ctx.upstream.routes[key] = upstream
    result = CaseResult(key, "client gone after last JSON byte (body)", [tenant], counts, 1)
    request = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Kafka?"}]}
    headers = ctx.headers(key, tenant, **{"Accept-Encoding": "identity"})
    async with ctx.session.post(
        f"{ctx.base}/v1/chat/completions", json=request, headers=headers
    ) as resp:
        if _refused(result, resp.status):
            return result
        got = b""
        parsed = False
        while not parsed:
            piece = await resp.content.readany()
            if not piece:
                break
            got += piece
            with contextlib.suppress(ValueError):
                json.loads(got)
                parsed = True
        result.client["got_whole_json"] = parsed
        resp.close()  # hang up before the chunked body's end
    await asyncio.sleep(1.5)
    return result


async def case_encoding(ctx: Context, encoding: str) -> CaseResult:
    """4: the client offers only `encoding`; the upstream compresses with it."""
    key = f"4-{encoding}"
    tenant = ctx.tenant(f"enc-{encoding}")
    counts = Counts(905, 77) if encoding == "br" else Counts(906, 78)
    module = "brotli" if encoding == "br" else "zstandard"
    plain = json.dumps(
        chat_completion(f"chatcmpl-{ctx.run}{encoding}", "gpt-4o-mini-2024-07-18",
                        "".join(PIECES), counts),
        separators=(",", ":"),
    ).encode()  # fmt: skip

    async def upstream(request: web.Request, saw: dict[str, Any]) -> web.StreamResponse:
        await request.read()
        chosen = pick_encoding(request.headers.get("Accept-Encoding", ""))
        saw["answered_encoding"] = chosen
        headers = {"Content-Type": "application/json"}
        if chosen != "identity":
            headers["Content-Encoding"] = chosen
        return web.Response(body=encode(plain, chosen), headers=headers)

    ctx.upstream.routes[key] = upstream
    title = f"Accept-Encoding: {encoding} only (body)"
    result = CaseResult(key, title, [tenant], counts, 1)
    if _codec(module) is None:
        result.error = f"skipped: the {module} package is not installed here"
        result.calls = 0
        return result
    request = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Kafka?"}]}
    headers = ctx.headers(key, tenant, **{"Accept-Encoding": encoding})
    url = f"{ctx.base}/v1/chat/completions"
    async with (
        ClientSession(auto_decompress=False, timeout=ClientTimeout(total=30)) as raw,
        raw.post(url, json=request, headers=headers) as resp,
    ):
        if _refused(result, resp.status):
            return result
        data = await resp.read()
        got = resp.headers.get("Content-Encoding", "identity")
    result.client["content_encoding"] = got
    result.client["body_ok"] = decode(data, got) == plain
    return result


async def case_size(ctx: Context, label: str, target: int) -> CaseResult:
    """5: a non-streaming body of `target` bytes (logprobs)."""
    key = f"5-{label}"
    tenant = ctx.tenant(f"size-{label}")
    body, counts = big_completion(f"chatcmpl-{ctx.run}{label}", target, 500)

    async def upstream(request: web.Request, saw: dict[str, Any]) -> web.StreamResponse:
        await request.read()
        saw["body_bytes"] = len(body)
        return web.Response(body=body, content_type="application/json")

    ctx.upstream.routes[key] = upstream
    result = CaseResult(key, f"non-streaming body of {len(body):,} bytes", [tenant], counts, 1)
    request = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "Kafka?"}],
        "logprobs": True,
        "top_logprobs": 5,
    }
    headers = ctx.headers(key, tenant, **{"Accept-Encoding": "identity"})
    async with ctx.session.post(
        f"{ctx.base}/v1/chat/completions", json=request, headers=headers
    ) as resp:
        if _refused(result, resp.status):
            return result
        data = await resp.read()
    result.client["body_ok"] = data == body
    return result


async def case_background(ctx: Context) -> CaseResult:
    """6: Responses API background mode: queued at create, usage at retrieve."""
    key = "6"
    tenant = ctx.tenant("background")
    counts = Counts(50_000, 20_000)
    response_id = f"resp_{ctx.run}{uuid.uuid4().hex}"
    text = "A summary of the fifty-thousand-token report."

    async def upstream(request: web.Request, _saw: dict[str, Any]) -> web.StreamResponse:
        await request.read()
        if request.method == "POST":
            return web.json_response(response_object(response_id, "queued", None))
        polls = ctx.upstream.polls[key] = ctx.upstream.polls.get(key, 0) + 1
        if polls < 2:
            return web.json_response(response_object(response_id, "in_progress", None))
        return web.json_response(response_object(response_id, "completed", counts, text))

    ctx.upstream.routes[key] = upstream
    result = CaseResult(key, "Responses background: create, retrieve", [tenant], counts, 1)
    headers = ctx.headers(key, tenant, **{"Accept-Encoding": "identity"})
    create = {"model": "gpt-4.1", "input": "Summarise the report.", "background": True}
    async with ctx.session.post(f"{ctx.base}/v1/responses", json=create, headers=headers) as resp:
        if _refused(result, resp.status):
            return result
        created = await resp.json()
    statuses = [created.get("status")]
    for _ in range(20):
        await asyncio.sleep(0.2)
        async with ctx.session.get(
            f"{ctx.base}/v1/responses/{created['id']}", headers=headers
        ) as resp:
            if _refused(result, resp.status):
                return result
            statuses.append((await resp.json()).get("status"))
        if statuses[-1] == "completed":
            break
    result.client["statuses"] = statuses
    return result


async def case_completions(ctx: Context) -> CaseResult:
    """7: `/v1/completions` streamed, by the openai SDK's default call."""
    key = "7-completions"
    tenant = ctx.tenant("completions")
    counts = Counts(64, 128)

    async def upstream(request: web.Request, saw: dict[str, Any]) -> web.StreamResponse:
        body = await request.json()
        saw["asked_usage"] = asked_usage(body)
        events = completions_stream(
            f"cmpl-{ctx.run}", "gpt-3.5-turbo-instruct", PIECES, counts,
            include_usage=saw["asked_usage"],
        )  # fmt: skip
        return await write_events(request, events, saw)

    ctx.upstream.routes[key] = upstream
    result = CaseResult(key, "/v1/completions stream (SDK default)", [tenant], counts, 1)
    client = _openai_client(ctx, key, tenant)

    async def call() -> None:
        stream = await client.completions.create(
            model="gpt-3.5-turbo-instruct", prompt="Kafka keeps", stream=True, max_tokens=128
        )
        text, usage_chunks = "", 0
        async for chunk in stream:
            usage_chunks += chunk.usage is not None
            for choice in chunk.choices:
                text += choice.text
        result.client.update(usage_chunks_seen=usage_chunks, text_ok=text == "".join(PIECES))

    try:
        await _sdk_call(result, call)
    finally:
        await client.close()
    return result


async def case_embeddings(ctx: Context) -> CaseResult:
    """7: `/v1/embeddings` by the openai SDK (it asks base64 by default)."""
    key = "7-embeddings"
    tenant = ctx.tenant("embeddings")
    counts = Counts(42, 0)
    vector = [round(((i * 37) % 200 - 100) / 1000, 3) for i in range(1536)]

    async def upstream(request: web.Request, saw: dict[str, Any]) -> web.StreamResponse:
        body = await request.json()
        saw["encoding_format"] = body.get("encoding_format")
        embedding: Any = vector
        if body.get("encoding_format") == "base64":
            embedding = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        return web.json_response(
            {
                "object": "list",
                "data": [{"object": "embedding", "index": 0, "embedding": embedding}],
                "model": "text-embedding-3-small",
                "usage": {"prompt_tokens": counts.input_tokens, "total_tokens": 42},
            }
        )

    ctx.upstream.routes[key] = upstream
    result = CaseResult(key, "/v1/embeddings (SDK)", [tenant], counts, 1)
    client = _openai_client(ctx, key, tenant)

    async def call() -> None:
        made = await client.embeddings.create(
            model="text-embedding-3-small", input="Kafka keeps partitions in order."
        )
        result.client["dimensions"] = len(made.data[0].embedding)

    try:
        await _sdk_call(result, call)
    finally:
        await client.close()
    return result


async def case_gemini_embed(ctx: Context) -> CaseResult:
    """7: Gemini `embedContent` (the Gemini API reports no token count for it)."""
    key = "7-embedContent"
    tenant = ctx.tenant("gemini-embed")
    values = [round(((i * 53) % 300 - 150) / 1000, 3) for i in range(768)]

    async def upstream(request: web.Request, _saw: dict[str, Any]) -> web.StreamResponse:
        await request.read()
        return web.json_response({"embedding": {"values": values}})

    ctx.upstream.routes[key] = upstream
    result = CaseResult(key, "Gemini :embedContent", [tenant], None, 1)
    headers = ctx.headers(key, tenant, **{"x-goog-api-key": f"AIza-capture-{ctx.run}"})
    del headers["Authorization"]
    body = {
        "model": "models/gemini-embedding-001",
        "content": {"parts": [{"text": "Kafka keeps partitions in order."}]},
    }
    url = f"{ctx.base}/v1beta/models/gemini-embedding-001:embedContent"
    async with ctx.session.post(url, json=body, headers=headers) as resp:
        if _refused(result, resp.status):
            return result
        got = await resp.json()
    result.client["dimensions"] = len(got["embedding"]["values"])
    return result


async def _ollama_call(ctx: Context, result: CaseResult, call_id: str, counts: Counts) -> None:
    """One Ollama-style streamed chat call (the client asks usage) with a fixed id."""
    key, tenant = result.key, result.tenants[0]
    ctx.upstream.calls[f"{key}:{counts.input_tokens}"] = (call_id, counts)
    body = {
        "model": "llama3.2",
        "messages": [{"role": "user", "content": f"Question {counts.input_tokens}"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with ctx.session.post(
        f"{ctx.base}/v1/chat/completions", json=body, headers=ctx.headers(key, tenant)
    ) as resp:
        if _refused(result, resp.status):
            return
        data = await resp.read()
    result.client.setdefault("usage_chunks_seen", 0)
    result.client["usage_chunks_seen"] += data.count(b'"prompt_tokens"')


def _ollama_upstream(ctx: Context, key: str, pace_s: float) -> Handler:
    async def upstream(request: web.Request, saw: dict[str, Any]) -> web.StreamResponse:
        body = await request.json()
        question = body["messages"][0]["content"].split()[-1]
        call_id, counts = ctx.upstream.calls[f"{key}:{question}"]
        events = chat_stream(
            call_id, "llama3.2", PIECES, counts,
            include_usage=asked_usage(body), ollama=True,
        )  # fmt: skip
        return await write_events(request, events, saw, pace_s=pace_s)

    return upstream


async def case_collision(ctx: Context, overlapping: bool) -> CaseResult:
    """8: two calls of one tenant with the same provider id (Ollama ids are small numbers)."""
    key = "8-overlapping" if overlapping else "8-sequential"
    tenant = ctx.tenant(key[2:])
    ctx.upstream.routes[key] = _ollama_upstream(ctx, key, 0.05 if overlapping else 0.0)
    if overlapping:
        first, second, call_id = Counts(7000, 700), Counts(7001, 701), "chatcmpl-58"
    else:
        first, second, call_id = Counts(1000, 100), Counts(9000, 900), "chatcmpl-417"
    total = Counts(
        first.input_tokens + second.input_tokens, first.output_tokens + second.output_tokens
    )
    title = f"two calls, one provider id ({'overlapping' if overlapping else 'sequential'})"
    result = CaseResult(key, title, [tenant], total, 2)
    if overlapping:
        await asyncio.gather(
            _ollama_call(ctx, result, call_id, first),
            _ollama_call(ctx, result, call_id, second),
        )
    else:
        await _ollama_call(ctx, result, call_id, first)
        await _ollama_call(ctx, result, call_id, second)
    return result


def _plain_chat_upstream(call_id: str, counts: Counts) -> Handler:
    body = json.dumps(
        chat_completion(call_id, "gpt-4o-mini-2024-07-18", "".join(PIECES), counts),
        separators=(",", ":"),
    ).encode()

    async def upstream(request: web.Request, _saw: dict[str, Any]) -> web.StreamResponse:
        await request.read()
        return web.Response(body=body, content_type="application/json")

    return upstream


async def case_tenant_twice(ctx: Context) -> CaseResult:
    """9: ``X-Tenant: victim`` then ``X-Tenant: attacker``, two header lines."""
    key = "9-twice"
    victim, attacker = ctx.tenant("victim"), ctx.tenant("attacker")
    counts = Counts(300, 40)
    ctx.upstream.routes[key] = _plain_chat_upstream(f"chatcmpl-{ctx.run}twice", counts)
    result = CaseResult(key, "X-Tenant: victim, then X-Tenant: attacker", [victim, attacker],
                        counts, 1)  # fmt: skip
    headers = ctx.headers(key, victim, **{"Accept-Encoding": "identity"})
    headers.add(TENANT_HEADER, attacker)
    request = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Kafka?"}]}
    async with ctx.session.post(
        f"{ctx.base}/v1/chat/completions", json=request, headers=headers
    ) as resp:
        result.client["status"] = resp.status
        await resp.read()
    _refused(result, resp.status)
    return result


async def case_no_tenant(ctx: Context) -> CaseResult:
    """9: a call without the tenant header."""
    key = "9-none"
    counts = Counts(310, 41)
    ctx.upstream.routes[key] = _plain_chat_upstream(f"chatcmpl-{ctx.run}none", counts)
    result = CaseResult(key, "no X-Tenant header", [], counts, 1, other_tenants=True)
    headers = ctx.headers(key, None, **{"Accept-Encoding": "identity"})
    request = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Kafka?"}]}
    async with ctx.session.post(
        f"{ctx.base}/v1/chat/completions", json=request, headers=headers
    ) as resp:
        result.client["status"] = resp.status
        await resp.read()
    _refused(result, resp.status)
    return result


async def case_secrets(ctx: Context) -> CaseResult:
    """10: a malformed upstream reply: the Authorization key and ``?key=`` in the proxy's output?"""
    key = "10"
    tenant = ctx.tenant("secrets")
    bearer = f"sk-capture-{ctx.run}-bearer-secret"
    query_key = f"AIza-capture-{ctx.run}-query-secret"

    async def upstream(request: web.Request, _saw: dict[str, Any]) -> web.StreamResponse:
        await request.read()
        transport = request.transport
        if transport is None:
            raise ConnectionResetError("the proxy went away")
        transport.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12x\r\n\r\n{}"
        )
        transport.close()
        raise asyncio.CancelledError  # the reply is written: nothing more from this handler

    ctx.upstream.routes[key] = upstream
    result = CaseResult(key, "malformed upstream reply: secrets out?", [tenant], None, 0)
    answers: list[str] = []
    statuses: list[int] = []
    openai_headers = ctx.headers(key, tenant, **{"Accept-Encoding": "identity"})
    openai_headers["Authorization"] = f"Bearer {bearer}"
    gemini_headers = ctx.headers(key, tenant, **{"Accept-Encoding": "identity"})
    del gemini_headers["Authorization"]
    calls = (
        (f"{ctx.base}/v1/chat/completions", openai_headers),
        (f"{ctx.base}/v1beta/models/gemini-2.5-flash:generateContent?key={query_key}",
         gemini_headers),
    )  # fmt: skip
    for url, headers in calls:
        async with ctx.session.post(url, json={"contents": []}, headers=headers) as resp:
            statuses.append(resp.status)
            answers.append(await resp.text(errors="replace"))
    await asyncio.sleep(0.5)  # the proxy's log line
    log = ctx.proxy_log.read_text(errors="replace")
    body = "\n".join(answers)
    result.client.update(
        statuses=statuses,
        bearer_in_log=bearer in log,
        key_in_log=query_key in log,
        bearer_in_answer=bearer in body,
        key_in_answer=query_key in body,
        answers=[answer[:300] for answer in answers],
    )
    result.client["_secrets"] = [bearer, query_key]
    return result


async def case_budget_nan(ctx: Context) -> CaseResult:
    """11: a NaN option: accepted (the proxy listens) or refused (it exits)?

    ``--budget-ms nan`` up to the write-ahead spool (the option is gone since, and an
    unknown option proves nothing); ``--drain-seconds nan`` after it.
    """
    option = ctx.nan_option
    result = CaseResult("11", f"proxy {option} nan", [], None, 0)
    proc, log = ctx.procs.start(
        "proxy-budget-nan", "proxy",
        "--upstream", f"http://127.0.0.1:{ctx.upstream_port}",
        "--listen", "127.0.0.1:0",
        "--bootstrap-servers", ctx.bootstrap_servers,
        option, "nan",
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if _LISTENING.search(log.read_bytes()):
            result.client["accepted"] = True
            break
        if proc.poll() is not None:
            result.client["accepted"] = False
            result.client["exit_status"] = proc.returncode
            result.client["message"] = _tail(log, 3)
            break
        await asyncio.sleep(0.1)
    else:
        result.error = "neither listening nor exited in 60 s"
    await asyncio.to_thread(_stop_process, proc)
    return result


# --------------------------------------------------------------------------- billed figures


def _sum(rows: Sequence[dict[str, Any]]) -> Counts:
    return Counts(
        sum(int(row.get("input_tokens") or 0) for row in rows),
        sum(int(row.get("output_tokens") or 0) for row in rows),
    )


def events_of(result: CaseResult, events: Sequence[dict[str, Any]], known: set[str]) -> list[Any]:
    if result.other_tenants:
        return [e for e in events if e.get("tenant") not in known]
    return [e for e in events if e.get("tenant") in result.tenants]


async def billing_events(procs: Processes) -> list[dict[str, Any]]:
    code, out, err = await procs.command("billing", "export", "--json", timeout=90)
    if code not in (0, 1):
        raise RuntimeError(f"billing export exited {code}: {err.strip()[-500:]}")
    return [json.loads(line) for line in out.splitlines() if line.strip()]


async def await_records(
    procs: Processes,
    results: Sequence[CaseResult],
    known: set[str],
    timeout: float,
    notes: list[str],
) -> list[dict[str, Any]]:
    """Billing events until every case has its records or is `timeout` past its traffic.

    A failed export is noted in `notes` and tried again while a case waits.
    """
    events: list[dict[str, Any]] = []
    while True:
        try:
            events = await billing_events(procs)
        except (RuntimeError, TimeoutError, ValueError) as exc:
            notes.append(f"billing export: {type(exc).__name__}: {exc}")
        now = time.monotonic()
        waiting = [
            r
            for r in results
            if r.calls > 0
            and len(events_of(r, events, known)) < r.calls
            and now < r.ended_at + timeout
        ]
        if not waiting:
            return events
        await asyncio.sleep(1.0)


async def usage_rows(
    procs: Processes, tenants: set[str], notes: list[str]
) -> dict[str, Counts] | None:
    """The usage rows of `tenants`, summed per tenant (None: `usage --json` failed, noted)."""
    try:
        code, out, err = await procs.command("usage", "--json", timeout=60)
        if code != 0:
            raise RuntimeError(f"exit {code}: {err.strip()[-500:]}")
        rows = [row for row in json.loads(out) if row.get("tenant") in tenants]
    except (RuntimeError, TimeoutError, ValueError) as exc:
        notes.append(f"usage --json: {type(exc).__name__}: {exc}")
        return None
    return {tenant: _sum([r for r in rows if r["tenant"] == tenant]) for tenant in tenants}


async def tokens_of(procs: Processes, tenant: str, request_id: str) -> dict[str, Any]:
    code, out, err = await procs.command("tokens", "get", "--tenant", tenant, request_id)
    if code != 0:
        return {"tenant": tenant, "request_id": request_id, "missing": err.strip()[-200:]}
    tokens = json.loads(out)
    usage = tokens.get("usage") or {}
    return {
        "tenant": tenant,
        "request_id": request_id,
        "input_tokens": usage.get("input_tokens"),
        "output_tokens": usage.get("output_tokens"),
        "finish_reason": tokens.get("finish_reason"),
    }


_RECORD_FIELDS: Final = (
    "request_id", "tenant", "model", "source", "finish_reason", "input_tokens",
    "output_tokens", "usage_source",
)  # fmt: skip


def _billed_verdict(upstream: Counts, billed: Counts) -> tuple[str, bool]:
    short = Counts(
        upstream.input_tokens - billed.input_tokens, upstream.output_tokens - billed.output_tokens
    )
    if short.input_tokens == 0 and short.output_tokens == 0:
        return "exact", True
    if short.input_tokens >= 0 and short.output_tokens >= 0:
        return f"UNDER-BILLED by {short.text()}", False
    if short.input_tokens <= 0 and short.output_tokens <= 0:
        over = Counts(-short.input_tokens, -short.output_tokens)
        return f"OVER-BILLED by {over.text()}", False
    return "WRONG COUNTS", False


def _judge_secrets(result: CaseResult) -> None:
    c = result.client
    leaks = [
        what
        for what, flag in (
            ("bearer key in proxy log", c["bearer_in_log"]),
            ("key= in proxy log", c["key_in_log"]),
            ("bearer key in answer", c["bearer_in_answer"]),
            ("key= in answer", c["key_in_answer"]),
        )
        if flag
    ]
    result.ok = not leaks
    result.verdict = "LEAKS: " + "; ".join(leaks) if leaks else "no secret in log or answer"
    result.verdict += f" (answers {', '.join(map(str, c['statuses']))})"


def judge(result: CaseResult, run_id: str) -> None:
    """The verdict of one case, from its client, its upstream and its records."""
    if result.error:
        result.verdict, result.ok = result.error, False
    elif result.key == "10":
        _judge_secrets(result)
    elif result.key == "11":
        if result.client.get("accepted"):
            result.verdict, result.ok = "ACCEPTED (the proxy listens)", False
        else:
            status = result.client.get("exit_status")
            result.verdict, result.ok = f"refused (exit {status})", True
    elif result.key.startswith("9-") and (result.refused or result.records):
        if result.refused:
            result.verdict, result.ok = f"refused ({result.refused[0]})", True
        else:
            names = sorted({str(r["tenant"]) for r in result.records})
            short = [name.removeprefix(f"cap-{run_id}-") for name in names]
            result.verdict, result.ok = f"BILLED TO {', '.join(short)}", False
    elif result.refused and result.calls == 0:
        result.verdict, result.ok = f"REFUSED ({', '.join(map(str, result.refused))})", False
    elif not result.records or result.billed is None:
        result.verdict, result.ok = "NO RECORD", False
    else:
        recorded = len(result.records) == result.calls
        if result.upstream is None:
            result.verdict, result.ok = "recorded (no usage on the wire)", recorded
        else:
            result.verdict, ok = _billed_verdict(result.upstream, result.billed)
            result.ok = ok and recorded
        if not recorded:
            result.verdict += f"; records: {len(result.records)} of {result.calls} calls"
    if result.key in UNASKED_USAGE and result.client.get("usage_chunks_seen"):
        result.verdict += "; THE CLIENT GOT A USAGE CHUNK IT DID NOT ASK FOR"
    if result.dead_letters:
        result.verdict += f"; {result.dead_letters} raw records dead-lettered"
    if result.records:
        sources = sorted({str(r.get("usage_source")) for r in result.records})
        result.verdict += f" (usage_source {', '.join(sources)})"
    if result.usage_rows is not None and result.usage_rows != result.billed:
        result.verdict += f" [usage rows {result.usage_rows.text()}]"
    found = [t for t in result.tokens if "missing" not in t]
    if result.tokens and (len(found) < len(result.tokens) or _sum(found) != result.billed):
        missing = len(result.tokens) - len(found)
        result.verdict += f" [Tokens {_sum(found).text()}, {missing} missing]"


# --------------------------------------------------------------------------- the run

#: Cases whose client did not ask for usage: a usage chunk must not reach it.
UNASKED_USAGE: Final = frozenset({"1", "7-completions"})
CASES: Final = (
    "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11",
)  # fmt: skip


def _checkout_of(python: str, cwd: Path) -> tuple[str | None, str | None]:
    """The checkout the interpreter imports streamtally from, and its commit.

    Run in `cwd` (the logs' folder): in the caller's folder, ``python -c`` would
    import the streamtally of that folder instead of the interpreter's own.
    """
    try:
        found = subprocess.run(
            [python, "-c", "import pathlib, streamtally; "
             "print(pathlib.Path(streamtally.__file__).resolve().parent.parent)"],
            capture_output=True, text=True, timeout=60, check=True, cwd=cwd,
        )  # fmt: skip
        root = found.stdout.strip()
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None, None
    return root, head.stdout.strip() or None


async def _traffic(
    ctx: Context, wanted: set[str]
) -> tuple[list[CaseResult], asyncio.Task[CaseResult] | None]:
    plan: list[tuple[str, str, Callable[[], Awaitable[CaseResult]]]] = [
        ("1", "1", lambda: case_sdk_stream(ctx)),
        ("2", "2", lambda: case_hangup_stream(ctx)),
        ("3", "3", lambda: case_hangup_body(ctx)),
        ("4", "4-br", lambda: case_encoding(ctx, "br")),
        ("4", "4-zstd", lambda: case_encoding(ctx, "zstd")),
        ("6", "6", lambda: case_background(ctx)),
        ("7", "7-completions", lambda: case_completions(ctx)),
        ("7", "7-embeddings", lambda: case_embeddings(ctx)),
        ("7", "7-embedContent", lambda: case_gemini_embed(ctx)),
        ("8", "8-sequential", lambda: case_collision(ctx, overlapping=False)),
        ("8", "8-overlapping", lambda: case_collision(ctx, overlapping=True)),
        ("9", "9-twice", lambda: case_tenant_twice(ctx)),
        ("9", "9-none", lambda: case_no_tenant(ctx)),
        # the big bodies late: a record the broker refuses must not hide the others
        ("5", "5-900KB", lambda: case_size(ctx, "900KB", 900_000)),
        ("5", "5-2MB", lambda: case_size(ctx, "2MB", 2_000_000)),
        ("5", "5-6MB", lambda: case_size(ctx, "6MB", 6_000_000)),
        ("10", "10", lambda: case_secrets(ctx)),
    ]
    nan_task = asyncio.create_task(case_budget_nan(ctx)) if "11" in wanted else None
    results: list[CaseResult] = []
    for number, label, make in plan:
        if number not in wanted:
            continue
        try:
            result = await asyncio.wait_for(make(), CASE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a failed case is reported, the run goes on
            result = CaseResult(label, f"case {label}", [], None, 0)
            result.error = f"CASE FAILED: {type(exc).__name__}: {str(exc)[:200]}"
        if result.refused:  # a call the proxy refused is no call the provider bills
            result.calls = max(0, result.calls - len(result.refused))
        result.ended_at = time.monotonic()
        results.append(result)
    return results, nan_task


def _order(key: str) -> int:
    """The case's number (sub-cases keep the order they ran in)."""
    number = key.split("-", 1)[0]
    return int(number) if number.isdigit() else 99


async def dead_letters(procs: Processes) -> dict[str, Any]:
    """`deadletter --json --summary`: the dead letters of the run's namespace, by reason."""
    try:
        code, out, err = await procs.command("deadletter", "--json", "--summary", timeout=60)
        summary = json.loads(out) if code in (0, 1) else {}
    except (TimeoutError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if not isinstance(summary, dict):
        return {"error": f"exit {code}: {err.strip()[-300:]}"}
    return summary


def dead_letters_of(result: CaseResult, summary: dict[str, Any]) -> int:
    """Dead letters whose reason quotes one of the case's tenants."""
    reasons = summary.get("by_reason")
    if not isinstance(reasons, list):
        return 0
    return sum(
        int(row.get("count", 0))
        for row in reasons
        if isinstance(row, dict)
        and any(f"'{tenant}'" in str(row.get("reason", "")) for tenant in result.tenants)
    )


async def _measure(args: argparse.Namespace, log_dir: Path) -> Run:
    started = time.monotonic()
    run_id = uuid.uuid4().hex[:8]
    namespace = f"capture-{run_id}"
    checkout, commit = _checkout_of(args.python, log_dir)
    run = Run(args.python, checkout, commit, namespace, run_id, list(args.proxy_arg))
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "STREAMTALLY_NAMESPACE": namespace,
        "KAFKA_BOOTSTRAP_SERVERS": args.bootstrap_servers,
        "REDIS_URL": args.redis_url,
        "STREAMTALLY_REQUEST_TIMEOUT": str(args.request_timeout),
        "STREAMTALLY_WEB_PORT": "0",
    }
    env.setdefault("STREAMTALLY_NATIVE", "off")
    procs = Processes(args.python, env, log_dir)
    upstream = Upstream()
    wanted = set(args.cases.split(",")) if args.cases else set(CASES)
    try:
        up_port = await upstream.start()
        proxy, proxy_log = procs.start(
            "proxy", "proxy",
            "--upstream", f"http://127.0.0.1:{up_port}",
            "--listen", "127.0.0.1:0",
            "--bootstrap-servers", args.bootstrap_servers,
            *args.proxy_arg,
        )  # fmt: skip
        worker, worker_log = procs.start("worker", "worker", "--loglevel", "info")
        found = await wait_for_log(proxy, proxy_log, _LISTENING, 90)
        await wait_for_log(worker, worker_log, re.compile(re.escape(READY_LINE.encode())), 150)
        async with ClientSession(timeout=ClientTimeout(total=45)) as session:
            ctx = Context(
                run_id, f"http://127.0.0.1:{int(found.group(1))}", upstream, session, procs,
                proxy_log, up_port, args.bootstrap_servers, args.nan_option,
            )  # fmt: skip
            results, nan_task = await _traffic(ctx, wanted)
        for result in results:
            result.upstream_saw = upstream.saw.get(result.key, [])
        events = await await_records(
            procs, results, ctx.known_tenants, args.record_timeout, run.notes
        )
        rows = await usage_rows(procs, ctx.known_tenants, run.notes)
        run.deadletter = await dead_letters(procs)
        gate = asyncio.Semaphore(3)

        async def tokens(tenant: str, request_id: str) -> dict[str, Any]:
            async with gate:
                return await tokens_of(procs, tenant, request_id)

        for result in results:
            mine = events_of(result, events, ctx.known_tenants)
            result.records = [{k: e.get(k) for k in _RECORD_FIELDS} for e in mine]
            result.billed = _sum(mine) if mine else None
            result.dead_letters = dead_letters_of(result, run.deadletter)
            if rows is not None and result.tenants and not result.other_tenants and mine:
                result.usage_rows = _sum([asdict(rows[t]) for t in result.tenants])
            result.tokens = list(
                await asyncio.gather(
                    *(tokens(str(e["tenant"]), str(e["request_id"])) for e in mine)
                )
            )
        if nan_task is not None:
            results.append(await nan_task)
        await asyncio.to_thread(_stop_process, proxy)
        text = proxy_log.read_text(errors="replace")
        run.proxy_summary = [line for line in text.splitlines() if line.startswith("proxy:")]
        for result in results:
            if result.key == "10":  # the whole log, once the proxy has stopped
                bearer, query_key = result.client.pop("_secrets")
                result.client["bearer_in_log"] = bearer in text
                result.client["key_in_log"] = query_key in text
            judge(result, run_id)
        run.cases = sorted(results, key=lambda r: _order(r.key))
    finally:
        await asyncio.to_thread(procs.stop_all)
        await upstream.stop()
    run.seconds = round(time.monotonic() - started, 1)
    return run


def measure(args: argparse.Namespace) -> Run:
    """One run in a log folder of its own (kept with ``--log-dir``)."""
    if args.log_dir:
        log_dir = Path(args.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        return asyncio.run(_measure(args, log_dir))
    log_dir = Path(tempfile.mkdtemp(prefix="st-tap-capture-"))
    try:
        return asyncio.run(_measure(args, log_dir))
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def report_lines(run: Run) -> Iterator[str]:
    yield (
        f"tap capture: {run.python} (checkout {run.checkout}, commit {run.commit}), "
        f"namespace {run.namespace}, {run.seconds:g} s"
        + (f", proxy args {' '.join(run.proxy_args)}" if run.proxy_args else "")
    )
    yield f"{'case':<15} {'what':<44} {'upstream in/out':>15} {'billed in/out':>15}  verdict"
    for case in run.cases:
        upstream = case.upstream.text() if case.upstream else "-"
        billed = case.billed.text() if case.billed else "-"
        yield (f"{case.key:<15} {case.title[:44]:<44} {upstream:>15} {billed:>15}  {case.verdict}")
    yield from run.proxy_summary
    yield from (f"note: {note}" for note in run.notes)


def _terminate(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt  # unwinds through every finally: the subprocesses are stopped


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--python", default=sys.executable, help="interpreter of the checkout under test"
    )
    parser.add_argument(
        "--proxy-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument of `streamtally proxy` (repeat; --proxy-arg=--opt for options)",
    )
    parser.add_argument(
        "--bootstrap-servers",
        default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"),
    )
    parser.add_argument(
        "--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument(
        "--record-timeout", type=float, default=15.0, help="seconds to wait for a case's records"
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=5.0,
        help="the worker's STREAMTALLY_REQUEST_TIMEOUT",
    )
    parser.add_argument(
        "--nan-option",
        default="--drain-seconds",
        help="the proxy option case 11 gives nan (default: --drain-seconds; --budget-ms for "
        "a checkout before the write-ahead spool)",
    )
    parser.add_argument("--cases", default="", help="only these case numbers, e.g. 1,2,5")
    parser.add_argument("--json", action="store_true", help="print the run as JSON")
    parser.add_argument("--json-file", help="also write the run as JSON to this file")
    parser.add_argument("--log-dir", help="keep the processes' logs here (default: removed)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        run = measure(args)
    except KeyboardInterrupt:
        raise SystemExit("tap capture: interrupted (its processes are stopped)") from None
    data = json.dumps(asdict(run), indent=2)
    if args.json_file:
        Path(args.json_file).write_text(data + "\n")
    print(data if args.json else "\n".join(report_lines(run)))


if __name__ == "__main__":
    main()
