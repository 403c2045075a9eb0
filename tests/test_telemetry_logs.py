"""Logs: JSON lines with seed 000's fields, console lines for people, secrets masked in both."""

from __future__ import annotations

import io
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from im_support import im_dispatcher, im_router
from support import envelope, insert_events

from room_outbox.observability.logs import ConsoleFormatter, RepeatedLibraryLines, configure_logging, span_stream
from room_outbox.observability.redaction import Redactor
from room_outbox.observability.telemetry import telemetry_from_environment
from room_outbox.plugins.tencent_im.fake import FakeTencentIM, serve_fake_im
from room_outbox.store.backends.mysql import MySQLStore

MONITOR = Path(__file__).parents[1] / "docs" / "how-to" / "monitor.md"


def test_json_lines_carry_seed_000_fields_and_mask_secrets() -> None:
    stream = io.StringIO()
    redactor = Redactor()
    redactor.add("sup3rsecret")
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("INFO", "node-7", redactor, stream)
        logging.getLogger("room_outbox.dispatcher").warning(
            "delivery failed",
            extra={"event_id": "e1", "event_type": "RoomGiftSent", "room_id": "r_1", "retry_count": 2,
                   "status": "pending", "error": "usersig=sup3rsecret rejected"},
        )  # fmt: skip
        logging.getLogger("room_outbox.dispatcher").debug("not shown at INFO")
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    (line,) = stream.getvalue().splitlines()
    doc = json.loads(line)
    assert doc["worker"] == "room_outbox" and doc["node_id"] == "node-7" and doc["level"] == "warning"
    assert {k: doc[k] for k in ("event_id", "event_type", "room_id", "retry_count", "status")} == {
        "event_id": "e1", "event_type": "RoomGiftSent", "room_id": "r_1", "retry_count": 2, "status": "pending",
    }  # fmt: skip
    assert doc["error"] == "usersig=[REDACTED] rejected"
    assert "sup3rsecret" not in line


def test_a_librarys_line_repeated_word_for_word_passes_once_a_minute_with_a_count() -> None:
    """aiokafka logs an ERROR per failed round while the broker is down (a ten-minute outage at
    a one-second poll here): its first line passes, the same line again only once a minute,
    with how many were left out; another line of its passes, and our own lines all do."""
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    unreachable = 'Unable connect to "127.0.0.1:9": [Errno 111] Connect call failed'
    try:
        configure_logging("INFO", "node-7", Redactor(), stream)
        ((repeats,),) = [[f for f in h.filters if isinstance(f, RepeatedLibraryLines)] for h in root.handlers]
        second = 0.0
        repeats.clock = lambda: second
        for tick in range(600):
            second = float(tick)
            logging.getLogger("aiokafka").error(unreachable)
            logging.getLogger("room_outbox.tail").error("ours")
        logging.getLogger("aiokafka.conn").error("another line")
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    library = [line for line in lines if line["msg"] == unreachable]
    assert len(library) == 10  # at 0 s, 60 s, ..., 540 s
    assert "repeated" not in library[0] and [line["repeated"] for line in library[1:]] == [59] * 9
    assert [line["msg"] for line in lines].count("ours") == 600
    assert lines[-1]["msg"] == "another line"


def test_database_driver_and_exporter_lines_are_bounded_too_even_with_numbers_that_change() -> None:
    """psycopg's pool logs a WARNING per failed connection (a dozen in four seconds while a
    PgBouncer restarts), OpenTelemetry's exporters one per retry with its jittered delay and
    an object's address in the text: lines that differ only in their numbers are one line,
    passed once a minute with how many were left out. Different words still pass."""
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    refused = "error connecting in 'room-outbox': connection failed: port 6432 failed: Connection refused"
    try:
        configure_logging("INFO", "node-7", Redactor(), stream)
        ((repeats,),) = [[f for f in h.filters if isinstance(f, RepeatedLibraryLines)] for h in root.handlers]
        second = 0.0
        repeats.clock = lambda: second
        for tick in range(121):
            second = tick / 2  # a minute, then the first line past it
            logging.getLogger("psycopg.pool").warning(refused)
            logging.getLogger("opentelemetry.exporter.otlp.proto.http.trace_exporter").warning(
                "Transient error %s encountered while exporting spans batch, retrying in %.2fs.",
                f"NewConnectionError('<HTTPConnection object at 0x7f{tick * 0xBEEF:08x}>: [Errno 111] refused')",
                0.8 + tick % 7 / 10,
            )
        logging.getLogger("psycopg.pool").warning("error connecting in 'room-outbox': authentication failed")
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    pool = [line for line in lines if line["logger"] == "psycopg.pool"]
    exporter = [line for line in lines if line["logger"].startswith("opentelemetry")]
    assert [line["msg"] for line in pool] == [
        refused,
        refused,
        "error connecting in 'room-outbox': authentication failed",
    ]
    assert [line.get("repeated") for line in pool] == [None, 119, None]
    assert len(exporter) == 2 and "retrying in 0.80s" in exporter[0]["msg"], [line["msg"] for line in exporter]
    assert exporter[1]["repeated"] == 119


class Terminal(io.StringIO):
    """A stream that says it is a terminal, as stderr does in an interactive shell."""

    def isatty(self) -> bool:
        return True


def _log_to(stream: io.StringIO, redactor: Redactor | None = None, **options: Any) -> None:
    """Configure logging onto ``stream``, log a lifecycle line, an event line and an exception."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("INFO", "node-7", redactor or Redactor(), stream, **options)
        log = logging.getLogger("room_outbox.dispatcher")
        logging.getLogger("room_outbox.app").info("worker started", extra={"lifecycle": "worker_started"})
        log.warning(
            "delivery failed",
            extra={"error_class": "timeout", "event_id": "e1", "event_type": "RoomGiftSent", "room_id": "r_1",
                   "retry_count": 2, "status": "pending", "error": "usersig=sup3rsecret rejected", "lane": "main"},
        )  # fmt: skip
        try:
            raise RuntimeError("token sup3rsecret refused")
        except RuntimeError:
            log.exception("sink failed")
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
        logging.captureWarnings(False)


def test_console_lines_are_short_aligned_key_fields_first_and_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    stream = io.StringIO()  # not a terminal: no colour, even with console asked for
    redactor = Redactor()
    redactor.add("sup3rsecret")
    _log_to(stream, redactor, log_format="console")
    started, failed, exception, *traceback = stream.getvalue().splitlines()
    assert re.fullmatch(r"\d\d:\d\d:\d\d\.\d{3} INFO  app {11}worker started {13}lifecycle=worker_started", started)
    assert failed.endswith(
        "WARN  dispatcher    delivery failed            lane=main event_id=e1 event_type=RoomGiftSent room_id=r_1"
        ' retry_count=2 status=pending error="usersig=[REDACTED] rejected" error_class=timeout'
    )
    assert started.index("worker started") == failed.index("delivery failed")  # columns align
    assert started.index("lifecycle=") == failed.index("lane=")
    assert "ERROR app" not in exception and "ERROR dispatcher    sink failed" in exception
    assert traceback[0] == "Traceback (most recent call last):"
    assert traceback[-1] == "RuntimeError: token [REDACTED] refused"
    assert "sup3rsecret" not in stream.getvalue() and "\x1b[" not in stream.getvalue()
    assert "node-7" not in stream.getvalue()  # the constant fields stay out of a person's way


def test_auto_is_console_on_a_terminal_with_colour_unless_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    terminal = Terminal()
    _log_to(terminal)  # log.format defaults to auto
    lines = terminal.getvalue().splitlines()
    assert not lines[0].startswith("{") and "worker started" in lines[0]
    assert "\x1b[33mWARN \x1b[0m" in lines[1] and "\x1b[31mERROR\x1b[0m" in lines[2]

    monkeypatch.setenv("NO_COLOR", "1")
    plain = Terminal()
    _log_to(plain)
    assert "worker started" in plain.getvalue() and "\x1b[" not in plain.getvalue()

    monkeypatch.setenv("NO_COLOR", "")  # set but empty: colour stays (no-color.org)
    empty = Terminal()
    _log_to(empty)
    assert "\x1b[" in empty.getvalue()


def test_auto_is_json_when_not_a_terminal_and_json_can_be_forced_on_one() -> None:
    piped = io.StringIO()
    _log_to(piped)
    forced = Terminal()
    _log_to(forced, log_format="json")
    for stream in (piped, forced):
        docs = [json.loads(line) for line in stream.getvalue().splitlines()]
        assert [d["msg"] for d in docs] == ["worker started", "delivery failed", "sink failed"]
        assert "RuntimeError: token sup3rsecret refused" in docs[2]["exc"]  # no redactor registered here


def test_an_unknown_format_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown log format 'xml'"):
        _log_to(io.StringIO(), log_format="xml")


def test_console_spans_go_to_stdout_apart_from_the_logs_unless_asked(capsys: pytest.CaptureFixture[str]) -> None:
    logs = Terminal()
    _log_to(logs)
    assert span_stream() is sys.stdout
    telemetry = telemetry_from_environment("n", Redactor(), environ={"OTEL_TRACES_EXPORTER": "console"})
    assert telemetry.tracer is not None
    telemetry.tracer.start_span("room_outbox.deliver RoomGiftSent").end()
    for provider in telemetry._providers:
        provider.shutdown()  # flushes the batch
    assert '"name": "room_outbox.deliver RoomGiftSent"' in capsys.readouterr().out
    assert "room_outbox.deliver" not in logs.getvalue()

    together = Terminal()
    _log_to(together, spans_with_logs=True)
    assert span_stream() is together
    telemetry = telemetry_from_environment("n", Redactor(), environ={"OTEL_TRACES_EXPORTER": "console"})
    assert telemetry.tracer is not None
    telemetry.tracer.start_span("room_outbox.deliver RoomClosed").end()
    for provider in telemetry._providers:
        provider.shutdown()
    assert '"name": "room_outbox.deliver RoomClosed"' in together.getvalue()
    assert "room_outbox.deliver RoomClosed" not in capsys.readouterr().out
    _log_to(io.StringIO())  # back to the default
    assert span_stream() is sys.stdout


@pytest.mark.anyio
async def test_the_console_example_in_the_docs_is_the_line_a_first_timeout_writes(
    store: MySQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    """monitor.md's console example shows an event's first `delivery failed`: it is, but for its
    time, the line the dispatcher writes when a Tencent IM request times out."""
    (example,) = [line for line in MONITOR.read_text().splitlines() if re.match(r"\d\d:.* delivery failed ", line)]
    async with serve_fake_im(FakeTencentIM(seed=3)) as fake:
        fake.set_faults(hang_rate=1.0)
        router = await im_router(fake, request_timeout="200ms")
        try:
            await insert_events(store, [envelope("e1", "RoomGiftSent")])
            with caplog.at_level(logging.WARNING, logger="room_outbox.dispatcher"):
                await im_dispatcher(store, router).run_once()
        finally:
            await router.aclose()
    (failed,) = [r for r in caplog.records if r.getMessage() == "delivery failed"]
    line = ConsoleFormatter(Redactor()).format(failed)
    assert line.partition(" ")[2] == example.partition(" ")[2]
