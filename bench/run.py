"""``python -m bench [--quick] [--only a,p,b,c,d,e,r,o,q,k,f,m,s,t,j]``: every measurement in one run, printed
as a table with same-run ratios and the targets (p: the noop lane on PostgreSQL; o: per-room
ordering with 1-3 processes; q: per_room against unordered in-process, with a no-op and a slow sink; k: the consumers;
f: the Kafka lane; m: memory over a backlog of 1M pending rows;
s: `room-outbox run` as a process against the raw loop; t: its Kafka lane against a bare producer loop;
j: a second process joining during a burst)."""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio

from bench.backlog import run_backlog
from bench.bigtable import run_claim, run_retention
from bench.consume import PER_MESSAGE_SAMPLE, run_consume
from bench.db import bench_database
from bench.im import ROUNDS as IM_ROUNDS
from bench.im import Variant, run_overhead, run_quota
from bench.kafka_lane import run_kafka_lane
from bench.kafka_process import ROOMS as KAFKA_PROCESS_ROOMS
from bench.kafka_process import run_kafka_process
from bench.noop import run_noop
from bench.ordered import run_ordered
from bench.per_room import run_per_room
from bench.pg import pg_bench_database, run_pg_noop
from bench.process import Pairs, run_join, run_process
from bench.service import run_latency, run_rss
from room_outbox.startup import freeze_startup_heap

SERVER = os.environ.get("ROOM_OUTBOX_TEST_MYSQL", "mysql://root:@127.0.0.1:3306")
PG_SERVER = os.environ.get("ROOM_OUTBOX_TEST_POSTGRESQL", "postgresql://postgres@127.0.0.1:5432")
FULL = {"events": 20_000, "seed_events": 5_000, "batches": "100,500", "im_events": 3_000, "quota_events": 2_400,
        "latency_seconds": 20.0, "latency_batch": 100, "published": 1_000_000, "claim_rounds": 200, "rss_events": 200_000,
        "ordered_events": 20_000, "ordered_rooms": "50,500,5000",
        "consume_events": 60_000, "consume_rounds": 5, "kafka_events": 10_000, "kafka_rounds": 3,
        "backlog": 1_000_000, "backlog_drain": 50_000, "backlog_seconds": 120.0,
        "process_events": 20_000, "process_rooms": 500, "process_rounds": 5,
        "kafka_process_events": 20_000, "kafka_process_rounds": 3,
        "join_events": 6_000, "join_rooms": 50, "join_rounds": 3,
        "per_room_events": 20_000, "per_room_slow_events": 10_000, "per_room_rooms": "500,50,20", "per_room_rounds": 3}  # fmt: skip
QUICK = {"events": 2_000, "seed_events": 500, "batches": "100", "im_events": 300, "quota_events": 300,
         "latency_seconds": 2.0, "latency_batch": 100, "published": 20_000, "claim_rounds": 20, "rss_events": 5_000,
         "ordered_events": 2_000, "ordered_rooms": "50,500",
         "consume_events": 1_000, "consume_rounds": 1, "kafka_events": 500, "kafka_rounds": 1,
         "backlog": 5_000, "backlog_drain": 1_000, "backlog_seconds": 30.0,
         "process_events": 2_000, "process_rooms": 500, "process_rounds": 1,
         "kafka_process_events": 2_000, "kafka_process_rounds": 1,
         "join_events": 1_000, "join_rooms": 50, "join_rounds": 1,
         "per_room_events": 1_000, "per_room_slow_events": 500, "per_room_rooms": "50", "per_room_rounds": 1}  # fmt: skip

#: Part c's target: p99 from commit to receipt within one poll interval and this much more.
LATENCY_MARGIN_MS = 50
Row = tuple[str, str, str, str]  # measurement, figure, ratio, target verdict


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run in well under a minute")
    parser.add_argument(
        "--only",
        default="a,p,b,c,d,e,r,o,q,k,f,m,s,t,j",
        help="parts to run (a b c d e, p = PostgreSQL noop lane, r = retention, o = ordered processes,"
        " q = per_room against unordered in-process, with a no-op and a 1-10 ms sink,"
        " k = consumers, f = Kafka lane, m = memory over a 1M backlog, s = the process against the raw loop,"
        " t = the process's Kafka lane against a bare producer loop, j = a process joining during a burst)",
    )
    for key, value in FULL.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None, help=f"default {value}")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


async def part_a(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    async with bench_database(SERVER) as (_dsn, store):
        for batch in (int(b) for b in args.batches.split(",")):
            r = await run_noop(store, args.events, batch, args.seed_events)
            rows.append((f"a. raw SQL claim+mark, batch {batch}", f"{r.raw:,.0f} ev/s", "baseline", ""))
            rows.append(
                (f"a. seed-style loop, batch {batch}", f"{r.seed:,.0f} ev/s", f"raw = {r.raw / r.seed:.1f}× seed", "")
            )
            rows.append((f"a. dispatcher noop lane, batch {batch}", f"{r.dispatcher:,.0f} ev/s",
                         f"{r.dispatcher / r.raw:.0%} of raw, {r.dispatcher / r.seed:.1f}× seed",
                         f"≥1.0× raw: {verdict(r.dispatcher >= r.raw)}; ≥10× seed: {verdict(r.dispatcher >= 10 * r.seed)}"))  # fmt: skip
            rows.append((f"a. CPU per event in this process, batch {batch}",
                         f"dispatcher {r.dispatcher_cpu_us:,.1f} µs, raw {r.raw_cpu_us:,.1f} µs",
                         f"in series: raw's time + the difference = {r.serial_bound:,.0f} ev/s ({r.serial_bound / r.raw:.0%} of raw)",
                         f"the bound without overlap: measured {r.dispatcher / r.serial_bound:.0%} of it"))  # fmt: skip
            rows.append((f"a. same, claims in turn with delivery, batch {batch}", f"{r.claims_in_turn:,.0f} ev/s",
                         f"{r.claims_in_turn / r.raw:.0%} of raw; claims ahead = {r.dispatcher / r.claims_in_turn:.2f}× in turn", "before"))  # fmt: skip
    return rows


async def part_p(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    async with pg_bench_database(PG_SERVER) as store:
        for batch in (int(b) for b in args.batches.split(",")):
            r = await run_pg_noop(store, args.events, batch)
            rows.append(
                (f"p. PostgreSQL raw SKIP LOCKED claim+mark, batch {batch}", f"{r.raw:,.0f} ev/s", "baseline", "")
            )
            rows.append((f"p. PostgreSQL dispatcher noop lane, batch {batch}", f"{r.dispatcher:,.0f} ev/s",
                         f"{r.dispatcher / r.raw:.0%} of raw", f"≥70 % raw: {verdict(r.dispatcher >= 0.7 * r.raw)}"))  # fmt: skip
    return rows


async def part_b(args: argparse.Namespace) -> list[Row]:
    async with bench_database(SERVER) as (_dsn, store):
        o = await run_overhead(store, args.im_events, rounds=3 if args.quick else IM_ROUNDS)
        q = await run_quota(store, args.quota_events)

    def against_bare(v: Variant) -> str:
        ratios = sorted(v.ratios(o.bare))
        return (f"{v.ratio(o.bare):.0%} of bare httpx (rounds {ratios[0]:.0%}–{ratios[-1]:.0%}); "
                f"CPU/ev {v.cpu / o.bare.cpu:.2f}× bare")  # fmt: skip

    quota_ok = q.rate >= 0.95 * q.quota and q.rate_limit_errors == 0 and q.cpu_share <= 0.25
    return [
        (f"b. bare httpx loop, aiohttp transport → fake IM, 16 in flight ({o.events:,} ev in {o.rounds} rounds)",
         f"{o.bare.rate:,.0f} req/s, {o.bare.cpu:,.0f} µs CPU/req",
         f"baseline (the sink's client); {o.bare.timeouts} requests over request_timeout",
         f"load average {o.load[0]:.1f} → {o.load[1]:.1f}"),
        ("b. bare httpx loop, httpx's own transport (httpcore)",
         f"{o.bare_httpcore.rate:,.0f} req/s, {o.bare_httpcore.cpu:,.0f} µs CPU/req",
         f"{against_bare(o.bare_httpcore)}; {o.bare_httpcore.timeouts} requests over request_timeout",
         "the transport not chosen"),
        ("b. TencentIMSink.deliver, limits lifted", f"{o.sink.rate:,.0f} ev/s, {o.sink.cpu:,.0f} µs CPU/ev",
         against_bare(o.sink), f"≥97 %: {verdict(o.sink.ratio(o.bare) >= 0.97)}"),
        ("b. main lane (claim+deliver+record), limits lifted", f"{o.lane.rate:,.0f} ev/s, {o.lane.cpu:,.0f} µs CPU/ev",
         against_bare(o.lane), f"main lane ≥90 % of bare httpx: {verdict(o.lane.ratio(o.bare) >= 0.9)}"),
        ("b. same, claims in turn with delivery", f"{o.lane_in_turn.rate:,.0f} ev/s, {o.lane_in_turn.cpu:,.0f} µs CPU/ev",
         against_bare(o.lane_in_turn), f"claims ahead = {o.lane.rate / o.lane_in_turn.rate:.2f}× in turn"),
        ("b. main lane's CPU-bound ceiling: one core busy all the time", f"{1e6 / o.lane.cpu:,.0f} ev/s",
         f"{1e6 / o.lane.cpu / o.bare.rate:.0%} of bare httpx; busy share of a core: bare {o.bare.busy:.0%}, "
         f"lane {o.lane.busy:.0%}", "what overlap alone could reach"),
        (f"b. main lane at the default quota ({q.events} ev)", f"{q.rate:,.1f} req/s",
         f"{q.rate / q.quota:.1%} of {q.quota}/s; {q.rate_limit_errors} rate-limit errors; "
         f"{q.cpu_share:.0%} of a core",
         f"≥95 %, 0 errors, ≤25 % of a core: {verdict(quota_ok)}"),
        ("b. limiter slot busy (mean), bound", f"{q.busy_ms:,.1f} ms",
         f"1/(1 + margin + busy) = {q.bound:.1%} of quota", ""),
    ]  # fmt: skip


async def part_c(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    async with bench_database(SERVER) as (dsn, store):
        for poll in (1.0, 0.1):
            r = await run_latency(store, dsn, poll, 500, args.latency_seconds, args.latency_batch)
            bound = poll * 1000 + LATENCY_MARGIN_MS
            ok = r.p99_ms <= bound
            rows.append((f"c. commit→IM latency, 500 ev/s, poll {poll:g}s, batch {args.latency_batch}",
                         f"p50 {r.p50_ms:,.0f} ms, p99 {r.p99_ms:,.0f} ms",
                         f"max {r.max_ms:,.0f} ms, {r.events} ev, {r.delivered_rate:,.0f} ev/s delivered",
                         f"p99 ≤ poll + {LATENCY_MARGIN_MS} = {bound:,.0f} ms: {verdict(ok)}"))  # fmt: skip
            rows.append((f"c. CPU during it (cores), poll {poll:g}s",
                         f"machine {r.machine_cpu:.2f} of {os.cpu_count()}",
                         f"fake IM {r.fake_cpu:.2f}, worker {r.worker_cpu:.2f}, load generator {r.generator_cpu:.2f}",
                         ""))  # fmt: skip
    return rows


async def part_d(args: argparse.Namespace) -> list[Row]:
    async with bench_database(SERVER) as (_e, empty), bench_database(SERVER) as (dsn, full):
        c = await run_claim(empty, full, args.published, args.claim_rounds)
        rows: list[Row] = [
            ("d. claim query, 1,000 pending, empty table", f"{c.empty_ms:.2f} ms", f"{c.empty_reads} index reads", ""),
            (f"d. same behind {c.published:,} published", f"{c.full_ms:.2f} ms",
             f"{c.full_ms / c.empty_ms:.2f}× empty, {c.full_reads} index reads (load {c.load_seconds:.0f}s)",
             f"≤1.5×: {verdict(c.full_ms <= 1.5 * c.empty_ms)}"),
        ]  # fmt: skip
        if "r" in args.only:
            r = await run_retention(full, dsn, args.events)
            rows += [
                (f"r. noop lane beside {c.published:,} published", f"{r.alone:,.0f} ev/s", "baseline", ""),
                ("r. same while `room-outbox cleanup` runs", f"{abs(r.with_cleanup):,.0f} ev/s",
                 f"{abs(r.with_cleanup) / r.alone:.0%} of alone; cleanup {r.cleanup_rows_per_s:,.0f} rows/s"
                 + ("" if r.with_cleanup > 0 else " (cleanup ended first)"), ""),
            ]  # fmt: skip
    return rows


async def part_e(args: argparse.Namespace) -> list[Row]:
    async with bench_database(SERVER) as (dsn, store):
        r = await run_rss(store, dsn, args.rss_events)
    return [
        (f"e. room-outbox run draining {r.events:,}", f"peak RSS {r.peak_mb:.0f} MB",
         f"idle {r.idle_mb:.0f} MB; {r.events / r.seconds:,.0f} ev/s", f"≤150 MB: {verdict(r.peak_mb <= 150)}"),
    ]  # fmt: skip


async def part_o(args: argparse.Namespace) -> list[Row]:
    batches = [int(b) for b in args.batches.split(",")]
    rooms = [int(r) for r in args.ordered_rooms.split(",")]
    async with bench_database(SERVER) as (dsn, store):
        results = await run_ordered(store, dsn, args.ordered_events, batches, rooms)
    one = {(r.ordering, r.batch_size, r.rooms): r.rate for r in results if r.processes == 1}
    unordered = {(r.batch_size, r.rooms, r.processes): r.rate for r in results if r.ordering != "per_room"}
    rows: list[Row] = []
    for r in results:
        base = one[(r.ordering, r.batch_size, r.rooms)]
        ratio = "baseline" if r.processes == 1 else f"{r.rate / base:.2f}× 1 process"
        target = "" if r.processes == 1 else f"≥ 1 process: {verdict(r.rate >= base * 0.9)}"
        alike = unordered.get((r.batch_size, r.rooms, r.processes))
        if r.ordering == "per_room" and alike:
            ratio += f"; {r.rate / alike:.2f}× unordered"
            target += f"{'; ' if target else ''}≥ 0.9× unordered: {verdict(r.rate >= 0.9 * alike)}"
        measured = " / ".join(f"{rate:,.0f}" for rate in r.rates)  # up, down
        rows.append((f"o. {r.ordering}, batch {r.batch_size}, {r.rooms:,} rooms, {r.processes} process(es)",
                     f"{r.rate:,.0f} ev/s ({measured})", ratio, target))  # fmt: skip
    return rows


async def part_q(args: argparse.Namespace) -> list[Row]:
    rooms = [int(r) for r in args.per_room_rooms.split(",")]
    async with bench_database(SERVER) as (_dsn, store):
        results = await run_per_room(
            store, args.per_room_events, args.per_room_slow_events, 100, rooms, args.per_room_rounds
        )
    rows: list[Row] = []
    for r in results:
        size = f"{r.events:,} ev over {r.rooms} rooms, batch {r.batch_size}"
        rounds = ", ".join(f"{p / u:.2f}" for p, u in zip(r.per_room, r.unordered, strict=True))
        rows += [
            (f"q. unordered, sink {r.sink}, {size}", f"{statistics.median(r.unordered):,.0f} ev/s", "baseline", ""),
            (f"q. per_room, sink {r.sink}, {size}", f"{statistics.median(r.per_room):,.0f} ev/s",
             f"{r.ratio:.2f}× unordered (rounds {rounds})", f"≥ 0.9× unordered: {verdict(r.ratio >= 0.9)}"),
        ]  # fmt: skip
    return rows


async def part_k(args: argparse.Namespace) -> list[Row]:
    async with bench_database(SERVER, pool_size=16) as (_dsn, store):
        r = await run_consume(store, args.consume_events, args.consume_rounds)
    rounds = ", ".join(f"{x:.0%}" for x in r.ratios)
    return [
        (f"k. bare aiokafka loop, a commit per fetched batch ({r.events:,} ev, median of {r.rounds})",
         f"{r.bare_per_batch:,.0f} ev/s", "baseline", ""),
        ("k. consume, audit handler (effectively-once)", f"{r.engine:,.0f} ev/s",
         f"{r.ratio:.0%} of per-batch loop (rounds: {rounds})", f"≥ 70 %: {verdict(r.ratio >= 0.7)}"),
        (f"k. bare aiokafka loop, a commit per row (first {min(r.events, PER_MESSAGE_SAMPLE):,} ev)",
         f"{r.bare_per_message:,.0f} ev/s", f"{r.bare_per_message / r.bare_per_batch:.0%} of per-batch loop",
         "reference"),
    ]  # fmt: skip


def cpu_bound(cpu_ratio: float, rate_ratio: float) -> str:
    """What bounds the tailing lane against the bare loop, read from the two ratios."""
    if abs(cpu_ratio / rate_ratio - 1) <= 0.2:
        return "ratios agree: the relay is bound by its own process's CPU"
    return "ratios differ: not by its CPU alone"


async def part_f(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    async with bench_database(SERVER) as (_dsn, store):
        for batch in (int(b) for b in args.batches.split(",")):
            r = await run_kafka_lane(store, args.kafka_events, batch, args.kafka_rounds)
            rows += [
                (f"f. bare aiokafka send_and_wait, {r.concurrency} in flight, batch {batch} ({r.events:,} ev)",
                 f"{r.bare:,.0f} ev/s", "baseline", ""),
                (f"f. bare send_and_wait, {batch} in flight", f"{r.bare_batch:,.0f} ev/s",
                 f"{r.bare_batch / r.bare:.1f}× baseline", "reference"),
                (f"f. Kafka lane (acks=all, idempotent {str(r.idempotent).lower()}), batch {batch}, concurrency {r.concurrency}",
                 f"{r.lane:,.0f} ev/s",
                 f"{r.lane / r.bare:.0%} of baseline, {r.lane / r.bare_batch:.0%} of {batch} in flight",
                 f"≥70 % baseline: {verdict(r.lane >= 0.7 * r.bare)}"),
                (f"f. tailing Kafka lane (relay: tail, idempotent {str(r.idempotent).lower()}), batch {batch}",
                 f"{r.tail:,.0f} ev/s",
                 f"{r.tail / r.bare_batch:.0%} of {batch} in flight, {r.tail / r.bare:.1f}× baseline",
                 f"≥70 % of the bare loop at {batch} in flight: {verdict(r.tail >= 0.7 * r.bare_batch)}"),
                (f"f. this process's CPU per event: bare loop at {batch} in flight, tailing lane",
                 f"{r.bare_batch_cpu_us:.0f} µs, {r.tail_cpu_us:.0f} µs",
                 f"CPU {r.bare_batch_cpu_us / r.tail_cpu_us:.0%}, rate {r.tail / r.bare_batch:.0%}",
                 cpu_bound(r.bare_batch_cpu_us / r.tail_cpu_us, r.tail / r.bare_batch)),
                (f"f. KafkaSink.deliver alone, {r.concurrency} in flight (no store, no dispatcher)", f"{r.sink:,.0f} ev/s",
                 f"{r.sink / r.bare:.0%} of baseline", "the plugin's cost"),
                (f"f. the dispatcher's delivery alone, batch {batch} (no store)", f"{r.delivery:,.0f} ev/s",
                 f"{r.delivery / r.bare:.0%} of baseline, {r.delivery / r.sink:.0%} of the sink alone", "dispatcher's cost"),
                (f"f. same lane, delivery a no-op, batch {batch}", f"{r.lane_noop:,.0f} ev/s",
                 f"Kafka lane = {r.lane / r.lane_noop:.0%} of it", "the lane's store-bound ceiling"),
            ]  # fmt: skip
    return rows


async def part_m(args: argparse.Namespace) -> list[Row]:
    async with bench_database(SERVER) as (dsn, store):
        r = await run_backlog(store, dsn, args.backlog, args.backlog_drain, args.backlog_seconds)
    ref = r.reference
    rows: list[Row] = [
        (f"m. {ref.name}, {ref.backlog:,} owed", f"RSS {ref.start_mb:.0f} → {ref.end_mb:.0f} MB, peak {ref.peak_mb:.0f} MB",
         f"after {ref.drained:,} ev ({ref.rate:,.0f} ev/s)", "baseline"),
    ]  # fmt: skip
    for run in r.runs:
        same = run is r.runs[0]
        vs_ref = f"; {run.end_mb - ref.end_mb:+.1f} MB vs reference" if same else ""
        target = f"flat ({run.end_mb - run.mid_mb:+.1f} MB over the 2nd half ≤ 2): {verdict(run.flat)}"
        if same:
            target += f"; ≤ reference + 5 MB: {verdict(run.end_mb <= ref.end_mb + 5)}"
        rows.append(
            (f"m. {run.name}, {run.backlog:,} owed (load {r.load_seconds:.0f}s)",
             f"RSS {run.start_mb:.0f} → {run.mid_mb:.0f} → {run.end_mb:.0f} MB, peak {run.peak_mb:.0f} MB",
             f"after {run.drained:,} ev ({run.rate:,.0f} ev/s); 2nd half {run.slope_mb_per_100k:+.2f} MB per 100k ev"
             f"{vs_ref}; {run.failed_samples} backlog samples failed", target)
        )  # fmt: skip
    return rows


def _rounds(p: Pairs) -> str:
    return ", ".join(f"{r:.2f}" for r in p.ratios)


async def part_s(args: argparse.Namespace) -> list[Row]:
    """The process's rounds and the raw loop's alternate; the ratio is the median of each round's."""
    batches = [int(b) for b in args.batches.split(",")]
    async with bench_database(SERVER) as (_raw_dsn, raw_store), bench_database(SERVER) as (dsn, store):
        load_before = os.getloadavg()[0]
        results = await run_process(
            raw_store, store, dsn, args.process_events, args.process_rooms, batches, args.process_rounds
        )
        load_after = os.getloadavg()[0]
    # per_room against the unordered process: each one's ratio to the raw rounds it alternated
    # with, so that a load that differs between the two runs weighs on neither.
    unordered = {p.batch_size: p.ratio for p in results if p.ordering == "none"}
    rows: list[Row] = []
    for p in results:
        size = f"batch {p.batch_size}, {args.process_events:,} ev over {args.process_rooms} rooms"
        rows.append((f"s. raw claim+mark loop ({p.ordering} rounds), {size}", f"{statistics.median(p.baseline):,.0f} ev/s",
                     "baseline", f"load average {load_before:.1f} → {load_after:.1f}"))  # fmt: skip
        rate = statistics.median(p.measured)
        if p.ordering == "none":
            rows.append((f"s. room-outbox run, noop lane, {size}", f"{rate:,.0f} ev/s",
                         f"{p.ratio:.2f}× raw (rounds {_rounds(p)})", f"≥ 0.9× raw: {verdict(p.ratio >= 0.9)}"))  # fmt: skip
        else:
            against = p.ratio / unordered[p.batch_size]
            rows.append((f"s. room-outbox run, per_room, {size}", f"{rate:,.0f} ev/s",
                         f"{p.ratio:.2f}× raw (rounds {_rounds(p)}); {against:.2f}× the unordered process's ratio",
                         f"≥ 0.9× unordered: {verdict(against >= 0.9)}"))  # fmt: skip
    return rows


async def part_t(args: argparse.Namespace) -> list[Row]:
    """The process's Kafka lane and the bare loop alternate; the ratio is the median of each round's."""
    batches = [int(b) for b in args.batches.split(",")]
    async with bench_database(SERVER) as (dsn, store):
        load_before = os.getloadavg()[0]
        results = await run_kafka_process(store, dsn, args.kafka_process_events, batches, args.kafka_process_rounds)
        load_after = os.getloadavg()[0]
    rows: list[Row] = []
    for r in results:
        size = f"batch {r.batch_size}, {r.events:,} ev over {KAFKA_PROCESS_ROOMS} rooms"
        bare_rate, bare_cpu = (statistics.median(x) for x in zip(*r.bare, strict=True))
        rate, cpu = (statistics.median(x) for x in zip(*r.process, strict=True))
        rounds = ", ".join(f"{x:.2f}" for x in r.ratios)
        rows.append((f"t. bare send_and_wait, {r.batch_size} in flight, {r.events:,} ev (this process)",
                     f"{bare_rate:,.0f} ev/s, {bare_cpu:.0f} µs CPU/ev", "baseline",
                     f"load average {load_before:.1f} → {load_after:.1f}"))  # fmt: skip
        rows.append((f"t. room-outbox run, Kafka lane (relay: tail), {size}", f"{rate:,.0f} ev/s, {cpu:.0f} µs CPU/ev",
                     f"{r.ratio:.0%} of bare (rounds {rounds}); CPU {r.cpu_ratio:.0%}",
                     f"≥70 % of the bare loop: {verdict(r.ratio >= 0.7)}"))  # fmt: skip
    return rows


async def part_j(args: argparse.Namespace) -> list[Row]:
    async with bench_database(SERVER) as (dsn, store):
        load_before = os.getloadavg()[0]
        r = await run_join(store, dsn, args.join_events, args.join_rooms, 100, args.join_rounds)
        load_after = os.getloadavg()[0]
    size = f"{args.join_events:,} ev over {args.join_rooms} rooms, batch 100, per_room"
    return [
        (f"j. one process, {size}", f"{statistics.median(r.joining.baseline):,.0f} ev/s", "baseline",
         f"load average {load_before:.1f} → {load_after:.1f}"),
        ("j. same, a second process started as the burst is released", f"{statistics.median(r.joining.measured):,.0f} ev/s",
         f"{r.joining.ratio:.2f}× one (rounds {_rounds(r.joining)})", "its start-up's CPU included"),
        ("j. same, two processes, buckets settled before the burst", f"{statistics.median(r.settled.measured):,.0f} ev/s",
         f"{r.settled.ratio:.2f}× one (rounds {_rounds(r.settled)})", f"≥ 1 process: {verdict(r.settled.ratio >= 1.0)}"),
    ]  # fmt: skip


PARTS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "a": part_a, "p": part_p, "b": part_b, "c": part_c, "d": part_d, "e": part_e, "o": part_o, "k": part_k,
    "f": part_f, "m": part_m, "s": part_s, "t": part_t, "j": part_j, "q": part_q,
}  # fmt: skip


def print_table(rows: list[Row]) -> None:
    header: Row = ("measurement", "figure", "same-run ratio", "target")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) + " |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    rows: list[Row] = []
    started = time.monotonic()
    # As `room-outbox run` and `consume` do before their loops; the in-process parts (the
    # dispatcher, the consumer engine) and their baselines share this process and its heap.
    freeze_startup_heap()
    for name in args.only.split(","):
        if name in PARTS:
            print(f"# part {name}…", flush=True)
            try:
                rows += anyio.run(PARTS[name], args)
            except BaseException:
                print_table(rows)  # what the parts before it measured is not lost with it
                print(f"\n# part {name} failed:", flush=True)
                raise
    if "r" in args.only and "d" not in args.only:
        print("# part r runs inside part d (it needs the big table)")
    print_table(rows)
    print(f"\n{time.monotonic() - started:.0f}s, {os.cpu_count()} cores{', --quick' if args.quick else ''}")
    return 0
