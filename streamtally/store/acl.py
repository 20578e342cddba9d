"""The Redis ACL of streamtally's worker: its keys and the commands it sends, nothing more.

A deployment gives the worker (and the read commands: ``tokens``, ``usage``,
``rebuild``) a Redis user limited to this rule, so that a leaked worker
password cannot read or write other applications' keys, flush the database,
change the configuration or run arbitrary scripts over other keys.
`worker_acl_rule` is the ``ACL SETUSER`` / ``user`` line's rule part;
``streamtally stack up --secure`` gives its Redis user exactly this rule.

The commands are those `RedisStore` sends (reads, pipelines, ``MULTI``/``EXEC``
of the usage read, the idempotent scripts through ``EVALSHA`` with a
``SCRIPT LOAD`` when Redis lost them) and those the scripts call: Redis checks
the commands a script calls against the caller's ACL too
(``tests/unit/stack/test_secure_stack_config.py`` checks every ``redis.call`` of
`streamtally.store.scripts` against this list).  Keys: every key of the layout
starts with ``st:`` (`streamtally.store.layout`).  ``streamtally migrate``
renames keys and needs ``RENAME`` on top: run it with an administrator's
account, once, with the workers stopped.
"""

from __future__ import annotations

from typing import Final

__all__ = ["WORKER_COMMANDS", "WORKER_KEY_PATTERN", "worker_acl_rule"]

#: Every key of streamtally's layout (`streamtally.store.layout`).
WORKER_KEY_PATTERN: Final = "st:*"

#: The commands the worker and the read commands send, the scripts' own calls included.
WORKER_COMMANDS: Final = (
    # the connection: redis-py's handshake (RESP3; its CLIENT SETINFO may be refused, it
    # goes on) and the readiness probe
    "ping",
    "hello",
    # scripts: EVALSHA, then SCRIPT LOAD when Redis lost it (redis-py's Script, and the
    # store's pipelines of several shards, which send no SCRIPT EXISTS)
    "evalsha",
    "script|load",
    # the usage read's transaction
    "multi",
    "exec",
    "discard",
    # strings
    "get",
    "set",
    "exists",
    "del",
    "expire",
    "type",
    "scan",
    # hashes
    "hget",
    "hmget",
    "hgetall",
    "hset",
    "hdel",
    "hexists",
    "hincrby",
    # sets
    "sadd",
    "srem",
    "smembers",
)


def worker_acl_rule() -> str:
    """The ACL rule of the worker's user: no channels, nothing but `WORKER_COMMANDS` on
    keys matching `WORKER_KEY_PATTERN` (``~st:* resetchannels -@all +ping ...``)."""
    commands = " ".join(f"+{command}" for command in WORKER_COMMANDS)
    return f"~{WORKER_KEY_PATTERN} resetchannels -@all {commands}"
