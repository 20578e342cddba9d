"""A hostile tenant cannot close, pre-empt or bill another tenant's request.

A request is (tenant, request id) everywhere it is keyed.  Before, it was the
request id alone: a tenant sending records with a victim's request id either
opened the request first (the victim's records were then dead-lettered as a
"tenant change" and the victim was never billed), closed it early with an end
marker, or, after the victim's close, had its own records dead-lettered as
late ones of the victim's request.
"""

from __future__ import annotations

from streamtally.billing.events import event_id
from streamtally.billing.pricing import PriceTable
from streamtally.core.identity import RequestRef
from streamtally.core.models import Source
from streamtally.processors.commits import CommitGate
from streamtally.processors.requests import Counters, Outputs, Position, RequestProcessor
from streamtally.producers import raw_records
from streamtally.topics import Topics, encode_key

TOPIC = Topics.in_namespace().raw_sse.name
VICTIM_ID = "chatcmpl-victim"
#: The victim's stream: "Hello there", 30 prompt tokens, 2 completion tokens.
VICTIM = (
    b'data: {"id":"c","object":"chat.completion.chunk","model":"gpt-4o","choices":[{"index":0,'
    b'"delta":{"content":"Hello"},"finish_reason":null}]}\n\n'
    b'data: {"id":"c","object":"chat.completion.chunk","model":"gpt-4o","choices":[{"index":0,'
    b'"delta":{"content":" there"},"finish_reason":"stop"}],"usage":{"prompt_tokens":30,'
    b'"completion_tokens":2}}\n\n'
)
#: What the attacker sends under the victim's id: 1 prompt token, 1 completion token.
ATTACK = (
    b'data: {"id":"c","object":"chat.completion.chunk","model":"gpt-4o","choices":[{"index":0,'
    b'"delta":{"content":"x"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,'
    b'"completion_tokens":1}}\n\n'
)


def _records(stream: bytes, tenant: str) -> list[bytes]:
    return raw_records(Source.OPENAI, stream, tenant=tenant, request_id=VICTIM_ID)[1]


class Feed:
    """One processor fed records of the victim's id at consecutive offsets of one partition."""

    def __init__(self, timeout: float = 60.0) -> None:
        self.now = 0.0
        self.processor = RequestProcessor(PriceTable.default(), timeout=timeout, clock=self.clock)
        self.out = Outputs()
        self.offset = 0

    def clock(self) -> float:
        return self.now

    def send(self, *values: bytes) -> None:
        for value in values:
            at = Position(TOPIC, 0, self.offset, 1_790_000_000.0 + self.offset)
            self.processor.handle_sse(encode_key(VICTIM_ID), value, at, self.out)
            self.offset += 1

    def billed(self) -> dict[str, tuple[int, int, str]]:
        """Per tenant billed: (input tokens, output tokens, text)."""
        found: dict[str, tuple[int, int, str]] = {}
        for done in self.out.completed:
            assert done.billing.tenant not in found, "billed twice"
            found[done.billing.tenant] = (
                done.billing.input_tokens,
                done.billing.output_tokens,
                done.tokens.text,
            )
        return found


def _reconciles(c: Counters) -> bool:
    return c.received == c.applied + c.duplicates + c.dead_lettered + c.replayed


def test_a_tenant_sending_the_victims_id_first_does_not_pre_empt_it() -> None:
    feed = Feed()
    feed.send(*_records(ATTACK, "mallory"))  # a whole request, before the victim's
    feed.send(*_records(VICTIM, "acme"))
    assert feed.out.dead_letters == []
    assert feed.billed() == {"mallory": (1, 1, "x"), "acme": (30, 2, "Hello there")}
    assert _reconciles(feed.processor.counters)


def test_a_tenant_interleaving_records_of_the_victims_id_spoils_nothing() -> None:
    victim, attack = _records(VICTIM, "acme"), _records(ATTACK, "mallory")
    feed = Feed()
    feed.send(victim[0], attack[0], victim[1], attack[1], victim[2])  # attack[1]: its END
    assert feed.out.dead_letters == []
    assert feed.billed() == {"mallory": (1, 1, "x"), "acme": (30, 2, "Hello there")}


def test_an_end_marker_of_another_tenant_does_not_close_the_victims_request() -> None:
    victim = _records(VICTIM, "acme")
    attacker_end = _records(ATTACK, "mallory")[-1]  # END with seq 1: waits for seq 0
    feed = Feed(timeout=60.0)
    feed.send(victim[0], attacker_end)
    assert feed.out.completed == []  # nothing closed: the victim's request is still open
    assert feed.processor.is_open(RequestRef("acme", VICTIM_ID))
    feed.send(victim[1], victim[2])
    assert feed.billed() == {"acme": (30, 2, "Hello there")}
    # The attacker's own half-request closes on its own clock, billed to the attacker
    # with what it reported (nothing): it never touches the victim's bill.
    feed.now += 61.0
    feed.out.extend(feed.processor.expire())
    assert feed.billed() == {"acme": (30, 2, "Hello there"), "mallory": (0, 0, "")}
    assert _reconciles(feed.processor.counters)


def test_records_of_the_victims_id_after_its_close_are_the_senders_own_request() -> None:
    feed = Feed()
    feed.send(*_records(VICTIM, "acme"))
    feed.send(*_records(ATTACK, "mallory"))
    assert feed.out.dead_letters == []  # not "late events of the victim's request"
    assert feed.billed() == {"acme": (30, 2, "Hello there"), "mallory": (1, 1, "x")}


def test_each_tenants_request_has_its_own_billing_event_id_and_output_key() -> None:
    feed = Feed()
    feed.send(*_records(VICTIM, "acme"))
    feed.send(*_records(ATTACK, "mallory"))
    ids = {done.billing.tenant: done.billing.event_id for done in feed.out.completed}
    assert ids == {"acme": event_id("acme", VICTIM_ID), "mallory": event_id("mallory", VICTIM_ID)}
    assert len(set(ids.values())) == 2
    refs = {done.ref for done in feed.out.completed}
    assert refs == {RequestRef("acme", VICTIM_ID), RequestRef("mallory", VICTIM_ID)}
    assert set(feed.out.chunk_refs) == refs


def test_the_commit_gate_holds_a_record_until_its_own_tenants_request_closes() -> None:
    gate = CommitGate()
    acme, mallory = RequestRef("acme", VICTIM_ID), RequestRef("mallory", VICTIM_ID)
    gate.hold("p0", 0, acme)
    gate.hold("p0", 1, mallory)
    gate.finished([mallory])  # the attacker's request closing frees only its own record
    assert gate.release() == {}
    gate.finished([acme])
    assert gate.release() == {"p0": 2}
