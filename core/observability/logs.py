"""Logs: JSON lines for machines, short aligned lines for people; secrets masked in both.

``log.format`` chooses: ``json``, ``console``, or ``auto`` (the default): console when the log
stream (stderr) is a terminal, JSON otherwise, so a local ``run`` reads well and a container's
log collector gets JSON without configuration. Either way the whole text goes through the
:class:`~room_outbox.observability.redaction.Redactor` last, so a secret that slipped into a
message, a field or an exception is still masked. Console span and metric exporters write to
stdout, never into the log stream, unless ``log.spans_with_logs`` asks (:func:`span_stream`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import IO, Any

from opentelemetry import trace

from room_outbox.observability.redaction import Redactor
from room_outbox.observability.repeated import REPEAT_EVERY

WORKER = "room_outbox"
#: Library loggers that get ``log.library_level`` instead of ``log.level``, their repeated
#: lines bounded (:class:`RepeatedLibraryLines`).
LIBRARY_LOGGERS = ("httpx", "httpcore", "aiohttp", "aiokafka", "aiomysql", "psycopg", "opentelemetry", "asyncio")
#: The fields of an event line, shown first and in this order by the console format.
KEY_FIELDS = ("lane", "event_id", "event_type", "room_id", "sink", "retry_count", "status", "error")
FORMATS = ("auto", "console", "json")

_RECORD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}
_span_stream: IO[str] | None = None


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    """What the caller passed as ``extra=``."""
    return {k: v for k, v in vars(record).items() if k not in _RECORD_ATTRS and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    """One object per line. Every line carries ``worker`` ("room_outbox") and ``node_id``;
    event lines add ``event_id``, ``event_type``, ``room_id``, ``retry_count``, ``status``,
    ``error`` (passed as ``extra=``), and a line written inside a traced delivery adds
    ``trace_id`` and ``span_id``."""

    def __init__(self, node_id: str, redactor: Redactor) -> None:
        super().__init__()
        self.node_id = node_id
        self.redactor = redactor

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "worker": WORKER,
            "node_id": self.node_id,
            **_fields(record),
        }
        span_context = trace.get_current_span().get_span_context()
        if span_context.is_valid:  # ties a sink's log line to the attempt's span
            doc["trace_id"] = trace.format_trace_id(span_context.trace_id)
            doc["span_id"] = trace.format_span_id(span_context.span_id)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return self.redactor.redact(json.dumps(doc, default=str, ensure_ascii=False))


#: Level names cut to one width, so the columns after them align.
_LEVELS = {"DEBUG": "DEBUG", "INFO": "INFO", "WARNING": "WARN", "ERROR": "ERROR", "CRITICAL": "CRIT"}
_COLOURS = {"DEBUG": "2", "WARNING": "33", "ERROR": "31", "CRITICAL": "1;31"}
_LOGGER_WIDTH = 13
_MESSAGE_WIDTH = 26


class ConsoleFormatter(logging.Formatter):
    """One short line per record, columns aligned:
    ``12:04:05.123 WARN  dispatcher    delivery failed           event_id=e1 ...``: the UTC
    time, the level, the logger (less ``room_outbox.``) and the message in columns, then the
    event's key fields first and any other field after them as ``key=value``; a traceback
    follows on its own lines. Colour only on a terminal and only when ``NO_COLOR`` is unset or
    empty (:func:`wants_colour`)."""

    def __init__(self, redactor: Redactor, colour: bool = False) -> None:
        super().__init__()
        self.redactor = redactor
        self.colour = colour

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}"
        level = _LEVELS.get(record.levelname, record.levelname[:5]).ljust(5)
        logger = record.name.removeprefix(f"{WORKER}.").ljust(_LOGGER_WIDTH)
        fields = _fields(record)
        ordered = [k for k in KEY_FIELDS if k in fields] + [k for k in fields if k not in KEY_FIELDS]
        pairs = " ".join(f"{k}={_value(fields[k])}" for k in ordered)
        message = record.getMessage()
        line = f"{message.ljust(_MESSAGE_WIDTH)} {pairs}" if pairs else message
        if self.colour:
            code = _COLOURS.get(record.levelname)
            level = f"\x1b[{code}m{level}\x1b[0m" if code else level
            stamp = f"\x1b[2m{stamp}\x1b[0m"
        text = f"{stamp} {level} {logger} {line}".rstrip()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return self.redactor.redact(text)


def _value(value: object) -> str:
    """A field's value, quoted when a space or quote would blur where it ends."""
    text = str(value)
    return json.dumps(text, ensure_ascii=False) if not text or any(c in text for c in ' "=\n\t') else text


def wants_colour(stream: IO[str], environ: Mapping[str, str] | None = None) -> bool:
    """Colour on a terminal, unless ``NO_COLOR`` is set to anything but empty."""
    env = os.environ if environ is None else environ
    return _is_terminal(stream) and not env.get("NO_COLOR")


def _is_terminal(stream: IO[str]) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


#: Numbers in a library's line (a delay, a port, an object's address): lines that differ only
#: in them are the same line (see :class:`RepeatedLibraryLines`).
_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+")


class RepeatedLibraryLines(logging.Filter):
    """A library's line (:data:`LIBRARY_LOGGERS`) that comes back the same but for its numbers:
    the first passes, the same line again within ``interval`` is left out and counted, and the
    first one after that passes with ``repeated``, how many were left out since the line before.
    A library logs per attempt (aiokafka's ``Unable connect to ...`` once per failed round,
    psycopg's pool per failed connection, an OpenTelemetry exporter per retry with its jittered
    delay in the text: ``retrying in 1.07s``): without this, a line or more per second while an
    outage lasts, as many as the lanes' own lines would be without
    :class:`~room_outbox.observability.repeated.RepeatedFailure`."""

    #: Different lines remembered at most: beyond it, those not seen within ``interval`` go.
    capacity = 1_000

    def __init__(self, interval: float = REPEAT_EVERY, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval = interval
        self.clock = clock
        #: Each line's key → when it last passed, and how many were left out since.
        self._lines: dict[tuple[str, int, str], tuple[float, int]] = {}
        self._lock = threading.Lock()  # records come from any thread

    def filter(self, record: logging.LogRecord) -> bool:
        if not any(record.name == name or record.name.startswith(f"{name}.") for name in LIBRARY_LOGGERS):
            return True
        key = (record.name, record.levelno, _NUMBERS.sub("#", record.getMessage()))
        now = self.clock()
        with self._lock:
            passed, left_out = self._lines.get(key, (None, 0))
            if passed is not None and now - passed < self.interval:
                self._lines[key] = (passed, left_out + 1)
                return False
            if left_out:
                record.repeated = left_out
            self._lines[key] = (now, 0)
            if len(self._lines) > self.capacity:
                self._lines = {k: v for k, v in self._lines.items() if now - v[0] < self.interval}
        return True


class BackgroundHandler(logging.Handler):
    """Writes the formatted lines to a stream from a thread of its own, so that the process
    never waits for its log stream. A stream that blocks (a log collector that stopped reading,
    Docker's log driver in its blocking mode with its backend down, a terminal paused with
    Ctrl-S) would otherwise stop the event loop, and with it every lane, lease renewal and
    heartbeat. A line that finds :attr:`capacity` lines waiting is dropped and counted; once
    the stream takes lines again, a line says how many were lost since the last such line. At
    exit the lines still waiting get :data:`FLUSH_WAIT` seconds to be written."""

    #: Lines waiting for the stream at most (a few MB).
    capacity = 10_000

    def __init__(self, stream: IO[str], formatter: logging.Formatter) -> None:
        super().__init__()
        self.setFormatter(formatter)
        self.stream = stream
        self._lines: queue.Queue[str | None] = queue.Queue(self.capacity)
        self._dropped = 0
        self._counting = threading.Lock()
        self._writer = threading.Thread(target=self._write, name="room-outbox-log-writer", daemon=True)
        self._writer.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        try:
            self._lines.put_nowait(line)
        except queue.Full:
            with self._counting:
                self._dropped += 1

    def _write(self) -> None:
        while (line := self._lines.get()) is not None:
            try:
                self.stream.write(line + "\n")
                with self._counting:
                    dropped, self._dropped = self._dropped, 0
                if dropped:
                    lost = logging.LogRecord(
                        "room_outbox.logs", logging.WARNING, __file__, 0,
                        "%d log lines dropped: the log stream did not take them in time", (dropped,), None,
                    )  # fmt: skip
                    self.stream.write(self.format(lost) + "\n")
                self.stream.flush()
            except (OSError, ValueError):  # the stream closed: nothing left to tell it
                pass
            finally:
                self._lines.task_done()
        self._lines.task_done()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the lines so far are written, at most ``timeout`` (default
        :data:`FLUSH_WAIT`) seconds: a stream that stays blocked never holds the process."""
        deadline = time.monotonic() + (FLUSH_WAIT if timeout is None else timeout)
        with self._lines.all_tasks_done:
            while self._lines.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0 or not self._writer.is_alive():
                    return
                self._lines.all_tasks_done.wait(left)

    def close(self) -> None:
        self.flush()
        with contextlib.suppress(queue.Full):  # the stream blocked: the writer (a daemon) is left to it
            self._lines.put_nowait(None)
        super().close()


#: Seconds the lines still waiting get to be written when the process ends.
FLUSH_WAIT = 5.0


def _blocks(stream: IO[str]) -> bool:
    """Whether writes to ``stream`` may block the process: an operating-system file (a pipe, a
    terminal, a file), not an in-memory buffer (a test's StringIO)."""
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return True


def flush_logs() -> None:
    """Write what the log handlers hold (bounded): before a line printed straight to stderr."""
    for handler in logging.getLogger().handlers:
        handler.flush()


def configure_logging(
    level: str,
    node_id: str,
    redactor: Redactor,
    stream: IO[str] | None = None,
    library_level: str = "WARNING",
    log_format: str = "auto",
    spans_with_logs: bool = False,
) -> None:
    """Route every logger to ``stream`` (stderr by default) in ``log_format``, through one
    handler whose formatter redacts the whole text: a library's record is masked like our own.
    Libraries log at ``library_level``, a line repeated (but for its numbers) once per interval at most
    (:class:`RepeatedLibraryLines`); Python warnings become log records too."""
    global _span_stream
    if log_format not in FORMATS:
        raise ValueError(f"unknown log format {log_format!r} (allowed: {', '.join(FORMATS)})")
    out = stream or sys.stderr
    console = log_format == "console" or (log_format == "auto" and _is_terminal(out))
    formatter = ConsoleFormatter(redactor, wants_colour(out)) if console else JsonFormatter(node_id, redactor)
    handler: logging.Handler
    if _blocks(out):
        handler = BackgroundHandler(out, formatter)
    else:
        handler = logging.StreamHandler(out)
        handler.setFormatter(formatter)
    root = logging.getLogger()
    for replaced in root.handlers:
        if isinstance(replaced, BackgroundHandler):
            replaced.close()
    handler.addFilter(RepeatedLibraryLines())
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(library_level)
    logging.captureWarnings(True)
    _span_stream = out if spans_with_logs else None
    # An exception nobody caught would be printed raw by the interpreter; as a log record its
    # traceback is redacted like the rest.
    sys.excepthook = log_uncaught
    threading.excepthook = lambda args: log_uncaught(args.exc_type, args.exc_value, args.exc_traceback)


def span_stream() -> IO[str]:
    """Where the console span and metric exporters write: stdout, or the log stream when
    ``log.spans_with_logs`` asked for it. Apart, ``2>run.log`` or ``>spans.json`` separates
    them."""
    return _span_stream or sys.stdout


def log_uncaught(exc_type: type[BaseException], exc: BaseException | None, traceback: TracebackType | None) -> None:
    """``sys.excepthook``: the uncaught exception as an error record (Ctrl-C stays quiet)."""
    if issubclass(exc_type, KeyboardInterrupt):
        return
    logging.getLogger("room_outbox").critical(
        "uncaught exception: %s", exc_type.__name__, exc_info=(exc_type, exc or exc_type(), traceback)
    )
