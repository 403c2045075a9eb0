"""What an operator asks of the outbox: the backlog, ``room-outbox status`` and ``inspect``.

Every query here reads through ``store.transaction()`` and stays on an index where it runs
often: :func:`sample_backlog` (the metrics timer) is a range count on
``idx_room_outbox_status_id (status, id)`` plus one primary-key lookup. The status report
reads the pending rows themselves (retry counts, errors, leases): it is for a person at a
terminal, not for a timer.
"""

from __future__ import annotations

import json
import time
import unicodedata
from typing import IO, Any

from room_outbox.consume.ops import consumer_overview, consumer_states, format_overview, format_states
from room_outbox.envelope import EnvelopeError, parse_envelope
from room_outbox.store.clock import now_ms
from room_outbox.store.operator.reports import (
    StatusReport,
    event_row,
    lane_row,
    lane_statuses,
    status_report,
    tail_parked_row,
)
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.profiles import V1, Profile


def _now_ms() -> int:
    """The cluster's time: the leases and due times shown were written on it."""
    return now_ms()


# -- room-outbox status -----------------------------------------------------------------------


# -- human output ------------------------------------------------------------------------------

#: Format characters kept as they are: the joiner inside emoji sequences.
_KEPT_FORMAT_CHARACTERS = frozenset("\u200d")


def printable(value: object, keep_newlines: bool = False) -> str:
    """``value`` as text safe for a terminal: control characters (ESC sequences, carriage
    returns, newlines unless ``keep_newlines``...), line separators and invisible format
    characters (bidirectional overrides, zero-width spaces) written as ``\\xNN`` or
    ``\\uNNNN``. Row values are producer data: printed raw, they could rewrite the screen or
    hide text from the operator reading it. JSON output needs none of this: JSON escapes."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(char if (keep_newlines and char == "\n") or not _hidden(char) else _escaped(char) for char in text)


def _hidden(char: str) -> bool:
    category = unicodedata.category(char)
    return category in ("Cc", "Zl", "Zp") or (category == "Cf" and char not in _KEPT_FORMAT_CHARACTERS)


def _escaped(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def format_status(report: StatusReport) -> str:
    now = _now_ms()
    if not report.im_lane:
        lines = ["IM lane               disabled: room_outbox.status is room-service's, not a backlog here"]
        lines += _format_lanes(report)
        return "\n".join(lines)
    lines = [
        f"pending               {report.pending}",
        f"oldest pending        {format_time(now - report.oldest_pending_age_ms, now) if report.pending else '-'}",
        f"waiting for retry     {report.waiting_for_retry}",
        f"leased now            {report.leased}",
    ]
    lines += [f"{status:<22}{count}" for status, count in sorted(report.other_statuses.items())]
    lines += ["", "retries  pending rows"]
    lines += [f"{label:>7}  {rows}" for label, rows in report.retry_histogram.items()]
    lines += ["", "lease holders"]
    if report.holders:
        lines.append(f"  {'node':<40} {'claims':>6} {'rows':>6}  lease ends")
        lines += [
            f"  {printable(h.node):<40} {h.claims:>6} {h.rows:>6}  {format_time(h.lease_until_ms, now)}"
            for h in report.holders
        ]
    else:
        lines.append("  (none)")
    lines += _format_lanes(report)
    lines += ["", "most frequent last_error (pending rows)"]
    if report.top_errors:
        lines += [f"  {rows:>6}  {printable(error)}" for error, rows in report.top_errors]
    else:
        lines.append("  (none)")
    return "\n".join(lines)


def format_time(epoch_ms: int, now_ms: int) -> str:
    """``2026-12-01 09:01:02 (3 min ago)`` or ``(in 25 s)``: local time, for a person; the
    ``--json`` output keeps the epoch milliseconds."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch_ms / 1000))
    return f"{stamp} ({format_relative(epoch_ms - now_ms)})"


def format_relative(delta_ms: int) -> str:
    """``3 min ago`` for a negative difference, ``in 3 min`` for a positive one."""
    amount = format_age(abs(delta_ms))
    return f"{amount} ago" if delta_ms <= 0 else f"in {amount}"


def format_age(ms: float) -> str:
    """A duration in milliseconds as a person reads it, in whole units of the largest that
    fits: ``25 s``, ``3 min``, ``2 h``, ``7 d`` (negative: ``0 s``). Every command's ages and
    waits use it."""
    seconds = int(max(0, ms)) // 1000
    unit, size = next(((unit, size) for unit, size in _UNITS if seconds >= size), ("s", 1))
    return f"{seconds // size} {unit}"


_UNITS = (("d", 86400), ("h", 3600), ("min", 60), ("s", 1))


#: Row columns that hold an epoch-ms time (0: none).
TIME_COLUMNS = ("created_at_ms", "updated_at_ms", "lock_until_ms")


def _format_lanes(report: StatusReport) -> list[str]:
    if not report.lanes:
        return []
    lines = ["", f"  {'lane':<20} {'fed through id':>14} {'unfed':>7} {'pending':>8} {'parked':>7}"]
    lines += [
        f"  {printable(x.lane):<20} {x.fed_through_id:>14} {x.unfed:>7} {x.pending:>8} {x.parked:>7}"
        for x in report.lanes
    ]
    return lines


# -- room-outbox inspect ----------------------------------------------------------------------


async def inspect_event(store: SQLStore, event_id: str) -> dict[str, Any] | None:
    """The row of ``event_id`` with its parsed envelope (or why it does not parse) and a
    sentence on its delivery state; ``None`` when no row has that event_id."""
    p = store.profile
    found = await event_row(store, event_id)
    if found is None:
        return None
    row, seen = found
    row.pop("envelope", None)  # shown parsed below
    raw = seen["envelope"]
    doc: dict[str, Any] = {"row": row}
    try:
        envelope = parse_envelope(raw)
    except EnvelopeError as exc:
        doc["envelope_error"] = str(exc)
        doc["envelope_raw"] = raw.decode("utf-8", "replace") if isinstance(raw, bytes | bytearray) else raw
    else:
        doc["envelope"] = envelope.model_dump(mode="json", exclude_none=True)
        mismatches = [
            f"envelope {name} {getattr(envelope, name)!r} differs from the row's {seen[name]!r}"
            for name in ("event_id", "event_type", "room_id", "app_code")
            if getattr(envelope, name) != seen[name] and not (name == "app_code" and seen[name] == "")
        ]
        if mismatches:
            doc["envelope_error"] = "; ".join(mismatches)
    now = _now_ms()
    doc["state"] = describe_state(row, now, p, int(seen["lock_ms"] or 0))
    lanes = await _lane_states(store, int(seen["key"]), now)
    if lanes:
        doc["lanes"] = lanes
    return doc


async def _lane_states(store: SQLStore, outbox_id: int, now: int) -> dict[str, str]:
    """The event's state in each lane of its own (same vocabulary as the IM lane's)."""
    states: dict[str, str] = {}
    for lane in await lane_statuses(store):
        found = await lane_row(store, lane.lane, outbox_id)
        parked = await tail_parked_row(store, lane.lane, outbox_id)
        if parked is not None:  # a tailing lane passed over it
            states[lane.lane] = (
                f"{parked['status']} by the tailing lane: {parked['last_error']}"
                f" (`room-outbox requeue --lane {lane.lane}` sends it again)"
            )
        elif found is not None:
            states[lane.lane] = describe_state(found, now)
        elif outbox_id > lane.fed_through_id:
            states[lane.lane] = "not fed to this lane yet"
        else:
            states[lane.lane] = "not in this lane (before its start, or cleaned up)"
    return states


def describe_state(row: dict[str, Any], now: int, words: Profile = V1, lock_until: int | None = None) -> str:
    """A sentence on a row's delivery state, in ``words``' vocabulary (lanes speak ``v1``);
    ``lock_until``: the row's lock in epoch ms when its table keeps it otherwise."""
    status = row["status"]
    retries = row[words.attempts]
    if lock_until is None:
        lock_until = int(row.get("lock_until_ms") or 0)
    if status == words.delivered:
        return f"{status}: delivered (or pushed by room-service itself); nothing left to do"
    if status == words.parked:
        return f"parked after {retries} attempt(s): never retried until `room-outbox requeue`"
    if status == words.cancelled:
        return "cancelled by an operator: never delivered"
    if status not in words.open:
        return f"status {status!r}: not a status of table profile {words.name}"
    if row.get("worker_id") and lock_until > now:
        return f"in flight: leased by {row['worker_id']} for another {format_age(lock_until - now)}"
    if lock_until > now:
        return f"waiting: failed {retries} time(s), next attempt in {format_age(lock_until - now)}"
    if row.get("worker_id"):
        return f"due: the lease of {row['worker_id']} expired; the next scan takes it over"
    return "due: the next scan claims it" + (f" (failed {retries} time(s) so far)" if retries else "")


def format_inspection(doc: dict[str, Any]) -> str:
    row = doc["row"]
    width = max(len(name) for name in row)
    now = _now_ms()
    lines = [
        f"{name:<{width}}  {printable(value)}"
        + (f"  {format_time(int(value), now)}" if name in TIME_COLUMNS and value else "")
        for name, value in row.items()
    ]
    lines += ["", f"state: {printable(doc['state'])}"]
    lines += [f"lane {printable(lane)}: {printable(state)}" for lane, state in doc.get("lanes", {}).items()]
    lines.append("")
    if "envelope" in doc:
        lines.append("envelope:")
        # JSON escapes C0 controls inside strings; C1 controls and format characters it keeps.
        lines.append(printable(json.dumps(doc["envelope"], indent=2, ensure_ascii=False), keep_newlines=True))
    if "envelope_error" in doc:
        lines.append(f"envelope problem: {printable(doc['envelope_error'])}")
    if "envelope_raw" in doc:
        lines.append(f"raw envelope: {printable(doc['envelope_raw'][:2000])}")
    return "\n".join(lines)


# -- command entry points (called by room_outbox.cli.main) -----------------------------------------


async def status_command(store: SQLStore, as_json: bool, out: IO[str], im_lane: bool = True) -> int:
    report = await status_report(store, im_lane=im_lane)
    consumers = await consumer_overview(store)
    if as_json:
        print(json.dumps({**report.to_json(), "consumers": consumers}, indent=2), file=out)
    else:
        print(format_status(report) + "\n".join(["", *format_overview(consumers)] if consumers else []), file=out)
    return 0


async def inspect_command(store: SQLStore, event_id: str, as_json: bool, out: IO[str], err: IO[str]) -> int:
    doc = await inspect_event(store, event_id)
    consumers = await consumer_states(store, event_id)
    if doc is None and not consumers:
        print(f"room-outbox inspect: no row with event_id {printable(event_id)!r}", file=err)
        return 1
    if as_json:
        print(json.dumps({**(doc or {}), "consumers": consumers}, indent=2, default=str, ensure_ascii=False), file=out)
        return 0
    lines = [format_inspection(doc)] if doc is not None else [f"event {printable(event_id)}: not in room_outbox"]
    print("\n".join([*lines, "", *format_states(consumers)] if consumers else lines), file=out)
    return 0
