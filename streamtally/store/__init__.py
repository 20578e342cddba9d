"""The Redis store: its key layout, its scripts and its reads, in one place.

- `streamtally.store.layout`: every key, set member and stored text (the layout table);
- `streamtally.store.layout_v2`: the keys of layout 2, frozen, for the migration;
- `streamtally.store.scripts`: the Lua scripts and their KEYS/ARGV (`FinishedRequest`);
- `streamtally.store.rows`: usage rows decoded as the read commands print them;
- `streamtally.store.redis_store`: `RedisStore`, every write and read as a typed method;
- `streamtally.store.batch`: `RedisBatch`, the batching, atomic, idempotent write of
  finished requests;
- `streamtally.store.acl`: the Redis ACL rule of the worker's user (its keys and commands).

Nothing outside this package spells a Redis key.
"""

from streamtally.store.batch import RedisBatch, amended_request, finished_request
from streamtally.store.layout import (
    COST_FIELDS,
    LAYOUT_KEY,
    LAYOUT_VERSION,
    MIGRATING,
    RAW_RECORD_STATS,
    ROW_FIELDS,
    SHARDS,
    STATS_FIELDS,
    UNKNOWN_MODEL,
    UNPRICED_FIELD,
    closed_key,
    day_of,
    parse_tokens_key,
    position_of,
    row_member,
    shard_of,
    tokens_json,
    tokens_key,
    tokens_pattern,
    usage_key,
)
from streamtally.store.redis_store import LayoutError, RedisClient, RedisStore
from streamtally.store.scripts import (
    DEAD_LETTER_SCRIPT,
    FLUSH_SCRIPT,
    FinishedRequest,
)

__all__ = [
    "COST_FIELDS",
    "DEAD_LETTER_SCRIPT",
    "FLUSH_SCRIPT",
    "LAYOUT_KEY",
    "LAYOUT_VERSION",
    "MIGRATING",
    "RAW_RECORD_STATS",
    "ROW_FIELDS",
    "SHARDS",
    "STATS_FIELDS",
    "UNKNOWN_MODEL",
    "UNPRICED_FIELD",
    "FinishedRequest",
    "LayoutError",
    "RedisBatch",
    "RedisClient",
    "RedisStore",
    "amended_request",
    "closed_key",
    "day_of",
    "finished_request",
    "parse_tokens_key",
    "position_of",
    "row_member",
    "shard_of",
    "tokens_json",
    "tokens_key",
    "tokens_pattern",
    "usage_key",
]
