"""`raise_limit_configs` (wire/kafka.py) with a fake admin: raise, keep, never lower, refused.

The broker side (a real AlterConfigs) is tests/integration/test_record_sizes.py.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from streamtally.errors import StackError
from streamtally.topics import RAW_MAX_MESSAGE_BYTES, Topics
from streamtally.wire.kafka import _topic_configs, raise_limit_configs

T = Topics.in_namespace("lim")
DYNAMIC, DEFAULT = 1, 5  # DescribeConfigs v1+ config sources


class Admin:
    """Answers DescribeConfigs with `configs` (name -> entries) or `codes`; keeps alters."""

    def __init__(self, configs: dict[str, list[Any]], codes: dict[str, int] | None = None):
        self.configs = configs
        self.codes = codes or {}
        self.altered: list[tuple[str, dict[str, str]]] = []
        self.alter_code = 0

    async def describe_configs(self, resources: list[Any]) -> list[Any]:
        rows = [
            (self.codes.get(r.name, 0), None, 2, r.name, self.configs.get(r.name, []))
            for r in resources
        ]
        return [SimpleNamespace(resources=rows)]

    async def alter_configs(self, resources: list[Any]) -> list[Any]:
        self.altered += [(r.name, dict(r.configs)) for r in resources]
        return [SimpleNamespace(resources=[(self.alter_code, None, 2, r.name) for r in resources])]


def entries(max_message_bytes: str, source: int) -> list[Any]:
    return [
        ("retention.ms", "604800000", False, DYNAMIC, False, []),
        ("segment.ms", "86400000", False, DYNAMIC, False, []),
        ("compression.type", "producer", False, DEFAULT, False, []),
        ("max.message.bytes", max_message_bytes, False, source, False, []),
    ]


async def test_a_lower_limit_is_raised_with_every_config_of_the_topic_kept() -> None:
    admin = Admin({T.raw_sse.name: entries("1048588", DEFAULT)})
    raised = await raise_limit_configs(admin, [T.raw_sse])  # type: ignore[arg-type]
    assert raised == [T.raw_sse.name]
    assert admin.altered == [
        (
            T.raw_sse.name,
            {
                "retention.ms": "604800000",
                "segment.ms": "86400000",
                "max.message.bytes": str(RAW_MAX_MESSAGE_BYTES),
            },
        )
    ]


async def test_an_equal_or_larger_limit_is_left_alone() -> None:
    admin = Admin(
        {
            T.raw_sse.name: entries(str(RAW_MAX_MESSAGE_BYTES), DYNAMIC),
            T.raw_engine.name: entries(str(RAW_MAX_MESSAGE_BYTES * 2), DYNAMIC),
        }
    )
    assert await raise_limit_configs(admin, list(T.raw)) == []  # type: ignore[arg-type]
    assert admin.altered == []
    # topics that declare no size are not even asked about
    assert await raise_limit_configs(admin, [T.billing]) == []  # type: ignore[arg-type]


async def test_a_principal_without_the_grant_gets_the_operators_command(
    caplog: pytest.LogCaptureFixture,
) -> None:
    admin = Admin({}, codes={T.raw_sse.name: 29})
    with caplog.at_level(logging.WARNING):
        assert await raise_limit_configs(admin, [T.raw_sse]) == []  # type: ignore[arg-type]
    assert "kafka-configs.sh" in caplog.text
    assert f"--entity-name {T.raw_sse.name}" in caplog.text
    assert f"max.message.bytes={RAW_MAX_MESSAGE_BYTES}" in caplog.text
    admin = Admin({T.raw_sse.name: entries("1048588", DEFAULT)})
    admin.alter_code = 29
    with caplog.at_level(logging.WARNING):
        assert await raise_limit_configs(admin, [T.raw_sse]) == []  # type: ignore[arg-type]
    admin = Admin({}, codes={T.raw_sse.name: 37})
    with pytest.raises(StackError, match="describing the configs"):
        await raise_limit_configs(admin, [T.raw_sse])  # type: ignore[arg-type]


def test_topic_configs_of_both_answers() -> None:
    v0 = [
        ("retention.ms", "1", False, False, False),
        ("cleanup.policy", "delete", False, True, False),
    ]
    assert _topic_configs(v0) == (None, {"retention.ms": "1"})
    v1 = [("max.message.bytes", "5", False, DYNAMIC, False, [])]
    assert _topic_configs(v1) == (5, {"max.message.bytes": "5"})
    with pytest.raises(StackError, match="hidden"):
        _topic_configs([("secret", None, False, DYNAMIC, True, [])])
