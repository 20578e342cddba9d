"""`streamtally bench`: benchmarks that report figures (never pass/fail)."""

from __future__ import annotations

import argparse
import json
import platform

from streamtally import _native
from streamtally.cli._output import say
from streamtally.errors import InputError
from streamtally.settings import Settings

__all__ = ["add_parser"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure fold and pipeline throughput (reports figures)",
        description="Benchmarks. They print figures; they never fail on speed.",
    )
    which = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    fold = which.add_parser("fold", help="chunks per second of the fold, per source, one core")
    fold.add_argument("--seconds", type=float, default=2.0, help="time per source (2)")
    fold.add_argument("--json", action="store_true", help="print results as JSON")
    fold.set_defaults(func=run_fold)
    pipeline = which.add_parser(
        "pipeline",
        help="one worker end to end on the running stack: throughput, ceiling, latency, memory",
        description=(
            "Start one worker, push our sample traffic through Kafka into Redis and billing, and "
            "report raw events/s end to end, a plain aiokafka pass-through ceiling, per-request "
            "latency at a steady rate and the worker's peak RSS. Needs the stack "
            "(`streamtally stack up`). Figures only: it never fails on speed."
        ),
    )
    pipeline.add_argument(
        "--events", type=int, default=200_000, help="raw events of the throughput phase (200000)"
    )
    pipeline.add_argument(
        "--rate", type=float, default=5000.0, help="raw events/s of the latency phase (5000)"
    )
    pipeline.add_argument(
        "--seconds", type=float, default=20.0, help="length of the latency phase (20)"
    )
    pipeline.add_argument(
        "--poison-every",
        type=int,
        default=0,
        metavar="N",
        help=(
            "add one poison raw event (JSON with a lone surrogate, dead-lettered by the worker) "
            "per N raw events of the throughput phase (0: none)"
        ),
    )
    pipeline.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help=(
            "worker processes in the consumer group, 1 to 6 (1); CPU time is their sum, "
            "memory the largest one's"
        ),
    )
    pipeline.add_argument(
        "--framing",
        choices=("single-object", "confluent", "both"),
        default=None,
        help=(
            "framing of every value (default: STREAMTALLY_AVRO_FRAMING); confluent needs "
            "STREAMTALLY_SCHEMA_REGISTRY_URL; both: one run with each, one after the other"
        ),
    )
    pipeline.add_argument(
        "--worker-cpus",
        metavar="LIST",
        default=None,
        help=(
            "run the workers on these CPUs (as Linux writes them: 1, 0,2, 2-3) and this "
            "benchmark and the local stack's broker, Redis and registry on the others, which "
            "get their CPUs back at the end: what a core of its own gives a worker; the "
            "pass-through then runs beside the broker, so its ratio does not compare with an "
            "unpinned run (default: nothing pinned)"
        ),
    )
    pipeline.add_argument("--json", action="store_true", help="print results as JSON")
    pipeline.set_defaults(func=run_pipeline)


def _say(text: str) -> None:
    say(text)


_NOT_INSTALLED = (
    "the benchmarks live in a clone of streamtally (benchmarks/ and samples/), not in the "
    "installed package: run `streamtally bench` (or `make bench`) from a clone"
)


def run_fold(args: argparse.Namespace, settings: Settings) -> int:
    del settings  # the fold benchmark runs in this process, on the samples
    try:
        from benchmarks import fold
    except ModuleNotFoundError as exc:
        if exc.name != "benchmarks":
            raise
        raise InputError(_NOT_INSTALLED) from exc

    results = fold.run(args.seconds, progress=_say)
    if args.json:
        rows = [
            {
                "source": r.source.value,
                "chunks_per_second": round(r.chunks_per_second),
                "mib_per_second": round(r.mib_per_second, 2),
                "chunks_per_stream": r.chunks_per_stream,
                "streams_folded": r.repeats,
                "hot_path": _native.status().describe(),
            }
            for r in results
        ]
        print(json.dumps(rows, indent=2))
        return 0
    print(
        f"fold throughput, one thread, Python {platform.python_version()} on {platform.machine()}, "
        f"hot path {_native.status().describe()}"
    )
    print(f"{'source':<18}{'chunks/s':>12}{'MiB/s':>9}{'chunks/stream':>15}{'streams':>9}")
    for r in results:
        print(
            f"{r.source.value:<18}{r.chunks_per_second:>12,.0f}{r.mib_per_second:>9.2f}"
            f"{r.chunks_per_stream:>15}{r.repeats:>9}"
        )
    return 0


def run_pipeline(args: argparse.Namespace, settings: Settings) -> int:
    try:
        from benchmarks import affinity, pipeline
    except ModuleNotFoundError as exc:
        if exc.name != "benchmarks":
            raise
        raise InputError(_NOT_INSTALLED) from exc

    chosen = args.framing or settings.avro_framing
    framings = ("single-object", "confluent") if chosen == "both" else (chosen,)
    try:
        cpus = (
            affinity.parse_cpus(args.worker_cpus) if args.worker_cpus is not None else frozenset()
        )
        benches = [
            pipeline.PipelineSettings(
                events=args.events,
                rate=args.rate,
                seconds=args.seconds,
                poison_every=args.poison_every,
                workers=args.workers,
                bootstrap_servers=settings.kafka,
                redis_url=settings.redis_url,
                framing=framing,
                worker_cpus=cpus,
            )
            for framing in framings
        ]
    except ValueError as exc:
        say(f"streamtally bench pipeline: {exc}")
        return 2
    reports = [pipeline.run(bench, settings, progress=_say) for bench in benches]
    if args.json:
        out = [report.to_json() for report in reports]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=2))
    else:
        print("\n\n".join(pipeline.format_report(report) for report in reports))
    return 0
