"""Table profiles: which table holds the outbox and which status words its producer and
room-outbox write there. Chosen by ``database.profile`` (and ``database.table``): :data:`V1`
(the default), :data:`ROOM_CELL` or :data:`SILK`.

Every profile parks as ``failed`` and cancels as ``cancelled``. The lanes of their own keep
their state in room-outbox's own tables and always speak ``v1``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from room_outbox.store.schema.outbox import TABLE


@dataclass(frozen=True)
class Profile:
    name: str
    table: str
    #: What the producer inserts.
    fresh: str
    #: After a failed attempt: claimable again once ``lock_until_ms`` has passed.
    retry: str
    #: While a claim holds the row (until ``lock_until_ms``, then claimable again).
    in_flight: str
    delivered: str
    parked: str = "failed"
    cancelled: str = "cancelled"
    # -- the columns (SQL expressions where the table has no such column) ----------------------
    #: A key that rises with inserts (per-room order and lane feeding compare it).
    key: str = "id"
    event_id: str = "event_id"
    event_type: str = "event_type"
    room_id: str = "room_id"
    #: The producer's column ``room_id`` is read from, as errors about an empty one name it.
    room_column: str = "room_id"
    app_code: str = "app_code"
    envelope: str = "envelope"
    #: :attr:`envelope` is built from the row's own columns (SQL), so it cannot differ from
    #: them: a relay need not read them to compare.
    envelope_from_columns: bool = False
    attempts: str = "retry_count"
    #: Not claimable before this time (a lease's end, a retry's time).
    lock: str = "lock_until_ms"
    updated: str = "updated_at_ms"
    created: str = "created_at_ms"
    #: Times are epoch-ms integers; False: timestamps (``timestamptz``, or ``timestamp`` without
    #: time zone: wall times in the session's zone, see :func:`epoch_ms`).
    ms_columns: bool = True
    #: ``lock`` of a row no claim holds and no retry waits for: due at once.
    lock_cleared: str = "0"
    #: The attempts after which a failed row is parked, per row (SQL); None: the dispatcher
    #: decides (``outbox_worker.retry.max_attempts``). Read with each claimed row, so that the
    #: dispatcher parks the failure that reaches it and says so (log, metrics); the result's
    #: write applies it again, for a limit lowered while the row was in flight.
    attempts_limit: str | None = None
    #: Databases the profile's table exists on; empty: all.
    databases: tuple[str, ...] = ()
    #: Columns the envelope takes as JSON values (json or jsonb on the server).
    json_columns: tuple[str, ...] = ()
    #: Who writes the table's rows, as messages name it ("``room_outbox.status`` is room-service's").
    producer: str = "room-service"
    #: The producer's own worker claims rows too: it writes ``in_flight`` and ``updated`` but
    #: neither ``worker_id`` nor a lease (silk's ``MarkSending``). See :meth:`producers_claim_ended`.
    producer_claims: bool = False
    #: ``attempts`` counts every attempt, the successful one too (silk's ``MarkResult``); False:
    #: the failed ones only (room-service's ``retry_count``).
    counts_success: bool = False

    @property
    def open(self) -> tuple[str, ...]:
        """Statuses of rows still to deliver: claimable once due."""
        return tuple(dict.fromkeys((self.fresh, self.retry, self.in_flight)))

    @property
    def waiting(self) -> tuple[str, ...]:
        """Open rows no claim holds: what requeue and cancel may change besides parked rows."""
        return tuple(dict.fromkeys((self.fresh, self.retry)))

    def is_open(self, column: str = "status") -> str:
        """SQL: ``column`` is one of :attr:`open` (the statuses are constants, never input)."""
        return in_list(column, self.open)

    def is_waiting(self, column: str = "status") -> str:
        return in_list(column, self.waiting)

    @property
    def attempts_made(self) -> str:
        """SQL: the row's attempts so far. A producer may leave a nullable attempts column NULL
        (its default): that is no attempt yet, where NULL + 1 would stay NULL for ever."""
        return f"COALESCE({self.attempts}, 0)"

    def released(self) -> str:
        """SQL: the status a row goes back to when its claim drops it unattempted."""
        if self.fresh == self.retry:
            return f"'{self.fresh}'"
        return f"CASE WHEN {self.attempts_made} = 0 THEN '{self.fresh}' ELSE '{self.retry}' END"

    def after_failure(self) -> str:
        """SQL: the status of a row whose attempt failed (before its attempts are counted)."""
        if self.attempts_limit is None:
            return f"'{self.retry}'"
        return f"CASE WHEN {self._last_attempt} THEN '{self.parked}' ELSE '{self.retry}' END"

    def lock_after_failure(self, retry_at: str) -> str:
        """SQL: the ``lock`` of a row whose attempt failed: ``retry_at``, or the cleared lock
        where its own attempts limit parks it (as every parked row has)."""
        if self.attempts_limit is None:
            return retry_at
        return f"CASE WHEN {self._last_attempt} THEN {self.lock_cleared} ELSE {retry_at} END"

    @property
    def _last_attempt(self) -> str:
        """SQL: the failed attempt (before it is counted) used up the row's own attempts limit."""
        return f"{self.attempts_made} + 1 >= {self.attempts_limit}"

    def producers_claim_ended(self, older_than: str) -> str:
        """SQL, true but for a row the producer's own worker holds (:attr:`producer_claims`):
        ``in_flight`` with no ``worker_id`` (room-outbox's claims always write one), changed
        since ``older_than`` (SQL, a time in the table's type). Its ``lock`` is still the due
        time the producer claimed it at, not a lease's end: the row is left to that worker until
        it was last changed a lease ago, and then taken over, as a worker that died would leave
        it ``in_flight`` for ever. A NULL ``updated`` counts as old: its age cannot be told.
        Empty where the producer claims nothing itself."""
        if not self.producer_claims:
            return ""
        return (
            f"(status <> '{self.in_flight}' OR worker_id IS NOT NULL OR {self.updated} IS NULL"
            f" OR {self.updated} <= {older_than})"
        )

    @property
    def status_owned(self) -> str:
        """Whose the table's ``status`` is while the main lane is off here: its producer's."""
        return f"{self.table}.status is {self.producer}'s"

    @property
    def fresh_at_cleared_lock(self) -> bool:
        """Whether rows no claim has taken yet (the producer's) all sit at one ``lock`` value,
        a constant: then the claim index orders them by key (v1, room_cell; not silk, whose
        rows start at their own ``next_attempt_at``)."""
        return self.lock_cleared == "0"

    def ms(self, value: str) -> str:
        """SQL: an epoch-ms value (a placeholder or a literal) in the table's time type."""
        return value if self.ms_columns else f"to_timestamp({value} / 1000.0)"

    def as_ms(self, column: str) -> str:
        """SQL: a time column read as epoch ms."""
        return column if self.ms_columns else epoch_ms(column)

    @property
    def time_columns(self) -> tuple[str, ...]:
        """The row's times: its creation, its last update and ``lock`` (each read by :meth:`as_ms`)."""
        return (self.created, self.updated, self.lock)


def epoch_ms(column: str) -> str:
    """SQL: a PostgreSQL timestamp read as epoch ms. A ``timestamp`` without time zone is a wall
    time, which every write (``now()``, ``to_timestamp(…)``) and every comparison with a
    ``timestamptz`` takes in the session's zone: read in that zone too (EXTRACT alone would take
    it as UTC). For a ``timestamptz`` the cast is no operation: the planner drops it."""
    return f"CAST(EXTRACT(EPOCH FROM CAST({column} AS timestamptz)) * 1000 AS BIGINT)"


def in_list(column: str, statuses: tuple[str, ...]) -> str:
    if len(statuses) == 1:
        return f"{column} = '{statuses[0]}'"
    quoted = ", ".join(f"'{status}'" for status in statuses)
    return f"{column} IN ({quoted})"


#: room-service's V1 ``room_outbox``: a row is ``pending`` until delivered (``published``),
#: also while leased and while waiting for its retry.
V1 = Profile("v1", TABLE, fresh="pending", retry="pending", in_flight="pending", delivered="published")
#: The same table and columns with the Room Cell vocabulary: ``pending`` → ``delivering``
#: (claimed: ``worker_id`` and ``lock_until_ms`` set; taken over once ``lock_until_ms``
#: passes) → ``delivered``, or ``retryable`` (due again at ``lock_until_ms``) → ``failed``.
ROOM_CELL = Profile(
    "room_cell", TABLE, fresh="pending", retry="retryable", in_flight="delivering", delivered="delivered"
)
#: silk's outbox event, as room-outbox delivers it: the aggregate is the "room" (per-room
#: order, IM group), in the default app (app_code ""); its type travels along as
#: ``aggregate_type``; occurred_at is the row's creation time.
SILK_ENVELOPE = (
    "CAST(json_build_object('event_id', event_id, 'event_type', event_type, 'app_code', '',"
    " 'room_id', COALESCE(aggregate_id, ''), 'aggregate_type', aggregate_type,"
    f" 'occurred_at_ms', {epoch_ms('created_at')}, 'payload', payload) AS TEXT)"
)
#: silk's ``outbox_events`` (PostgreSQL): ``pending`` and ``retry`` rows are claimable once
#: ``next_attempt_at`` is due; ``sending`` while claimed: by room-outbox (``worker_id`` set,
#: ``next_attempt_at`` the lease's end) or by silk's own worker (neither written; see
#: :meth:`Profile.producers_claim_ended`); ``sent``; ``failed`` once the row's own
#: ``max_attempts`` are used up; ``cancelled`` is never touched. ``attempts`` counts the
#: successful attempt too, as silk's does. migrate adds ``outbox_seq`` (a rising key) and
#: ``worker_id``.
SILK = Profile(
    "silk",
    "outbox_events",
    fresh="pending",
    retry="retry",
    in_flight="sending",
    delivered="sent",
    key="outbox_seq",
    room_id="COALESCE(aggregate_id, '')",
    room_column="aggregate_id",
    app_code="''",
    envelope=SILK_ENVELOPE,
    envelope_from_columns=True,
    attempts="attempts",
    lock="next_attempt_at",
    updated="updated_at",
    created="created_at",
    ms_columns=False,
    lock_cleared="now()",
    # silk's rule: a row's own max_attempts, its default (5) where the row says 0 or less
    attempts_limit="CASE WHEN max_attempts > 0 THEN max_attempts ELSE 5 END",
    databases=("postgresql",),
    json_columns=("payload",),
    producer="silk",
    producer_claims=True,
    counts_success=True,
)
PROFILES = {profile.name: profile for profile in (V1, ROOM_CELL, SILK)}


def profile_named(name: str, table: str = "") -> Profile:
    """The profile ``database.profile`` names, on ``database.table`` when given."""
    profile = PROFILES[name]
    return dataclasses.replace(profile, table=table) if table else profile
