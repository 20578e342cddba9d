"""`streamtally worker`: run the stream processors until SIGTERM or Ctrl-C.

Logging: faust's worker configures logging when it starts; it is given this
command's configuration (`streamtally.cli._logging.dict_config`:
``--log-format`` text or JSON lines on stderr, at ``--loglevel``), so faust's,
mode's, aiokafka's and streamtally's records all go through one handler
and one formatter.  faust then points stdout and stderr at a logger, so a
stray print becomes a record too.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from typing import Any, Final, NoReturn

from streamtally import _native
from streamtally._gc import tune_gc
from streamtally.cli._logging import STATUS_LOGGER, dict_config
from streamtally.errors import InputError, StackError
from streamtally.redact import redact_text, redact_url, scrub, url_secrets
from streamtally.settings import Settings
from streamtally.topics import Topics
from streamtally.wire.framing import framing_for
from streamtally.wire.kafka import ensure_topics

__all__ = ["add_parser"]

#: How long the worker waits at start for a Redis that does not answer (seconds).
REDIS_START_WAIT_S = 30.0


async def _check_layout(url: str, *, cluster: bool) -> None:
    """Refuse to start on Redis data of another layout; wait a while for a Redis starting up."""
    from redis.exceptions import AuthenticationError as RedisAuthenticationError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    from streamtally.store import RedisStore

    shown, secrets = redact_url(url), url_secrets(url)
    try:
        store = RedisStore.from_url(url, cluster=cluster, connect_timeout=5, timeout=30)
    except ValueError as exc:  # one line, the URL's password hidden, not a traceback
        raise InputError(
            f"REDIS_URL: bad Redis URL {shown!r}: {scrub(redact_text(str(exc)), secrets)}"
        ) from exc
    deadline = asyncio.get_running_loop().time() + REDIS_START_WAIT_S
    try:
        while True:
            try:
                await store.ensure_layout()  # LayoutError: another layout, say what to do
                return
            except RedisAuthenticationError as exc:  # waiting would not help
                raise StackError(
                    f"Redis at {shown} refused the credentials "
                    f"({scrub(redact_text(str(exc)), secrets)}): check the password of REDIS_URL"
                ) from exc
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                said = scrub(redact_text(str(exc)), secrets)
                if asyncio.get_running_loop().time() > deadline:
                    raise StackError(
                        f"cannot reach Redis at {shown} ({said}): start the stack "
                        "(`streamtally stack up`) or set REDIS_URL"
                    ) from exc
                logging.getLogger(STATUS_LOGGER).warning(
                    "Redis at %s does not answer (%s); waiting", shown, said
                )
                await asyncio.sleep(1.0)
    finally:
        await store.aclose()


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "worker",
        help="run the stream processors (faust) until SIGTERM",
        description=(
            "Consume the raw topics, write chunks, completed Tokens, billing events and "
            "dead letters to their topics and Tokens and usage rows to Redis. Settings come "
            "from the environment: KAFKA_BOOTSTRAP_SERVERS, REDIS_URL, STREAMTALLY_PRICES, "
            "STREAMTALLY_REQUEST_TIMEOUT (seconds), STREAMTALLY_BATCH_SIZE. Log records go to "
            "stderr, as text lines or (--log-format json) one JSON object per line."
        ),
    )
    parser.add_argument("--loglevel", default="warning", choices=("debug", "info", "warning"))
    parser.add_argument(
        "--instance-id",
        metavar="ID",
        help=(
            "this worker's static member id in its consumer group (Kafka's group.instance.id; "
            "default: STREAMTALLY_WORKER_INSTANCE_ID, else none: a dynamic member). A worker "
            "restarted with the same id within its session timeout (STREAMTALLY_SESSION_TIMEOUT, "
            "45 s by default with an id) gets its partitions back without a rebalance. One id "
            "per worker: a second live worker with the same id takes the partitions over and "
            f"the first stops (exit status {EX_MEMBERSHIP_LOST})"
        ),
    )
    parser.set_defaults(func=run)


#: The worker's exit status after a batch failed (sysexits' EX_SOFTWARE): a supervisor
#: that restarts failed services restarts it, and it reads its partitions again.
EX_SOFTWARE: Final = 70


#: The worker's exit status once its static membership is lost (sysexits' EX_CONFIG):
#: another worker runs with its instance id, or it was silent past its session timeout.
#: A supervisor should not restart it blindly: restarted, it would take the id back from
#: the other worker, which would stop in turn (systemd: ``RestartPreventExitStatus=78``).
EX_MEMBERSHIP_LOST: Final = 78


def _stop_this_worker(exc: BaseException) -> None:
    """A batch failed and nothing is committed any more: stop as on SIGTERM (leave the group
    at once, so the partitions' next owner reads them again), then exit `EX_SOFTWARE`."""
    del exc  # logged by the pipeline
    os.kill(os.getpid(), signal.SIGTERM)


def _stop_before_start(signum: int, frame: object) -> NoReturn:
    """SIGTERM before faust handles it (topics, Redis and the app still being set up): a
    clean stop, exit 0.  Nothing has been read or committed yet, so nothing is lost."""
    del frame
    logging.getLogger(STATUS_LOGGER).info(
        "streamtally worker: %s while starting: stopped before reading anything",
        signal.Signals(signum).name,
    )
    raise SystemExit(0)


def run(args: argparse.Namespace, settings: Settings) -> NoReturn:
    # Until faust's worker takes SIGTERM over (once it starts), it stops the start-up: a
    # supervisor's stop of a worker still starting is a clean one, not a death by signal.
    signal.signal(signal.SIGTERM, _stop_before_start)
    import faust

    from streamtally.processors.app import create_app
    from streamtally.processors.sinks import KafkaSink, RedisSink, Sinks
    from streamtally.processors.source import IDLE_FETCH_WAIT_MS, MembershipLost
    from streamtally.store import RedisStore

    if args.instance_id is not None:
        settings = settings.with_instance_id(args.instance_id)
    topics = Topics.in_namespace(settings.namespace)
    # Kafka down before the start: the error raised says so in one line, without
    # aiokafka's own record of each failed attempt; once running, aiokafka logs as set.
    aiokafka = logging.getLogger("aiokafka")
    aiokafka_level = aiokafka.level
    aiokafka.setLevel(logging.CRITICAL)
    try:
        asyncio.run(ensure_topics(settings.kafka, topics.all))
    finally:
        aiokafka.setLevel(aiokafka_level)
    asyncio.run(_check_layout(settings.redis_url, cluster=settings.redis_cluster))
    # The registry for reading, and with STREAMTALLY_AVRO_FRAMING=confluent the outputs'
    # schemas registered (a registry down or refusing: one line, exit 2).
    framing = framing_for(settings, topics.outputs)

    def make_sinks(app: Any) -> Sinks:
        redis_outputs = RedisSink(
            RedisStore.from_url(
                settings.redis_url, cluster=settings.redis_cluster, state_ttl_s=settings.state_ttl
            )
        )
        del app  # the sinks have their own batching producer
        kafka = KafkaSink(settings.kafka, topics, framing)
        return Sinks(
            kafka, redis_outputs, lookup=redis_outputs.lookup, amendable=redis_outputs.amendable
        )

    pipeline = create_app(settings, make_sinks, on_failure=_stop_this_worker)
    logging.getLogger(STATUS_LOGGER).info(
        "streamtally worker: kafka %s, redis %s, prices %s, hot path %s",
        settings.kafka.describe(),
        redact_url(settings.redis_url),
        settings.prices_path or "(packaged)",
        _native.status().describe(),
    )
    logging.getLogger(STATUS_LOGGER).info(
        "avro framing: %s (STREAMTALLY_AVRO_FRAMING), schema registry %s",
        framing.name,
        redact_url(settings.schema_registry_url or "") or "none (Confluent-framed values refused)",
    )
    logging.getLogger(STATUS_LOGGER).info(
        "group membership: %s, session timeout %g s (STREAMTALLY_SESSION_TIMEOUT)",
        "dynamic (no STREAMTALLY_WORKER_INSTANCE_ID)"
        if settings.worker_instance_id is None
        else f"static, instance id {settings.worker_instance_id!r}",
        settings.session_timeout,
    )
    logging.getLogger(STATUS_LOGGER).info(
        "fetches: the broker answers at %d bytes of raw records or after %g s "
        "(STREAMTALLY_FETCH_MIN_BYTES, STREAMTALLY_FETCH_WAIT), batches of at most %d records; "
        "while idle, at the first record or after %g s",
        settings.fetch_min_bytes,
        settings.fetch_wait,
        settings.batch_size,
        IDLE_FETCH_WAIT_MS / 1000,
    )
    trust = pipeline.processor.trust
    if trust is None:
        logging.getLogger(STATUS_LOGGER).warning(
            "tenant trust: no STREAMTALLY_TENANT_KEYS, every producer is trusted: any client "
            'that can write the raw topics can bill any tenant (docs/tenants.md, "Tenant trust")'
        )
    else:
        logging.getLogger(STATUS_LOGGER).info(
            "tenant trust: %d producer keys from %s; unsigned or unauthorised records "
            "are dead-lettered",
            len(trust.keys),
            settings.tenant_keys_path,
        )
    logging.getLogger(STATUS_LOGGER).info(
        "content policy: %s (STREAMTALLY_CONTENT), chunks topic %s (STREAMTALLY_CHUNKS)",
        pipeline.processor.content.content.value,
        "on" if pipeline.processor.chunks_topic else "off",
    )
    level = args.loglevel.upper()
    worker = faust.Worker(
        pipeline.app,
        loglevel=level,
        quiet=True,
        logging_config=dict_config(args.log_format, level),
    )
    # faust's terminal spinner sets the root logger to DEBUG, so every debug line of
    # aiokafka (one per message sent) would be formatted: a fifth of the worker's CPU.
    worker.spinner = None
    tune_gc()
    try:
        worker.execute_from_commandline()  # runs until SIGTERM/SIGINT, then exits the process
    except SystemExit:
        if isinstance(pipeline.broken, MembershipLost):  # logged: another has the id
            raise SystemExit(EX_MEMBERSHIP_LOST) from None
        if pipeline.broken is not None:  # a batch failed (logged): not a clean stop
            raise SystemExit(EX_SOFTWARE) from None
        raise
