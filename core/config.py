"""Settings: one YAML file plus ``ROOM_OUTBOX__SECTION__KEY`` environment overrides.

Environment beats file, file beats defaults. Sink sections (``sinks.<name>``) are kept as
plain mappings here and validated by each sink's own model once the plugins are loaded
(:func:`room_outbox.delivery.routing.enabled_sink_settings`), so a third-party sink brings its own configuration schema.

Bad configuration raises :class:`ConfigError` with one line per problem, each naming the key.
"""

from __future__ import annotations

import copy
import json
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import InitErrorDetails, PydanticCustomError
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from room_outbox.envelope import MAX_ENVELOPE_BYTES
from room_outbox.errors import ConfigurationError

ENV_PREFIX = "ROOM_OUTBOX__"
#: The main lane's name in logs, metrics, ``outbox_worker.lanes`` and ``room-outbox lanes``:
#: the lane whose sinks share ``room_outbox.status`` (Tencent IM and noop in V1).
MAIN_LANE = "main"
#: The main lane's former name, still accepted in ``outbox_worker.lanes`` (with a deprecation
#: line at start-up).
FORMER_MAIN_LANE = "im"
RETRY_STRATEGIES = ("fixed_interval", "linear", "exponential")
ORDERINGS = ("none", "per_room")
MAIN_DEFAULTS = ("all", "known")
#: ``database.query_timeout`` when the configuration says nothing and the lease allows it.
DEFAULT_QUERY_TIMEOUT = 5.0
#: Defaults of ``telemetry.stalled_after_polls`` and ``telemetry.unready_after_failed_rounds``.
STALLED_AFTER_POLLS = 30
UNREADY_AFTER_FAILED_ROUNDS = 3
#: Default of ``cluster.max_clock_skew``, in seconds.
MAX_CLOCK_SKEW = 2.0

_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


#: PostgreSQL's longest identifier in bytes (MySQL's is 64): PostgreSQL silently truncates
#: a longer one, so two derived index names could collide.
MAX_IDENTIFIER = 63
#: The outbox table's longest name: its longest derived names (``idx_<table>_status_id``,
#: ``uk_<table>_outbox_seq``) add 14 characters.
MAX_TABLE_NAME = MAX_IDENTIFIER - len("idx__status_id")
#: The configuration error of :mod:`room_outbox.errors`, under the name this module always had.
ConfigError = ConfigurationError


class InvalidSettings(ConfigurationError):
    """The file and environment do not make settings. ``rest``: the settings with the keys in
    error left out (their defaults in their place), so that ``check-config`` can look for the
    problems beyond them too; None when they cannot be left out (an environment variable's,
    a value wrong across keys, the whole ``sinks`` section)."""

    def __init__(self, message: str, rest: Settings | None) -> None:
        super().__init__(message)
        self.rest = rest


def parse_listen(address: str) -> tuple[str, int]:
    """``host:port``, ``:port`` (loopback) or ``[v6]:port``; raises ``ValueError``. Every
    interface is an explicit choice (``0.0.0.0:port``): the endpoint has no authentication."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{address!r} is not host:port (e.g. 127.0.0.1:9464)")
    return host.strip("[]") or "127.0.0.1", int(port)


#: The longest duration any setting takes: ten years. Longer ones (YAML's ``.inf`` among them)
#: cannot be a time in the database's millisecond columns, nor a wait anyone means.
MAX_DURATION = 3650 * 86400.0


def parse_duration(value: Any) -> float:
    """Seconds from ``"500ms"``, ``"1s"``, ``"2m"``, ``"1h"``, ``"7d"`` or a bare number of
    seconds, at most :data:`MAX_DURATION`."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as '500ms', '1s' or '2m'")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if not match:
            raise ValueError(
                f"{value!r} is not a duration; use a number with ms, s, m, h or d, e.g. '500ms', '1s', '2m', '7d'"
            )
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    if not seconds <= MAX_DURATION:  # NaN too
        raise ValueError(f"{value!r} is longer than any wait room-outbox takes (at most 3650d)")
    return seconds


Duration = Annotated[float, BeforeValidator(parse_duration)]


def _above_zero(value: float) -> float:
    if value <= 0:
        raise ValueError("must be a positive duration")
    return value


#: A :data:`Duration` that must be above zero: zero or less stops start-up, naming the key.
#: (Worker options instead fall back to their default when ≤ 0, as V1 configurations expect.)
PositiveDuration = Annotated[Duration, AfterValidator(_above_zero)]


def _one_of(value: str, allowed: tuple[str, ...], what: str) -> str:
    """``value``, or the first of ``allowed`` when empty; anything else stops start-up."""
    value = value.strip() or allowed[0]
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r} (allowed: {', '.join(allowed)})")
    return value


@dataclass(frozen=True)
class LanePlan:
    """The lanes a configuration runs (without validating sink settings: ``migrate``,
    ``cleanup``, ``status`` and ``lanes`` must not need, say, a Tencent key)."""

    #: The main lane runs: some sink sharing it is enabled. When it does not (room-service
    #: pushes IM itself), ``room_outbox.status`` is room-service's alone: no backlog of
    #: room-outbox's, and retention goes by the lanes that run instead.
    main: bool
    #: Enabled sinks with a lane of their own, sorted.
    own: tuple[str, ...]
    #: Those of ``own`` that tail ``room_outbox`` (sinks keeping order by themselves, with
    #: ``relay: tail``): a cursor and parked rows, no lane table.
    tail: tuple[str, ...] = ()


class Section(BaseModel):
    # A misspelt key is an error, not a silently ignored setting.
    model_config = ConfigDict(extra="forbid")


PROFILES = ("v1", "room_cell", "silk")


class DatabaseSettings(Section):
    """The outbox's database: ``mysql://``, ``postgresql://`` or ``sqlite:///`` (the DSN's
    scheme chooses the store). ``mysql:`` is accepted as this section's former name."""

    dsn: SecretStr = SecretStr("mysql://root:@127.0.0.1:3306/room")
    #: Connections in the pool. Two or more let a claim write the last results beside it, on
    #: a second connection (MariaDB and PostgreSQL); with one, they are written in the claim.
    pool_size: int = Field(default=10, ge=1, le=1000)
    #: Every database call (a transaction: taking a connection, its statements, the commit)
    #: ends within this or fails, and its connection is discarded. Server-side session
    #: limits derive from it (see ``room_outbox.store.deadline``). Default (≤ 0): 5s, or a
    #: quarter of ``outbox_worker.lease`` when that is shorter. Must stay below a third of
    #: the lease (checked by :class:`Settings`).
    query_timeout: Duration = 0.0
    #: How long ``run``, ``consume`` and ``migrate`` wait for a database that cannot be reached
    #: yet (down, starting) or does not answer yet (PgBouncer paused) before giving up with exit
    #: code 3; 0: try once.
    connect_wait: Duration = Field(default=30.0, ge=0)
    #: Which outbox table and status words: ``v1`` (room_outbox: pending → published),
    #: ``room_cell`` (room_outbox: pending → delivering → delivered | retryable → failed) or
    #: ``silk`` (PostgreSQL's outbox_events: pending | retry → sending → sent | failed).
    #: See room_outbox.store.schema.profiles.
    profile: str = "v1"
    #: The outbox table's name; empty: the profile's own (``room_outbox`` for v1).
    table: str = ""
    #: The longest envelope read, in bytes. A longer one is never read: its row fails as too
    #: large (parked with ``parking: true``), so that one oversized row cannot exhaust the
    #: process's memory, which holds an envelope several times over while reading it.
    max_envelope_bytes: int = Field(default=MAX_ENVELOPE_BYTES, ge=1024)

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, value: str) -> str:
        return _one_of(value, PROFILES, "table profile")

    @field_validator("table")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        value = value.strip()
        if value and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
            raise ValueError(f"{value!r} is not a plain table name (letters, digits and _)")
        if len(value) > MAX_TABLE_NAME:
            raise ValueError(
                f"{value!r} is {len(value)} characters, at most {MAX_TABLE_NAME}: its index names"
                f" (idx_<table>_status_id) must fit PostgreSQL's {MAX_IDENTIFIER}-byte identifiers"
            )
        return value


class RetrySettings(Section):
    """Parameters of ``linear`` (base × attempts) and ``exponential`` (base × factor^(attempts-1),
    capped, ± jitter) retry strategies; ``fixed_interval`` retries after ``poll_interval``."""

    base: PositiveDuration = 1.0
    factor: float = Field(default=2.0, ge=1.0)
    cap: PositiveDuration = 300.0
    #: Fraction of the delay added or removed at random, so failed events do not retry in lockstep.
    jitter: float = Field(default=0.1, ge=0.0, le=1.0)
    #: Attempts before an event is parked as ``failed`` (needs ``parking: true``); 0 = unlimited.
    max_attempts: int = Field(default=0, ge=0)


#: The shortest ``poll_interval``: an idle process polls its database this often at most.
MIN_POLL_INTERVAL = 0.05
#: The shortest ``lease`` set explicitly.
MIN_LEASE = 1.0


class OutboxWorkerSettings(Section):
    """The delivery loop's options. A value ≤ 0 falls back to the default: never a busy loop,
    never a full-table scan, never an unbounded publish."""

    enabled: bool = True
    #: How long an idle lane waits before it looks again; at least 50ms (a shorter poll keeps
    #: an idle process and its database busy).
    poll_interval: Duration = 1.0
    #: At most 10,000: a batch's ids travel as bound parameters (SQLite allows 32,766).
    batch_size: int = Field(default=100, le=10_000)
    publish_timeout: Duration = 3.0
    retry_strategy: str = "fixed_interval"
    #: Deliveries of one batch that run at the same time (at most ``batch_size`` do).
    concurrency: int = Field(default=16, le=10_000)
    #: How long a claimed batch stays reserved for this process. It is renewed while the
    #: batch is in flight, so it only bounds how long a crashed process's rows wait.
    #: Default (≤ 0): 10 × publish_timeout; at least 1s when set.
    lease: Duration = 0.0
    #: The main lane claims a row the producer wrote only once it is this old: room-service
    #: pushes each event itself right after committing it and then marks it ``published``, and
    #: a claim in between sends the event a second time. Above room-service's push timeout;
    #: 0 where nothing pushes synchronously. Rows waiting for a retry are not delayed.
    claim_after: Duration = Field(default=5.0, ge=0)
    retry: RetrySettings = RetrySettings()
    #: Move events that can never succeed (permanent error, bad envelope, no sink, or
    #: ``retry.max_attempts`` used up) to status ``failed`` instead of retrying them forever.
    parking: bool = False
    #: ``per_room``: events of one room are delivered in id order, a failing event holding
    #: back the later events of its own room only. ``none``: nothing waits for anything.
    ordering: str = "none"

    @field_validator("poll_interval", "batch_size", "publish_timeout", "concurrency")
    @classmethod
    def _non_positive_means_default(cls, value: float, info: Any) -> Any:
        return value if value > 0 else cls.model_fields[info.field_name].default

    @field_validator("poll_interval")
    @classmethod
    def _not_a_busy_loop(cls, value: float) -> float:
        if value < MIN_POLL_INTERVAL:
            raise ValueError(
                f"{value:g}s is below {MIN_POLL_INTERVAL * 1000:g}ms: an idle process would keep itself and its"
                " database busy polling"
            )
        return value

    @field_validator("lease")
    @classmethod
    def _lease_outlives_a_statement(cls, value: float) -> float:
        if 0 < value < MIN_LEASE:
            raise ValueError(
                f"{value:g}s is below {MIN_LEASE:g}s: the statements' own timeout (database.query_timeout, a"
                " quarter of the lease at most) would cut ordinary statements short"
            )
        return value

    @field_validator("retry_strategy")
    @classmethod
    def _known_strategy(cls, value: str) -> str:
        return _one_of(value, RETRY_STRATEGIES, "retry strategy")

    @field_validator("ordering")
    @classmethod
    def _known_ordering(cls, value: str) -> str:
        return _one_of(value, ORDERINGS, "ordering")

    @model_validator(mode="after")
    def _max_attempts_needs_parking(self) -> OutboxWorkerSettings:
        if self.retry.max_attempts and not self.parking:
            raise ValueError("retry.max_attempts needs parking: true (without parking an event is never given up on)")
        return self

    @property
    def lease_seconds(self) -> float:
        return self.lease if self.lease > 0 else 10 * self.publish_timeout


#: Keys of ``outbox_worker`` that a lane may not override: they belong to the process.
_PROCESS_KEYS = ("enabled", "lanes")


class DeliverySettings(OutboxWorkerSettings):
    """``outbox_worker``: the delivery settings of every lane, plus per-lane overrides.

    ``outbox_worker.lanes.<lane>`` (``main`` for the main lane, the sink's name for a lane of
    its own) holds any of the keys above but ``enabled``; a key it leaves out comes from
    ``outbox_worker``, and ``retry`` is merged key by key. The merged section is validated as
    a whole, so an override is checked exactly as ``outbox_worker`` itself is, and an error
    names ``outbox_worker.lanes.<lane>.<key>``.
    """

    lanes: dict[str, dict[str, Any]] = {}

    @model_validator(mode="after")
    def _valid_lanes(self) -> DeliverySettings:
        errors: list[InitErrorDetails] = []
        if MAIN_LANE in self.lanes and FORMER_MAIN_LANE in self.lanes:
            errors.append(
                _error(
                    ("lanes", FORMER_MAIN_LANE), f"give lanes.{MAIN_LANE} alone: {FORMER_MAIN_LANE} is its former name"
                )
            )
        for lane in self.lanes:  # whether each lane exists is checked once the plugins are loaded
            try:
                self.for_lane(lane)
            except ValidationError as exc:
                for error in exc.errors(include_url=False, include_input=False):
                    errors.append(_error(("lanes", lane, *error["loc"]), error["msg"].removeprefix("Value error, ")))
        if errors:
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        return self

    def for_lane(self, lane: str) -> OutboxWorkerSettings:
        """The settings ``lane`` runs with: ``outbox_worker`` with ``lanes.<lane>`` over it."""
        if lane == MAIN_LANE and FORMER_MAIN_LANE in self.lanes:
            lane = FORMER_MAIN_LANE
        override = dict(self.lanes.get(lane) or {})
        base = self.model_dump(exclude=set(_PROCESS_KEYS))
        errors = [
            _error((key,), "belongs to outbox_worker, not to one lane") for key in _PROCESS_KEYS if key in override
        ]
        for key in _PROCESS_KEYS:
            override.pop(key, None)
        retry = override.get("retry")
        if isinstance(retry, Mapping):
            override["retry"] = {**base["retry"], **retry}
        try:
            merged = OutboxWorkerSettings.model_validate({**base, **override})
        except ValidationError as exc:
            errors += [
                _error(e["loc"], e["msg"].removeprefix("Value error, "))
                for e in exc.errors(include_url=False, include_input=False)
            ]
        if errors:
            raise ValidationError.from_exception_data("OutboxWorkerSettings", errors)
        return merged


def _error(loc: tuple[str | int, ...], message: str) -> InitErrorDetails:
    return InitErrorDetails(type=PydanticCustomError("value_error", message), loc=loc, input=None)


class LanesSettings(Section):
    """Lanes of their own (sinks outside the main lane): how they are fed from room_outbox."""

    #: An id seen missing (a producer transaction not yet committed) for longer than this is
    #: taken to be a rolled-back insert and skipped. Longer than any room-service transaction.
    gap_timeout: Duration = 300.0
    #: Rows read from room_outbox per feeding round.
    feed_batch: int = Field(default=1000, ge=1, le=100_000)
    #: Most ranges of missing ids a lane waits for at once. Beyond it the longest-missing are
    #: given up on early (logged), so the feeding query stays small whatever happens to ids.
    max_gaps: int = Field(default=256, ge=1, le=10_000)

    @field_validator("gap_timeout")
    @classmethod
    def _positive(cls, value: float) -> float:
        return value if value > 0 else float(cls.model_fields["gap_timeout"].default)


class RoutingSettings(Section):
    """Which main-lane sink takes an event type that no main-lane sink lists."""

    #: ``all``: the main lane's default sink (the one without ``event_types``) takes every
    #: type nobody lists, catalogued or not, as V1 sends every type to IM. ``known``: only
    #: the catalogued types; an event of any other type is parked with ``no_route``.
    main_default: str = "all"
    #: ``main_default``'s former name: still accepted, with a deprecation line at start-up.
    im_default: str | None = None

    @field_validator("main_default", "im_default")
    @classmethod
    def _known_choice(cls, value: str | None) -> str | None:
        return None if value is None else _one_of(value, MAIN_DEFAULTS, "choice")

    @model_validator(mode="after")
    def _former_name(self) -> RoutingSettings:
        if self.im_default is not None:
            if "main_default" in self.model_fields_set:
                raise ValueError("give main_default alone: im_default is its former name")
            self.main_default = self.im_default
        return self


class ClusterSettings(Section):
    """The processes of one deployment (MySQL): heartbeats, room buckets, quota shares
    (:mod:`room_outbox.cluster`)."""

    #: How often each process renews its heartbeat and rebalances room buckets.
    heartbeat_interval: Duration = 1.0
    #: A process whose heartbeat is older than this is dead: its buckets and its quota share
    #: go to the others. At least three heartbeats.
    node_timeout: Duration = 5.0
    #: How far this host's clock may be off the database's before it is reported (a WARNING,
    #: ``/readyz``, a metric). Every time compared between processes is the database's, so
    #: delivery goes on whatever the offset; other hosts' tools (logs, dashboards) may not.
    max_clock_skew: Duration = MAX_CLOCK_SKEW

    @model_validator(mode="after")
    def _timeout_spans_heartbeats(self) -> ClusterSettings:
        if self.heartbeat_interval <= 0:
            raise ValueError("heartbeat_interval must be a positive duration")
        if self.max_clock_skew <= 0:
            raise ValueError("max_clock_skew must be a positive duration")
        if self.node_timeout < 3 * self.heartbeat_interval or self.node_timeout < self.heartbeat_interval + 2.5:
            # A process stops sending once its heartbeat is node_timeout less two rate-limit
            # windows old; that must leave room for at least one heartbeat.
            raise ValueError("node_timeout must be at least 3 × heartbeat_interval and heartbeat_interval + 2.5s")
        return self


class PluginsSettings(Section):
    #: Entry-point names never to load (built-in or third-party).
    disabled: list[str] = []


class LogSettings(Section):
    level: str = "INFO"
    #: Level of the libraries' own loggers (httpx, httpcore, aiohttp, aiokafka, aiomysql,
    #: psycopg, opentelemetry, asyncio). Kept at WARNING whatever ``level`` says: at INFO httpx
    #: logs every request URL, and their DEBUG is noise. Their records are redacted like every other.
    library_level: str = "WARNING"
    #: ``json``: one JSON object per line; ``console``: short aligned lines for people;
    #: ``auto``: console when stderr is a terminal, JSON otherwise
    #: (:mod:`room_outbox.observability.logs`).
    format: Literal["auto", "console", "json"] = "auto"
    #: The console span and metric exporters write to stdout, apart from the logs (stderr);
    #: true sends their output into the log stream instead.
    spans_with_logs: bool = False

    @field_validator("level", "library_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        value = value.upper()
        if value not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"unknown log level {value!r} (allowed: DEBUG, INFO, WARNING, ERROR)")
        return value


class TelemetrySettings(Section):
    """Observability (:mod:`room_outbox.observability.service`); traces and metric exporters come from
    the standard ``OTEL_*`` environment instead."""

    #: ``host:port`` serving /healthz, /readyz and /metrics; empty: no endpoint.
    http_listen: str = ""
    #: How often the backlog is sampled: a lane's pending count and oldest pending age (two
    #: index lookups), a consume process's lag (its end and committed offsets, from the broker).
    backlog_interval: Duration = 15.0
    #: /healthz fails once a running lane has ended no round (and no delivery attempt) for
    #: this many poll intervals (see ``room_outbox.observability.health``).
    stalled_after_polls: int = Field(default=STALLED_AFTER_POLLS, ge=1)
    #: /readyz fails once a lane has had this many failed rounds in a row.
    unready_after_failed_rounds: int = Field(default=UNREADY_AFTER_FAILED_ROUNDS, ge=1)

    @field_validator("http_listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        value = value.strip()
        if value:
            try:
                parse_listen(value)
            except ValueError as exc:
                raise ValueError(f"{exc}; empty turns the endpoint off") from None
        return value

    @field_validator("backlog_interval")
    @classmethod
    def _positive_interval(cls, value: float) -> float:
        return value if value > 0 else float(cls.model_fields["backlog_interval"].default)


#: The shortest ``retention.processed_older_than`` accepted (see there).
MIN_PROCESSED_HORIZON = 86400.0


class RetentionSettings(Section):
    """``room-outbox cleanup`` and the optional background job (:mod:`room_outbox.store.operator.retention`):
    published rows older than ``older_than`` are deleted, or moved to ``room_outbox_archive``;
    the consumers' processed records older than ``processed_older_than`` are deleted."""

    #: Run a pass every ``interval`` inside ``room-outbox run`` (``cleanup`` works either way).
    enabled: bool = False
    older_than: PositiveDuration = 7 * 86400.0
    #: A processed record is what makes a redelivered message a no-op: removed while its
    #: message can still come back, that message's side effects happen a second time. So this
    #: must exceed the longest time a message can be read again after it was handled. Kafka
    #: re-reads messages whose offsets were not committed yet (a crash; a member stopped for a
    #: while) and, once a group's committed offsets have expired, re-reads the topic from its
    #: start: keep it above the topic's retention (Kafka's default: 7 days) plus any consumer
    #: downtime. Less than a day is refused.
    processed_older_than: Duration = 30 * 86400.0
    #: Rows per transaction: small, so no statement holds locks for long.
    batch_size: int = Field(default=1000, ge=1, le=100_000)
    #: Wait between batches, leaving the database to delivery.
    pause: Duration = Field(default=0.1, ge=0)
    archive: bool = False
    interval: PositiveDuration = 3600.0

    @field_validator("processed_older_than")
    @classmethod
    def _beyond_redelivery(cls, value: float) -> float:
        if value < MIN_PROCESSED_HORIZON:
            raise ValueError(
                "must be at least 1d and above the topic's retention: a processed record removed while its"
                " message can still be read again lets that message's side effects run twice"
            )
        return value


def default_node_id() -> str:
    """``<hostname>-<pid>``, the host name cut to 64 characters: a long (fully qualified)
    one must not make the default longer than a ``node_id`` may be."""
    return f"{socket.gethostname()[:64]}-{os.getpid()}"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
    )

    database: DatabaseSettings = DatabaseSettings()
    #: The ``database`` section's former name: its keys apply where ``database`` leaves them unset.
    mysql: DatabaseSettings | None = None
    node_id: str = ""
    outbox_worker: DeliverySettings = DeliverySettings()
    #: ``sinks.<name>``: validated by the sink's own settings model once plugins are loaded.
    sinks: dict[str, dict[str, Any]] = {}
    lanes: LanesSettings = LanesSettings()
    routing: RoutingSettings = RoutingSettings()
    cluster: ClusterSettings = ClusterSettings()
    plugins: PluginsSettings = PluginsSettings()
    log: LogSettings = LogSettings()
    telemetry: TelemetrySettings = TelemetrySettings()
    retention: RetentionSettings = RetentionSettings()
    #: ``consumers.<name>``: Kafka consumer groups running handlers; validated by
    #: :func:`room_outbox.consume.settings.consumer_settings` (handlers bring their own models).
    consumers: dict[str, dict[str, Any]] = {}

    @field_validator("node_id")
    @classmethod
    def _default_node_id(cls, value: str) -> str:
        value = value.strip()
        if any(not char.isprintable() for char in value):
            raise ValueError("control or invisible characters are not allowed")
        return value or default_node_id()

    @property
    def deprecated_names(self) -> list[str]:
        """One line per former name this configuration still uses, logged at start-up and
        printed by ``check-config``: they work today and will be removed."""
        lines = []
        if FORMER_MAIN_LANE in self.outbox_worker.lanes:
            lines.append(
                f"outbox_worker.lanes.{FORMER_MAIN_LANE} is deprecated: call it outbox_worker.lanes.{MAIN_LANE}"
            )
        if self.routing.im_default is not None:
            lines.append("routing.im_default is deprecated: call it routing.main_default")
        return lines

    @model_validator(mode="after")
    def _mysql_is_database(self) -> Settings:
        """Existing files (and ``ROOM_OUTBOX__MYSQL__*``) keep working: a key given under
        ``mysql`` counts unless ``database`` gives it too."""
        if self.mysql is not None:
            given = {key: getattr(self.mysql, key) for key in self.mysql.model_fields_set}
            given.update({key: getattr(self.database, key) for key in self.database.model_fields_set})
            self.database = DatabaseSettings.model_validate(
                {
                    key: value.get_secret_value() if isinstance(value, SecretStr) else value
                    for key, value in given.items()
                }
            )
        return self

    @model_validator(mode="after")
    def _query_timeout_within_lease(self) -> Settings:
        """A claim computes its lease's end before it runs, and the first renewal comes a
        third of a lease after it returns; both may take ``query_timeout``. Below a third
        of the lease, no database call can let a live process's lease run out. (Defined
        after the ``mysql`` alias's merge, so it sees the merged section.)"""
        lease = self.outbox_worker.lease_seconds
        database = self.database
        if database.query_timeout <= 0:
            database.query_timeout = min(DEFAULT_QUERY_TIMEOUT, lease / 4)
        elif database.query_timeout >= lease / 3:
            raise ValueError(
                f"database.query_timeout ({database.query_timeout:g}s) must be below a third of outbox_worker.lease"
                f" ({lease:g}s): a database call could outlive the lease. Lower query_timeout or raise the lease"
            )
        return self

    @model_validator(mode="after")
    def _silk_backs_off_linearly(self) -> Settings:
        """silk's own worker retries after 15 s × attempts: the default on its table too.
        (Defined after the ``mysql`` alias's merge, so it sees the merged profile.)"""
        worker = self.outbox_worker
        if self.database.profile == "silk" and "retry_strategy" not in worker.model_fields_set:
            worker.retry_strategy = "linear"
            if "base" not in worker.retry.model_fields_set:
                worker.retry.base = 15.0
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The YAML file arrives as init arguments; the environment overrides it.
        return (_Environment(settings_cls), init_settings)


class _Environment(EnvSettingsSource):
    """``ROOM_OUTBOX__…`` variables. A list or a mapping given in one variable is JSON; the
    typed sections decode it by their types, but the sections whose keys are the plugins' own
    (``sinks``, ``consumers``, ``outbox_worker.lanes``) are mappings of any value, so their
    JSON arrays and objects are decoded here (``ROOM_OUTBOX__SINKS__NOOP__EVENT_TYPES=
    '["RoomCreated"]'``). A value that is not valid JSON stays text (``{room_id}``); should its
    key want a list or a mapping, the section's error names the variable and where its JSON
    breaks (:func:`describe_validation_error`)."""

    def explode_env_vars(self, field_name: str, field: FieldInfo, env_vars: Mapping[str, str | None]) -> dict[str, Any]:
        exploded = super().explode_env_vars(field_name, field, env_vars)
        return _json_leaves(exploded) if field_name in _PLUGIN_KEYED else exploded

    def __call__(self) -> dict[str, Any]:
        """The variables' values; ``ROOM_OUTBOX__MYSQL__*`` as ``database`` keys, so that they
        win over the file's ``database`` section as every variable wins over the file (a
        ``ROOM_OUTBOX__DATABASE__*`` variable of the same key wins over them)."""
        values = super().__call__()
        former = values.pop("mysql", None)
        if isinstance(former, dict):
            database = values.get("database")
            values["database"] = {**former, **(database if isinstance(database, dict) else {})}
        elif former is not None:
            values["mysql"] = former  # not a section: its error names it
        return values


#: Settings fields holding, somewhere below, mappings of the plugins' own keys and values.
_PLUGIN_KEYED = ("sinks", "consumers", "outbox_worker")


def _looks_like_json(value: str) -> bool:
    """Whether an environment variable's text is meant as a JSON array or object."""
    return value.lstrip()[:1] in ("[", "{")


def _json_leaves(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _json_leaves(item) for key, item in value.items()}
    if isinstance(value, str) and _looks_like_json(value):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def load_settings(config_file: str | Path | None = None) -> Settings:
    """Read the YAML file (if any) and the environment; raise :class:`ConfigError`."""
    data: dict[str, Any] = {}
    if config_file is not None:
        path = Path(config_file)
        try:
            loaded = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # a SafeLoader
        except OSError as exc:
            raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:  # saved by an editor in another encoding (GBK, UTF-16)
            line = exc.object[: exc.start].count(b"\n") + 1
            raise ConfigError(
                f"config file {path}: not UTF-8: line {line} holds byte 0x{exc.object[exc.start]:02x},"
                " which UTF-8 has not there; save the file as UTF-8"
            ) from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path}: not valid YAML: {describe_yaml_error(exc)}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: expected a mapping at the top level")
        data = loaded or {}
    # Every problem at once: the variables naming no setting, then the keys in error.
    unknown = [f"  {line}" for line in _unknown_environment()]
    try:
        settings = Settings(**data)
    except ValidationError as exc:
        problems, rest = describe_validation_error(exc).splitlines()[1:], _the_rest(data, exc)
    except SettingsError as exc:  # an environment variable that should hold JSON does not
        if not unknown:
            raise InvalidSettings(_undecodable_environment(exc), None) from None
        problems, rest = ["  " + _undecodable_environment(exc).removeprefix("invalid environment: ")], None
    else:
        if not unknown:
            return settings
        problems, rest = [], settings
    heading = "invalid configuration:" if problems else "invalid environment:"
    raise InvalidSettings("\n".join([heading, *unknown, *problems]), rest)


#: How many times :func:`_the_rest` leaves keys out before it gives up (each round's errors can
#: hide others: a section's own check runs once its keys are valid).
_REST_ROUNDS = 5


def _the_rest(data: dict[str, Any], exc: ValidationError) -> Settings | None:
    """Settings from ``data`` without the keys ``exc`` (and each next try) finds in error."""
    rest = copy.deepcopy(data)
    for _ in range(_REST_ROUNDS):
        if not all(_left_out(rest, error["loc"]) for error in exc.errors()):
            return None
        try:
            return Settings(**rest)
        except ValidationError as again:
            exc = again
        except SettingsError:
            return None
    return None


def _left_out(data: dict[str, Any], loc: tuple[int | str, ...]) -> bool:
    """Delete the key ``loc`` names from the file's ``data``; whether there was one to delete.
    A whole ``sinks`` section is kept: its default enables tencent_im, whose missing
    credentials would then be reported as the operator's mistake."""
    if not loc or loc == ("sinks",):
        return False
    container: Any = data
    for key in loc[:-1]:
        if not isinstance(container, dict) or key not in container:
            return False
        container = container[key]
    if not isinstance(container, dict) or loc[-1] not in container:
        return False
    del container[loc[-1]]
    return True


def _unknown_environment() -> list[str]:
    """A line for each environment variable meant as a setting that names none. Only the
    variables of known top-level keys are read, so one misspelt at its top (``ROOM_OUTBOX__DATABASE_DSN``,
    ``ROOM_OUTBOX_DATABASE__DSN``: an underscore short) was ignored silently, its setting left at
    the file's value or the default. (A key misspelt further down is refused by its section.)"""
    fields = set(Settings.model_fields)
    lines = []
    for name in sorted(os.environ):
        upper = name.upper()
        if upper.startswith(ENV_PREFIX):
            key = upper.removeprefix(ENV_PREFIX)
            if key.split("__", 1)[0].lower() in fields:
                continue
            field = next((f for f in sorted(fields) if key.lower().startswith(f + "_")), None)
            meant = f"{ENV_PREFIX}{field.upper()}__{key[len(field) + 1 :]}" if field else None
        else:
            key = upper.removeprefix(ENV_PREFIX[:-1])  # one underscore after the prefix
            if key == upper or key.split("__", 1)[0].lower() not in fields:
                continue  # not meant as a setting (ROOM_OUTBOX_CONFIG)
            meant = ENV_PREFIX + key
        hint = f"; did you mean {meant}?" if meant else f" (the keys at the top: {', '.join(sorted(fields))})"
        lines.append(f"{name}: names no setting{hint}")
    return lines


def _undecodable_environment(exc: SettingsError) -> str:
    """The environment variables whose JSON does not parse (a section or a list given whole),
    under the field ``exc`` names, with where their JSON breaks, never with their values (they
    may hold a secret)."""
    field = re.search(r'field "(\w+)"', str(exc))
    prefix = ENV_PREFIX + (field.group(1).upper() if field else "")
    bad = []
    for name, value in sorted(os.environ.items()):
        if name.upper().startswith(prefix) and _looks_like_json(value):
            try:
                json.loads(value)
            except json.JSONDecodeError as error:
                bad.append(f"{name}: not valid JSON ({_where_json_breaks(error)})")
    return "invalid environment: " + ("; ".join(bad) if bad else str(exc))


def _where_json_breaks(error: json.JSONDecodeError) -> str:
    """``Expecting ',' delimiter at character 41``; some of json's messages end in "at"
    already (``Unterminated string starting at``)."""
    at = "" if error.msg.endswith(" at") else " at"
    return f"{error.msg}{at} character {error.pos}"


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key written twice in one mapping: it keeps the last one
    silently, so a setting written twice (two ``mysql:`` sections, ``batch_size`` twice) would
    be half ignored. Keys a merge (``<<``) brings in may be overridden, as YAML means."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _value in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"the key {key} appears twice in one mapping (lines {seen[key]} and {line}); write it once",
                    key_node.start_mark,
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


# A quoted fragment of the file in a YAML message: kept when it is a token name or a single
# character, masked otherwise (an undefined alias named by a secret that starts with ``*``).
_QUOTED = re.compile(r"'([^']*)'|\"([^\"]*)\"")


def describe_yaml_error(exc: yaml.YAMLError) -> str:
    """Where and what: line, column and PyYAML's problem, never the offending line itself
    (PyYAML's own message quotes it, and it may hold a secret)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        problem = _QUOTED.sub(_quoted_fragment, exc.problem or "syntax error")
        context = ""
        if exc.context and not _QUOTED.search(exc.context):
            started = exc.context_mark
            where = f" at line {started.line + 1}, column {started.column + 1}" if started is not None else ""
            context = f" ({exc.context}{where})"
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}{context}"
    if isinstance(exc, yaml.reader.ReaderError):
        return f"{exc.reason} (character #x{exc.character:04x} at position {exc.position})"
    return type(exc).__name__


def _quoted_fragment(match: re.Match[str]) -> str:
    fragment = match.group(1) if match.group(1) is not None else match.group(2)
    keep = (fragment.startswith("<") and fragment.endswith(">")) or len(fragment) <= 2
    return match.group(0) if keep else "'…'"


def describe_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """One line per problem, each naming the dotted key and the reason (never the value of a
    secret: pydantic's messages do not echo inputs once ``include_input`` is off)."""
    lines = []
    for error in exc.errors(include_url=False, include_input=False):
        key = ".".join(str(part) for part in (prefix, *error["loc"]) if part != "")
        message = error["msg"].removeprefix("Value error, ")
        broken = _broken_json_variable(key)
        lines.append(f"{key or 'config'}: {message}" + (f"; {broken}" if broken else ""))
    return "invalid configuration:\n  " + "\n  ".join(lines)


def _broken_json_variable(key: str) -> str | None:
    """The environment variable that set ``key`` (or a section above it) with JSON that does
    not parse, named with where it breaks (never its value: it may hold a secret). The plugins'
    sections keep such text as text (it may be a template, ``{room_id}``), so the error their
    own validation raises is the only place left to say that the JSON broke."""
    parts = key.split(".")
    variables = {name.upper(): value for name, value in os.environ.items()}
    for end in range(len(parts), 0, -1):
        name = ENV_PREFIX + "__".join(parts[:end]).upper()
        value = variables.get(name)
        if value is not None and _looks_like_json(value):
            try:
                json.loads(value)
            except json.JSONDecodeError as error:
                return f"{name} is not valid JSON ({_where_json_breaks(error)})"
    return None
