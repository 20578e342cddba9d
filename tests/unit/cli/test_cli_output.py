"""What the commands print for people escapes control characters; JSON output stays one line.

A tenant, model, request id, file name or reason comes from outside.  Printed
raw, a newline forges a row of a table, ``\\x1b[2J`` clears the terminal and a
bidi override reorders what the reader sees.  Each test puts such a value
through a command (with a fake Redis store, Kafka reader or producer where the
command needs one) and checks that it comes out escaped, on one line.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from streamtally.cli import main
from streamtally.core.identity import RequestRef

#: One of each kind of character that must not reach a terminal raw.
HOSTILE = "a\nb\rc\td\x1b[2Je\x00f\x7fg\x85h\x9bi\u2028j\u2029k\u202el\u2066m"
#: How `escape` writes it.
ESCAPED = "a\\nb\\rc\\td\\x1b[2Je\\x00f\\x7fg\\x85h\\x9bi\\u2028j\\u2029k\\u202el\\u2066m"
#: Characters no human-readable output may hold raw.
RAW = {chr(c) for c in [*range(0x20), *range(0x7F, 0xA0)]} - {"\n"}
RAW |= {"\u2028", "\u2029", *map(chr, range(0x202A, 0x202F)), *map(chr, range(0x2066, 0x206A))}
OPENAI_SSE = (
    b'data: {"id":"chatcmpl-1","model":"gpt-4.1","choices":[{"index":0,'
    b'"delta":{"content":"Hi"},"finish_reason":"stop"}]}\n\n'
    b"data: [DONE]\n\n"
)


def assert_clean(text: str) -> None:
    """`text` holds no raw control, separator or bidi character (line ends aside)."""
    found = sorted({f"U+{ord(c):04X}" for c in text if c in RAW})
    assert not found, (found, text)


# --------------------------------------------------------------------------- the helpers


def test_escape_writes_every_unsafe_character_visibly() -> None:
    from streamtally.cli._output import escape

    assert escape(HOSTILE) == ESCAPED
    assert escape(ESCAPED) == ESCAPED  # idempotent
    assert escape("\udcff") == "\\udcff"  # a lone surrogate (an undecodable argv byte)
    assert escape("plain text, ünïcödé, 漢字 — fine") == "plain text, ünïcödé, 漢字 — fine"


def test_json_text_is_one_line_and_parses_back() -> None:
    from streamtally.cli._output import json_text

    value = {"tenant": HOSTILE, "model": "\udcff", "text": "naïve — ok"}
    text = json_text(value)
    assert len(text.splitlines()) == 1  # str.splitlines splits at \x85, U+2028, U+2029 too
    assert_clean(text)
    assert "naïve — ok" in text  # ensure_ascii=False: UTF-8 text is kept as it is
    assert json.loads(text) == value


def test_format_table_escapes_cells_and_aligns() -> None:
    from streamtally.cli._output import format_table

    out = format_table(("NAME", "N"), [(HOSTILE, "1"), ("x", "22")], right={1})
    lines = out.splitlines()
    assert len(lines) == 3
    assert lines[1] == f"{ESCAPED}   1"
    assert lines[2] == "x".ljust(len(ESCAPED)) + "  22"


# --------------------------------------------------------------------------- usage


class FakeStore:
    """A `RedisStore` stand-in: the reads the commands make, with keys encoded like Redis's."""

    #: Stored Tokens texts by request reference text (``tenant:request_id``).
    texts: ClassVar[dict[str, str]] = {}
    rows: ClassVar[list[dict[str, Any]]] = []

    @classmethod
    def from_url(cls, url: str, **options: Any) -> FakeStore:
        return cls()

    async def tokens_text(self, ref: RequestRef) -> str | None:
        ref.text.encode("utf-8")  # what redis-py does with a key: strict UTF-8
        return self.texts.get(ref.text)

    async def tenants_of(self, request_id: str) -> list[str]:
        request_id.encode("utf-8")
        refs = (RequestRef.parse(text) for text in self.texts)
        return sorted(ref.tenant for ref in refs if ref.request_id == request_id)

    async def usage_rows(self, *, tenant: str | None = None, day: str | None = None) -> Any:
        return [r for r in self.rows if tenant is None or r["tenant"] == tenant]

    async def aclose(self) -> None:
        pass


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> type[FakeStore]:
    import streamtally.cli.tokens

    monkeypatch.setattr(streamtally.cli.tokens, "RedisStore", FakeStore)
    monkeypatch.setattr(FakeStore, "texts", {})
    monkeypatch.setattr(FakeStore, "rows", [])
    return FakeStore


def usage_row(tenant: str, model: str, requests: int = 1) -> dict[str, Any]:
    return {
        "day": "2026-01-02",
        "tenant": tenant,
        "model": model,
        "requests": requests,
        "input_tokens": 10,
        "cached_tokens": 0,
        "cache_write_tokens": 0,
        "output_tokens": 5,
        "reasoning_tokens": 0,
        "cost": "0.000100000000",
    }


def test_usage_table_cannot_be_forged_by_a_tenant_or_model(
    store: type[FakeStore], capsys: pytest.CaptureFixture[str]
) -> None:
    forged = "acme\n2026-01-02  victim  gpt-4.1  1000000"
    store.rows = [usage_row(forged, "\x1b[2Jgpt\u202e"), usage_row("globex", "gpt-4.1", 2)]
    assert main(["usage"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert_clean(out)
    lines = out.splitlines()
    # header, rule, 2 rows, rule, total: the tenant's newline made no row of its own
    assert len(lines) == 6, out
    assert lines[2].startswith("2026-01-02  acme\\n2026-01-02  victim  gpt-4.1  1000000  ")
    assert "\\x1b[2Jgpt\\u202e" in lines[2]
    assert lines[5].split()[:2] == ["TOTAL", "3"]


def test_usage_with_no_rows_escapes_the_filter(
    store: type[FakeStore], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["usage", "--tenant", "x\ny\x1b[2J"]) == 0
    out, _ = capsys.readouterr()
    assert out == "no usage recorded for tenant x\\ny\\x1b[2J\n"


def test_usage_json_keeps_every_value_and_no_raw_separator(
    store: type[FakeStore], capsys: pytest.CaptureFixture[str]
) -> None:
    store.rows = [usage_row(HOSTILE, "m\u2028")]
    assert main(["usage", "--json"]) == 0
    out, _ = capsys.readouterr()
    assert_clean(out)
    assert json.loads(out) == store.rows


# --------------------------------------------------------------------------- tokens get


def test_tokens_get_unknown_hostile_id_is_one_escaped_line(
    store: type[FakeStore], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["tokens", "get", "req\n\x1b[2Jforged"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert (
        err == "streamtally tokens: req\\n\\x1b[2Jforged not found (unknown, or still streaming)\n"
    )


def test_tokens_get_prints_stored_json_on_one_line(
    store: type[FakeStore], capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    stored = json.dumps({"request_id": "r1", "text": "x\u2028y\x85z\u202e"}, ensure_ascii=False)
    store.texts = {"acme:r1": stored}
    assert main(["tokens", "get", "r1"]) == 0
    out = capsysbinary.readouterr().out.decode("utf-8")
    assert out.count("\n") == 1
    assert len(out.splitlines()) == 1
    assert_clean(out)
    assert json.loads(out) == json.loads(stored)
    assert main(["tokens", "get", "r1", "--tenant", "acme"]) == 0
    assert json.loads(capsysbinary.readouterr().out) == json.loads(stored)


def test_tokens_get_of_an_id_two_tenants_used_asks_for_the_tenant(
    store: type[FakeStore], capsys: pytest.CaptureFixture[str]
) -> None:
    store.texts = {"acme:r1": '{"text":"a"}', "glo%3Abex:r1": '{"text":"g"}'}
    assert main(["tokens", "get", "r1"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        "streamtally tokens: r1 is a request of 2 tenants (acme, glo:bex): pass --tenant\n"
    )
    assert main(["tokens", "get", "r1", "--tenant", "glo:bex"]) == 0
    assert json.loads(capsys.readouterr().out) == {"text": "g"}
    assert main(["tokens", "get", "r1", "--tenant", "initech\n"]) == 2
    assert capsys.readouterr().err == (
        "streamtally tokens: r1 of tenant initech\\n not found (unknown, or still streaming)\n"
    )


# --------------------------------------------------------------------------- billing, deadletter


def billing_event(tenant: str, model: str | None, request_id: str) -> Any:
    return SimpleNamespace(
        event_time=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        tenant=tenant,
        model=model,
        request_id=request_id,
        revision=0,
        input_tokens=10,
        output_tokens=5,
        cost=Decimal("0.0001"),
        currency="USD",
    )


def test_billing_table_escapes_tenant_model_and_request_id() -> None:
    from streamtally.cli.billing import format_table

    out = format_table(
        [billing_event("acme\nforged", "\x1b[31mred", "r\u2028x"), billing_event("b", None, "r2")]
    )
    assert_clean(out)
    lines = out.splitlines()
    assert len(lines) == 4, out  # header, two events, the count
    assert "acme\\nforged" in lines[1]
    assert "\\x1b[31mred" in lines[1]
    assert "r\\u2028x" in lines[1]
    assert lines[-1] == "2 billing events"


def dead_letter(reason: str, request_id: str | None, source: str | None) -> Any:
    return SimpleNamespace(
        topic="st.raw.sse",
        partition=0,
        offset=7,
        key=b"k",
        value=b"v" * 3,
        reason=reason,
        error_type="InputError",
        source=source,
        request_id=request_id,
        dead_lettered_at=datetime(2026, 1, 2, tzinfo=UTC),
    )


def test_deadletter_report_escapes_reasons_and_ids() -> None:
    from streamtally.cli.deadletter import Letters, format_report

    letters = Letters("st.deadletter")
    letter = dead_letter("bad\nevent\x1b[2J: \u202eevil", "req\nforged", "openai\x07")
    letters.letters.append(letter)
    letters.copies[(letter.topic, letter.partition, letter.offset)] = 1
    out = format_report(letters, last=10)
    assert_clean(out)
    lines = out.splitlines()
    # count table (header, row), total, blank, "last 1:", last table (header, row)
    assert len(lines) == 7, out
    assert "bad\\nevent\\x1b[2J: \\u202eevil" in lines[1]
    assert "req\\nforged" in lines[6]
    assert "openai\\x07" in lines[6]


# --------------------------------------------------------------------------- rebuild, demo


def test_rebuild_summary_escapes_skipped_ids_and_details() -> None:
    from streamtally.cli.rebuild import _summary_text
    from streamtally.ops.rebuild import Applied, Plan, Skipped, SkipReason

    skipped = [Skipped("r\n  skipped victim: forged", SkipReason.NO_BILLING, "detail\x1b[2J")]
    out = _summary_text(Plan(), Applied(applied=1), skipped)
    assert_clean(out)
    assert (
        "  skipped r\\n  skipped victim: forged: tokens without billing event: detail\\x1b[2J\n"
        in (out)
    )
    assert not any(line.startswith("  skipped victim") for line in out.splitlines())


def test_demo_steps_are_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    from streamtally.cli import demo

    demo._step("streamtally tokens get r1\n==> done\x1b[2J")
    assert capsys.readouterr().err == "==> streamtally tokens get r1\\n==> done\\x1b[2J\n"


# --------------------------------------------------------------------------- produce


class FakeProducer:
    """`RawProducer` without Kafka: what was sent, per request id."""

    sent: ClassVar[dict[str, list[bytes]]] = {}

    def __init__(self, servers: str, *, namespace: str = "streamtally", **_: Any) -> None:
        self.namespace = namespace

    async def __aenter__(self) -> FakeProducer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    async def send_records(self, source: Any, request_id: str, records: list[bytes]) -> None:
        self.sent.setdefault(request_id, []).extend(records)

    async def send_transcript(self, source: Any, data: bytes, **options: Any) -> Any:
        from streamtally.producers import SentRequest, raw_records

        request_id, records = raw_records(source, data, **options)
        await self.send_records(source, request_id, records)
        return SentRequest(request_id, options["tenant"], source, len(records) - 1)


@pytest.fixture
def producer(monkeypatch: pytest.MonkeyPatch) -> type[FakeProducer]:
    import streamtally.cli.produce

    async def ensure_topics(servers: str, topics: Sequence[Any]) -> list[str]:
        return []

    monkeypatch.setattr(streamtally.cli.produce, "RawProducer", FakeProducer)
    monkeypatch.setattr(streamtally.cli.produce, "ensure_topics", ensure_topics)
    monkeypatch.setattr(FakeProducer, "sent", {})
    return FakeProducer


def test_produce_progress_lines_are_escaped(
    tmp_path: Path, producer: type[FakeProducer], capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "chat\x1b[2J.sse"
    path.write_bytes(OPENAI_SSE)
    tenant = "acme\n[2/2] forged: 0 events"
    assert main(["produce", "--source", "openai", "--tenant", tenant, str(path)]) == 0
    out, err = capsys.readouterr()
    assert out == ""
    assert_clean(err)
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith("[1/1] chatcmpl-1: 2 events (openai, tenant acme\\n[2/2] forged")
    assert lines[0].endswith("chat\\x1b[2J.sse")
    assert list(producer.sent) == ["chatcmpl-1"]


# --------------------------------------------------------------------------- error messages


def test_an_error_quoting_input_is_one_escaped_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "x\nstreamtally fold: forged\x1b[2J.sse"
    assert main(["fold", "--source", "openai", str(missing)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("streamtally fold: cannot read ")
    assert "x\\nstreamtally fold: forged\\x1b[2J.sse" in err


def test_a_usage_error_is_one_escaped_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["usage", "--day", "2026-13-01\n\x1b[2J"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert_clean(err)
    assert err.startswith("streamtally usage: argument --day: ")


def test_fold_json_output_is_one_line_whatever_the_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = OPENAI_SSE.replace(b'"Hi"', '"H\u2028i\u0085\u202e"'.encode())
    path = tmp_path / "sep.sse"
    path.write_bytes(data)
    assert main(["fold", "--source", "openai", str(path)]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 1
    assert_clean(out)
    assert json.loads(out)["text"] == "H\u2028i\u0085\u202e"


@pytest.mark.parametrize("rows", [[], [("a", "1")]])
def test_format_table_shapes(rows: list[tuple[str, str]]) -> None:
    from streamtally.cli._output import format_table

    out = format_table(("K", "V"), rows, footer=[("T", "9")], ruled=True)
    assert out.splitlines()[0] == "K  V"
    assert out.splitlines()[1] == "-  -"
    assert out.splitlines()[-1] == "T  9"


def test_records_that_do_not_decode_are_reported_in_one_escaped_line_each(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import streamtally.cli.billing
    import streamtally.cli.deadletter
    from streamtally.cli.billing import Export
    from streamtally.cli.deadletter import Letters

    reason = "bad marker\nstreamtally billing: forged\x1b[2J"

    async def billing_events(servers: str, topic: str, **_: Any) -> Export:
        return Export(bad=[(3, 41, reason)])

    async def dead_letters(servers: str, topic: str) -> Letters:
        return Letters(topic, bad=[(0, 7, reason)])

    monkeypatch.setattr(streamtally.cli.billing, "read_billing_events", billing_events)
    monkeypatch.setattr(streamtally.cli.deadletter, "read_dead_letters", dead_letters)
    monkeypatch.delenv("STREAMTALLY_NAMESPACE", raising=False)
    assert main(["billing", "export"]) == 1
    out, err = capsys.readouterr()
    assert out == "0 billing events\n"
    assert err == (
        "streamtally billing: streamtally.billing[3]@41 is not a billing event: "
        "bad marker\\nstreamtally billing: forged\\x1b[2J\n"
    )
    assert main(["deadletter"]) == 1
    out, err = capsys.readouterr()
    assert out == "0 dead letters on streamtally.deadletter\n"
    assert err == (
        "streamtally deadletter: streamtally.deadletter[0]@7 is not a dead letter: "
        "bad marker\\nstreamtally billing: forged\\x1b[2J\n"
    )
