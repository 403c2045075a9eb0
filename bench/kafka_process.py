"""(t) The Kafka lane as ``room-outbox run`` ships it, against a bare producer loop.

``room-outbox run`` as an operator starts it, with the Kafka sink on its default relay
(``tail``) and the IM and noop sinks off (so the main lane has nothing to do and the process's
work is the lane's), telemetry as shipped (the HTTP endpoint on), on a tansu broker. Each round
commits a backlog of events over 500 rooms to ``room_outbox`` and the process tails it to the
topic. Its rounds alternate with part f's bare aiokafka ``send_and_wait`` loop, run in this
process with a batch in flight (the lane's batch size), sending the same messages to the same
topic. Both are timed from the messages' own timestamps on the topic (each producer stamps a
message as it takes it): from the first of the round to the last, counting the messages after
the first, so neither the process's polling nor this process's is in the figure. The CPU time
per event is the process's (from ``/proc``) and this process's for the bare loop.
"""

from __future__ import annotations

import functools
import json
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
from aiokafka import AIOKafkaConsumer, TopicPartition

from bench import procs
from bench.consume import TOPIC, Tansu
from bench.db import load
from bench.kafka_lane import Message, bare_producer, messages, send_all
from bench.process import alternate, free_port, start
from room_outbox.store.backends.mysql import MySQLStore

PARTITIONS = [TopicPartition(TOPIC, p) for p in range(3)]
ROOMS = 500


@dataclass(frozen=True)
class KafkaProcessResult:
    batch_size: int
    events: int
    #: Per round, events/s and CPU µs per event: the process, and the bare loop beside it.
    process: list[tuple[float, float]]
    bare: list[tuple[float, float]]

    @property
    def ratios(self) -> list[float]:
        return [p[0] / b[0] for p, b in zip(self.process, self.bare, strict=True)]

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def cpu_ratio(self) -> float:
        """The bare loop's CPU per event over the process's (as the rate ratio: higher is better)."""
        return statistics.median(b[1] / p[1] for p, b in zip(self.process, self.bare, strict=True))


def write_config(folder: str, dsn: str, bootstrap: str, batch_size: int) -> str:
    config = {
        "mysql": {"dsn": dsn},
        "outbox_worker": {"batch_size": batch_size, "poll_interval": "100ms"},
        "sinks": {
            "tencent_im": {"enabled": False},
            "noop": {"enabled": False},
            # From the first row: the probe may commit before the lane has its cursor.
            "kafka": {"bootstrap_servers": bootstrap, "topic": TOPIC, "start": "beginning"},
        },
        "telemetry": {"http_listen": f"127.0.0.1:{free_port()}"},
    }
    path = Path(folder) / f"kafka-process-{batch_size}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return str(path)


class Reader:
    """Follows the topic from its start and hands out the timestamps of the messages each round
    put on it, in turn. (Counted by reading: tansu's end offsets lag behind a partition's last
    record batch.)"""

    def __init__(self, bootstrap: str) -> None:
        self.consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)

    async def __aenter__(self) -> Reader:
        await self.consumer.start()
        self.consumer.assign(PARTITIONS)
        await self.consumer.seek_to_beginning(*PARTITIONS)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.consumer.stop()

    async def next(self, events: int, proc: subprocess.Popen[str] | None = None, timeout: float = 600.0) -> list[int]:
        """The timestamps (ms) of the next ``events`` messages; ``proc``: the process that puts
        them on the topic, which must not exit meanwhile."""
        stamps: list[int] = []
        with anyio.fail_after(timeout):
            while len(stamps) < events:
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"room-outbox run exited with {proc.returncode}")
                for batch in (await self.consumer.getmany(timeout_ms=200, max_records=events - len(stamps))).values():
                    stamps.extend(m.timestamp for m in batch)
        return stamps


def stamped_rate(stamps: list[int]) -> float:
    """Messages after the first over the time from the first to the last."""
    first, last = min(stamps), max(stamps)
    if last == first:
        raise RuntimeError("too few messages to time: raise the event count")
    return sum(1 for s in stamps if s > first) / ((last - first) / 1000)


async def tailed(store: MySQLStore, reader: Reader, proc: subprocess.Popen[str], events: int, prefix: str,
                 timeout: float = 600.0) -> tuple[float, float]:  # fmt: skip
    """Commit ``events`` rows at once and read them from the topic once the process has put
    them there: their rate, and the process's CPU µs per event."""
    cpu = procs.cpu_seconds(proc.pid)
    await load(store, events, prefix=prefix, rooms=ROOMS)  # one commit: a backlog at once
    stamps = await reader.next(events, proc, timeout)
    cpu_us = (procs.cpu_seconds(proc.pid) - cpu) / events * 1e6  # all the process did meanwhile
    if cpu_us == 0:
        raise RuntimeError(
            f"{events} messages were on the topic before room-outbox run had used any CPU: most likely"
            " an earlier round's messages sent twice, not this round's: the round cannot be timed"
        )
    return (stamped_rate(stamps) if events > 1 else 0.0), cpu_us


async def bare_round(bootstrap: str, reader: Reader, batch: list[Message], in_flight: int) -> tuple[float, float]:
    async with bare_producer(bootstrap, False, batch) as producer:  # tansu refuses idempotence
        await reader.next(1)  # passed over: the message the producer sent before the clock started
        cpu = time.process_time()
        await send_all(producer, batch, in_flight)
        cpu_us = (time.process_time() - cpu) / len(batch) * 1e6
    return stamped_rate(await reader.next(len(batch))), cpu_us


async def run_kafka_process(
    store: MySQLStore, dsn: str, events: int, batches: list[int], rounds: int
) -> list[KafkaProcessResult]:
    broker = Tansu()
    results: list[KafkaProcessResult] = []
    try:
        async with Reader(broker.bootstrap) as reader:
            with tempfile.TemporaryDirectory() as folder:
                for batch_size in batches:
                    results.append(
                        await run_batch(store, dsn, broker.bootstrap, reader, folder, events, batch_size, rounds)
                    )
    finally:
        broker.stop()
    return results


async def run_batch(store: MySQLStore, dsn: str, bootstrap: str, reader: Reader, folder: str, events: int,
                    batch_size: int, rounds: int) -> KafkaProcessResult:  # fmt: skip
    config = write_config(folder, dsn, bootstrap, batch_size)
    migrate = procs.room_outbox("--config", config, "migrate", env={}, stdout=subprocess.DEVNULL)
    # Waited for off the event loop: the loop closes this process's own migrate connection, and
    # with it the migrate lock, only while it runs.
    if await anyio.to_thread.run_sync(functools.partial(migrate.wait, timeout=120)):
        raise RuntimeError(f"room-outbox migrate exited with {migrate.returncode}")
    proc = start(config, f"bench-t-{batch_size}")
    try:
        await tailed(store, reader, proc, 1, f"t{batch_size}-probe-", 60.0)  # it tails
        await tailed(store, reader, proc, events, f"t{batch_size}-warm-")
        batch = await messages(store, last=events)

        async def by_process(n: int) -> tuple[float, float]:
            return await tailed(store, reader, proc, events, f"t{batch_size}-{n}-")

        async def by_bare(n: int) -> tuple[float, float]:
            return await bare_round(bootstrap, reader, batch, batch_size)

        measured, baseline = await alternate(rounds, by_process, by_bare)
    finally:
        procs.stop(proc)
    return KafkaProcessResult(batch_size, events, measured, baseline)
