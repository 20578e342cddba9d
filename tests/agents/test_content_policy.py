"""Agent tier: the worker's content policy (STREAMTALLY_CONTENT, STREAMTALLY_CHUNKS), driven
with `test_context()`.

One batch, as `RawSource` hands it over: a request whose text, reasoning and
tool arguments carry a distinctive phrase, then a late copy of its first
record (dead-lettered with its bytes) and an event whose malformed field
quotes the phrase (dead-lettered with a reason that quotes it).  Under
``full`` the phrase is in the outputs; under ``redacted`` and ``none`` it is
in none of them (Tokens for Redis and the tokens topic, chunks, dead letters),
and the billing events are the same bytes.  With the chunks topic off, no
chunk leaves the agent.
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import UTC, datetime
from pathlib import Path

import faust
import pytest

from streamtally.core.content import REDACTED_PREFIX, REMOVED_PREFIX
from streamtally.core.models import Source
from streamtally.errors import InputError
from streamtally.processors.app import Pipeline, create_app
from streamtally.processors.requests import Outputs
from streamtally.processors.sinks import Sinks
from streamtally.processors.source import RawMessage
from streamtally.producers import raw_records
from streamtally.settings import Settings
from streamtally.topics import Topics
from streamtally.wire import avro

TOPICS = Topics.in_namespace()
T0 = datetime(2026, 11, 24, 9, 0, tzinfo=UTC)
PHRASE = "okapi lantern 5521"
KEY = bytes(range(7, 39))


def _event(body: str) -> bytes:
    return b"data: " + body.encode() + b"\n\n"


def _head(delta: str, finish: str = "null") -> str:
    return (
        '{"id":"chatcmpl-cp","object":"chat.completion.chunk","model":"gpt-4o",'
        f'"choices":[{{"index":0,"delta":{delta},"finish_reason":{finish}}}]}}'
    )


TRANSCRIPT = (
    _event(_head(f'{{"role":"assistant","reasoning_content":"thinking of the {PHRASE}"}}'))
    + _event(_head(f'{{"content":"The {PHRASE} is lit."}}'))
    + _event(
        _head(
            '{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":'
            f'{{"name":"find","arguments":"{{\\"q\\":\\"{PHRASE}\\"}}"}}}}]}}'
        )
    )
    + _event(_head("{}", '"tool_calls"'))
    + _event(
        '{"id":"chatcmpl-cp","object":"chat.completion.chunk","model":"gpt-4o","choices":[],'
        '"usage":{"prompt_tokens":31,"completion_tokens":12,"total_tokens":43}}'
    )
    + b"data: [DONE]\n\n"
)
#: An event whose choice index is the phrase: refused with a reason that quotes it.
MALFORMED = _event(
    '{"id":"chatcmpl-bad","object":"chat.completion.chunk","model":"gpt-4o",'
    f'"choices":[{{"index":"{PHRASE}","delta":{{"content":"x"}}}}]}}'
)


class RecordingSink:
    def __init__(self) -> None:
        self.outputs = Outputs()

    async def begin(self, outputs: Outputs) -> None:
        return None

    def add(self, outputs: Outputs) -> None:
        self.outputs.extend(outputs)

    async def flush(self) -> None:
        return None


def _settings(tmp_path: Path, content: str, *, chunks: bool = True) -> Settings:
    key = tmp_path / "content.key"
    key.write_text(KEY.hex())
    return Settings(
        kafka_bootstrap_servers="127.0.0.1:1",  # never contacted: test_context() needs no broker
        redis_url_setting="redis://127.0.0.1:1/0",
        state_dir_setting=tmp_path,
        content=content,
        content_key_path=key,
        chunks_topic=chunks,
    )


def _batch() -> tuple[RawMessage, ...]:
    _, records = raw_records(
        Source.OPENAI, TRANSCRIPT, tenant="acme", request_id="req-cp", clock=lambda: T0
    )
    _, bad = raw_records(
        Source.OPENAI, MALFORMED, tenant="acme", request_id="req-bad", clock=lambda: T0
    )
    keyed = [(b"req-cp", v) for v in records] + [(b"req-cp", records[0]), (b"req-bad", bad[0])]
    return tuple(
        RawMessage(TOPICS.raw_sse.name, 0, offset, 1_790_000_000.0, key, value, ())
        for offset, (key, value) in enumerate(keyed)
    )


async def _outputs(tmp_path: Path, content: str, *, chunks: bool = True) -> Outputs:
    recording = RecordingSink()

    def make_sinks(app: faust.App) -> Sinks:
        return Sinks(recording)

    folder = tmp_path / f"{content}-{chunks}"
    folder.mkdir()
    pipeline: Pipeline = create_app(
        _settings(folder, content, chunks=chunks), make_sinks, consume=False
    )
    async with pipeline.agents["process-raw"].test_context() as agent:
        await agent.put(_batch())
    return recording.outputs


def _written(out: Outputs) -> list[bytes]:
    """Every byte string the sinks would write, Redis's Tokens JSON included."""
    values = [*out.chunk_values]
    for done in out.completed:
        values += [done.tokens_value, done.billing_value, done.tokens.model_dump_json().encode()]
    for letter in out.dead_letters:
        values += [avro.encode_dead_letter(letter), letter.reason.encode()]
    return values


def _mac(text: str) -> str:
    return hmac.new(KEY, text.encode(), hashlib.sha256).hexdigest()


async def test_each_policy_keeps_what_it_says_and_bills_the_same(tmp_path: Path) -> None:
    full = await _outputs(tmp_path, "full")
    redacted = await _outputs(tmp_path, "redacted")
    removed = await _outputs(tmp_path, "none")
    phrase = PHRASE.encode()

    # full: the phrase is everywhere the worker writes (the search below can find it)
    assert any(phrase in value for value in _written(full))
    (done,) = full.completed
    assert done.tokens.text == f"The {PHRASE} is lit."
    assert done.tokens.reasoning == f"thinking of the {PHRASE}"
    assert done.tokens.tool_calls[0].arguments == f'{{"q":"{PHRASE}"}}'

    for out in (redacted, removed):
        assert not any(phrase in value for value in _written(out))
        assert len(out.chunks) == len(full.chunks)
        assert [d.billing_value for d in out.completed] == [d.billing_value for d in full.completed]
        assert [d.tokens.usage for d in out.completed] == [done.tokens.usage]
        assert len(out.dead_letters) == len(full.dead_letters) == 2

    (red,) = redacted.completed
    assert red.tokens.text == f"{REDACTED_PREFIX}30:{_mac(done.tokens.text)}"
    assert red.tokens.reasoning == f"{REDACTED_PREFIX}34:{_mac(done.tokens.reasoning)}"
    assert red.tokens.tool_calls[0].arguments == (
        f"{REDACTED_PREFIX}26:{_mac(done.tokens.tool_calls[0].arguments)}"
    )
    assert red.tokens.tool_calls[0].name == "find"
    assert avro.decode_tokens(red.tokens_value) == red.tokens

    (gone,) = removed.completed
    assert (gone.tokens.text, gone.tokens.reasoning, gone.tokens.tool_calls[0].arguments) == (
        f"{REMOVED_PREFIX}30",
        f"{REMOVED_PREFIX}34",
        f"{REMOVED_PREFIX}26",
    )
    late_full, bad_full = full.dead_letters
    late, bad = removed.dead_letters
    assert late.value == f"{REMOVED_PREFIX}{len(late_full.value)}".encode()
    assert (late.reason, late.key, late.request_id) == (
        late_full.reason,
        late_full.key,
        late_full.request_id,
    )
    assert PHRASE in bad_full.reason
    assert bad.reason == bad_full.reason.replace(f"'{PHRASE}'", f"'{REMOVED_PREFIX}18'")


async def test_with_the_chunks_topic_off_no_chunk_leaves_the_agent(tmp_path: Path) -> None:
    on = await _outputs(tmp_path, "none")
    off = await _outputs(tmp_path, "none", chunks=False)
    assert on.chunks
    assert (off.chunks, off.chunk_values) == ([], [])
    assert [d.tokens_value for d in off.completed] == [d.tokens_value for d in on.completed]
    assert [d.billing_value for d in off.completed] == [d.billing_value for d in on.completed]


def test_redacted_with_an_unreadable_key_stops_the_worker_with_one_line(tmp_path: Path) -> None:
    settings = _settings(tmp_path, "redacted").model_copy(
        update={"content_key_path": tmp_path / "absent.key"}
    )
    with pytest.raises(InputError, match="cannot read the content key file"):
        create_app(settings, consume=False)


def test_a_short_key_is_refused_without_quoting_it(tmp_path: Path) -> None:
    settings = _settings(tmp_path, "redacted")
    assert settings.content_key_path is not None
    settings.content_key_path.write_text("00" * 16)
    with pytest.raises(InputError, match="fewer than 32") as refused:
        create_app(settings, consume=False)
    assert "00" * 16 not in str(refused.value)
