"""An audit sink as a third-party package would write it, using only room-outbox's public API.

Every room event is written once to ``room_outbox_audit_log``. The sink keeps a lane of its own
(``own_lane=True``), so audit never holds up IM delivery; its table comes from the
``room_outbox_migrations`` hook, so ``room-outbox migrate`` creates it once the sink is
enabled. Enable it with::

    sinks:
      audit_table:
        enabled: true
        dsn: "mysql://user:password@host:3306/room"   # or ROOM_OUTBOX__SINKS__AUDIT_TABLE__DSN
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote, urlsplit

import aiomysql
import anyio
from pydantic import SecretStr, field_validator

from room_outbox import (
    EventEnvelope,
    RetryableSinkError,
    SinkContext,
    SinkSettings,
    SinkSpec,
    hookimpl,
)

TABLE_DDL = """
CREATE TABLE IF NOT EXISTS room_outbox_audit_log (
  event_id    VARCHAR(64) NOT NULL PRIMARY KEY,
  event_type  VARCHAR(64) NOT NULL,
  room_id     VARCHAR(64) NOT NULL,
  envelope    LONGTEXT    NOT NULL,
  recorded_at TIMESTAMP(3) NOT NULL DEFAULT CURRENT_TIMESTAMP(3)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4
"""


def connect_kwargs(dsn: str) -> dict[str, Any]:
    """aiomysql's arguments from ``mysql://user:password@host:port/database``. Errors never
    echo the DSN, which holds the password."""
    parts = urlsplit(dsn)
    if parts.scheme != "mysql":
        raise ValueError(f"dsn: scheme must be mysql:// (got {parts.scheme or 'none'}://)")
    database = unquote(parts.path.lstrip("/"))
    if not database:
        raise ValueError("dsn: names no database (mysql://user:password@host:port/DATABASE)")
    try:
        port = parts.port or 3306
    except ValueError:
        raise ValueError("dsn: port is not a number") from None
    return {
        "host": parts.hostname or "127.0.0.1",
        "port": port,
        "user": unquote(parts.username or "root"),
        "password": unquote(parts.password or ""),
        "db": database,
    }


class AuditSettings(SinkSettings):
    dsn: SecretStr = SecretStr("mysql://root:@127.0.0.1:3306/room")

    @field_validator("dsn")
    @classmethod
    def _mysql_dsn(cls, value: SecretStr) -> SecretStr:
        connect_kwargs(value.get_secret_value())  # its errors name the problem, never the DSN
        return value


class AuditSink:
    def __init__(self, settings: AuditSettings, context: SinkContext) -> None:
        self.connect_kwargs = connect_kwargs(settings.dsn.get_secret_value())
        context.add_secret(self.connect_kwargs["password"])
        self._pool: aiomysql.Pool | None = None
        self._opening = anyio.Lock()

    async def deliver(self, envelope: EventEnvelope) -> None:
        try:
            pool = await self._opened()
            async with pool.acquire() as conn, conn.cursor() as cur:
                # A redelivered event (at-least-once) is recorded once.
                await cur.execute(
                    "INSERT INTO room_outbox_audit_log (event_id, event_type, room_id, envelope)"
                    " VALUES (%s, %s, %s, %s) ON DUPLICATE KEY UPDATE event_id = event_id",
                    (envelope.event_id, envelope.event_type, envelope.room_id, json.dumps(envelope.model_dump())),
                )
                await conn.commit()
        except (OSError, aiomysql.Error) as exc:
            raise RetryableSinkError(f"audit table unavailable: {type(exc).__name__}") from exc

    async def _opened(self) -> aiomysql.Pool:
        async with self._opening:
            if self._pool is None:
                self._pool = await aiomysql.create_pool(minsize=1, maxsize=4, **self.connect_kwargs)
            return self._pool

    async def aclose(self) -> None:
        if self._pool is not None:
            self._pool.close()
            await self._pool.wait_closed()


@hookimpl
def room_outbox_register_sinks() -> list[SinkSpec[AuditSettings]]:
    return [SinkSpec("audit_table", AuditSink, settings_model=AuditSettings, own_lane=True)]


@hookimpl
def room_outbox_migrations() -> list[str]:
    return [TABLE_DDL]
