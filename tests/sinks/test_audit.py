"""The example audit sink (examples/audit_sink) keeps the sink contract, against MariaDB; the
silent database is a row lock held by another session on the very event being written."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiomysql
import pytest
import room_outbox_audit

from room_outbox import EventEnvelope
from room_outbox.testing import SinkContract, closed_port
from room_outbox.testing import SinkHarness as Harness

#: A password that must never show in an error (the test server itself needs none).
PASSWORD = "audit-s3cret-pw"


@asynccontextmanager
async def connection(dsn: str) -> AsyncIterator[aiomysql.Connection]:
    conn = await aiomysql.connect(**room_outbox_audit.connect_kwargs(dsn))
    try:
        yield conn
    finally:
        conn.close()


class TestAuditSink(SinkContract):
    plugin = room_outbox_audit
    name = "audit_table"

    @pytest.fixture
    async def harness(self, database_dsn: str) -> Harness:
        async with connection(database_dsn) as conn, conn.cursor() as cur:
            for statement in room_outbox_audit.room_outbox_migrations():
                await cur.execute(statement)
        section = {"dsn": database_dsn}

        async def delivered(sent: EventEnvelope) -> bool:
            async with connection(database_dsn) as conn, conn.cursor() as cur:
                await cur.execute("SELECT COUNT(*) FROM room_outbox_audit_log WHERE event_id = %s", (sent.event_id,))
                (count,) = await cur.fetchone()
                await conn.commit()
            return bool(count)

        @asynccontextmanager
        async def no_database() -> AsyncIterator[dict[str, Any]]:
            yield {"dsn": f"mysql://auditor:{PASSWORD}@127.0.0.1:{closed_port()}/audit"}

        @asynccontextmanager
        async def row_locked() -> AsyncIterator[dict[str, Any]]:
            async with connection(database_dsn) as holder, holder.cursor() as cur:
                await cur.execute(
                    "INSERT INTO room_outbox_audit_log (event_id, event_type, room_id, envelope)"
                    " VALUES ('contract-silent', 'RoomUserJoined', 'r_contract', '{}')"
                )  # not committed: the sink's insert of that event waits for this lock
                try:
                    yield section
                finally:
                    await holder.rollback()

        return Harness(
            section=section,
            delivered=delivered,
            invalid=[
                ({"dsn": f"postgres://auditor:{PASSWORD}@db/audit"}, "dsn"),
                ({"dsn": f"mysql://auditor:{PASSWORD}@db:port/audit"}, "dsn"),
            ],
            outage=no_database,
            hang=row_locked,
            permanent=None,
            secrets=[PASSWORD],
        )
