"""`streamtally produce` checks every file before anything is sent.

An SSE file must be one `streamtally fold` takes whole (every event valid for
its source, no text that is not SSE, some content), unless ``--allow-invalid``;
no event may make a record larger than the worker takes (4 MiB).  A bad file
is named with the event or line at fault, and nothing at all is sent.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamtally.cli import main
from streamtally.core.models import Source
from streamtally.errors import InputError, InvalidEvent, NotAStream
from streamtally.producers import raw_records
from streamtally.wire import avro
from tests.unit.cli.test_cli_output import OPENAI_SSE, FakeProducer, producer

__all__ = ["producer"]  # the fixture, imported

REPO = Path(__file__).resolve().parents[3]
SAMPLES = REPO / "samples"
#: An Anthropic event: valid SSE, not a valid OpenAI chunk.
FOREIGN_EVENT = (
    b"event: message_start\n"
    b'data: {"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant",'
    b'"model":"claude-x","content":[],"usage":{"input_tokens":4,"output_tokens":1}}}\n\n'
)
#: The OpenAI stream with the foreign event as its second event.
WITH_FOREIGN_EVENT = OPENAI_SSE.replace(b"data: [DONE]", FOREIGN_EVENT + b"data: [DONE]")
WITH_NON_SSE_LINE = b"HTTP/1.1 502 Bad Gateway\n" + OPENAI_SSE


def produce(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["produce", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    assert err.endswith("\n"), err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def write(tmp_path: Path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def test_an_invalid_sse_event_is_refused_with_file_event_and_reason(
    tmp_path: Path, producer: type[FakeProducer], capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "chat.sse", WITH_FOREIGN_EVENT)
    code, _, err = produce(capsys, "--source", "openai", path)
    assert code == 2
    one_line(err)
    assert err.startswith(f"streamtally produce: {path} (openai): event 2 is not a valid openai ")
    assert "not an OpenAI-compatible chat completion chunk" in err
    assert err.rstrip().endswith("nothing was sent")
    assert producer.sent == {}


def test_allow_invalid_sends_the_bad_stream_as_it_is(
    tmp_path: Path, producer: type[FakeProducer], capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "chat.sse", WITH_FOREIGN_EVENT + b"not sse at all\n")
    code, _, err = produce(capsys, "--source", "openai", "--allow-invalid", path)
    assert code == 0, err
    (records,) = producer.sent.values()
    events = [avro.decode_raw_sse_event(r) for r in records]
    assert [e.event for e in events[:3]] == ["message", "message_start", "message"]
    assert len(events) == 4  # three events and the END marker


def test_text_that_is_not_sse_is_refused_with_its_line(
    tmp_path: Path, producer: type[FakeProducer], capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "proxy.sse", WITH_NON_SSE_LINE)
    code, _, err = produce(capsys, "--source", "openai", path)
    assert code == 2
    one_line(err)
    assert f"{path} (openai): line 1 is not SSE: 'HTTP/1.1 502 Bad Gateway'" in err
    assert producer.sent == {}


def test_geminis_documented_raw_json_error_tail_is_allowed(
    producer: type[FakeProducer], capsys: pytest.CaptureFixture[str]
) -> None:
    path = SAMPLES / "gemini" / "error_raw_json_tail.sse"
    code, _, err = produce(capsys, "--source", "gemini", str(path))
    assert code == 0, err
    assert len(producer.sent) == 1


def test_a_file_with_no_content_is_refused(
    tmp_path: Path, producer: type[FakeProducer], capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "empty.sse", b"")
    code, _, err = produce(capsys, "--source", "anthropic", path)
    assert code == 2
    one_line(err)
    assert "no anthropic content in 0 SSE events" in err
    assert producer.sent == {}


@pytest.mark.parametrize("size_mib", [5, 9])
def test_an_event_larger_than_a_raw_record_is_refused_before_anything_is_sent(
    size_mib: int,
    tmp_path: Path,
    producer: type[FakeProducer],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Over 8 MiB Kafka refuses the request (a traceback before); over 4 MiB the worker would
    dead-letter it: either way the producer refuses it, naming the file and the event."""
    text = "x" * (size_mib << 20)
    huge = (
        f'data: {{"id":"chatcmpl-1","choices":[{{"index":0,"delta":{{"content":"{text}"}}}}]}}\n\n'
    )
    good = write(tmp_path, "good.sse", OPENAI_SSE)
    big = write(tmp_path, "big.sse", OPENAI_SSE.replace(b"data: [DONE]", huge.encode()))
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(
        "".join(
            json.dumps({"file": f, "source": "openai", "request_id": f"r{i}", "tenant": "t"}) + "\n"
            for i, f in enumerate((good, big))
        )
    )
    code, _, err = produce(capsys, "--manifest", str(manifest))
    assert code == 2
    one_line(err)
    assert f"{big} (openai): event 2 makes a record of " in err
    assert "more than the 4194304 bytes a raw record may have; nothing was sent" in err
    assert producer.sent == {}  # not even the good file before it


def test_a_manifest_with_one_bad_file_sends_nothing(
    tmp_path: Path, producer: type[FakeProducer], capsys: pytest.CaptureFixture[str]
) -> None:
    good = write(tmp_path, "good.sse", OPENAI_SSE)
    bad = write(tmp_path, "bad.sse", WITH_FOREIGN_EVENT)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(
        json.dumps({"file": "good.sse", "source": "openai", "request_id": "r1"})
        + "\n"
        + json.dumps({"file": "bad.sse", "source": "openai", "request_id": "r2"})
        + "\n"
    )
    code, _, err = produce(capsys, "--manifest", str(manifest))
    assert code == 2
    one_line(err)
    assert f"{bad} (openai): event 2 is not a valid openai event" in err
    assert producer.sent == {}
    assert good.endswith("good.sse")
    code, _, err = produce(capsys, "--manifest", str(manifest), "--allow-invalid")
    assert code == 0, err
    assert sorted(producer.sent) == ["r1", "r2"]


def test_an_invalid_engine_line_is_refused_even_with_allow_invalid(
    tmp_path: Path, producer: type[FakeProducer], capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "d.jsonl", b'{"token_ids":[1],"text":"a"}\n\n{"token_ids":"x"}\n')
    code, _, err = produce(capsys, "--source", "dynamo", "--allow-invalid", path)
    assert code == 2
    one_line(err)
    assert f"{path} (dynamo): event 2 is not a valid dynamo output" in err
    assert producer.sent == {}


@pytest.mark.parametrize(
    ("row", "why"),
    [
        ("[1, 2]", "a line is a JSON object"),
        ('{"source": "openai"}', '"file" must be a file name'),
        ('{"file": 5, "source": "openai"}', '"file" must be a file name'),
        ('{"file": "a.sse", "source": "bedrock"}', '"source" must be one of openai'),
        ('{"file": "a.sse", "source": "openai", "request_id": 7}', '"request_id" must be a'),
        ('{"file": "a.sse", "source": "openai", "tenant": ["t"]}', '"tenant" must be a'),
        ('{"file": "a.sse", "source": "openai", "tenant": "\\udcff"}', '"tenant" must be a'),
        ('{"file": "a.sse", "source": "vllm", "model": {}}', '"model" must be a'),
        ("{not json", "not a manifest line (Expecting property name"),
        ("[" * 100_000, "not a manifest line"),
    ],
)
def test_a_bad_manifest_line_is_named(
    row: str,
    why: str,
    tmp_path: Path,
    producer: type[FakeProducer],
    capsys: pytest.CaptureFixture[str],
) -> None:
    write(tmp_path, "a.sse", OPENAI_SSE)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"file": "a.sse", "source": "openai"}) + "\n\n" + row + "\n")
    code, _, err = produce(capsys, "--manifest", str(manifest))
    assert code == 2
    one_line(err)
    assert err.startswith(f"streamtally produce: {manifest}:3: ")
    assert why in err
    assert producer.sent == {}


def test_a_manifest_that_is_not_utf8_is_named_with_its_line(
    tmp_path: Path, producer: type[FakeProducer], capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_bytes(b'{"file": "a.sse", "source": "openai"}\n{"file": "\xff.sse"}\n')
    code, _, err = produce(capsys, "--manifest", str(manifest))
    assert code == 2
    assert (
        one_line(err)
        == f"streamtally produce: {manifest}:2: not UTF-8 text (byte 11 of the line)\n"
    )


# --------------------------------------------------------------------------- the library


def test_raw_records_keeps_its_lenient_default_and_checks_on_request() -> None:
    """The tests and the benchmark feed bad streams through `raw_records` on purpose."""
    rid, records = raw_records(Source.OPENAI, WITH_FOREIGN_EVENT, tenant="t")
    assert (rid, len(records)) == ("chatcmpl-1", 4)
    with pytest.raises(InvalidEvent, match="event 2 is not a valid openai event"):
        raw_records(Source.OPENAI, WITH_FOREIGN_EVENT, tenant="t", strict=True)
    with pytest.raises(InvalidEvent, match="line 1 is not SSE"):
        raw_records(Source.OPENAI, WITH_NON_SSE_LINE, tenant="t", strict=True)
    with pytest.raises(NotAStream):
        raw_records(Source.OPENAI, b"data: [DONE]\n\n", tenant="t", strict=True)
    rid, records = raw_records(Source.OPENAI, OPENAI_SSE, tenant="t", strict=True)
    assert (rid, len(records)) == ("chatcmpl-1", 3)
    with pytest.raises(InputError, match="event 1 makes a record of"):
        raw_records(Source.OPENAI, OPENAI_SSE, tenant="t", max_record_bytes=100)
    assert len(raw_records(Source.OPENAI, OPENAI_SSE, tenant="t", max_record_bytes=4096)[1]) == 3
