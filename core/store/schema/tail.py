"""The tailing lanes' table: rows that can never be delivered, parked with their error.

A tailing lane (a sink with ``ordered_log=True``, such as Kafka) keeps no per-row state: its
position is its row in the lanes' cursor table. The only rows it keeps are the ones it had to
pass over (too large, not serialisable), so that ``status``, ``inspect`` and ``requeue`` see
them: ``parked`` until an operator requeues them, ``requeued`` until the lane sends them again.
One small table for every tailing lane, keyed by (lane, outbox_id).
"""

from __future__ import annotations

from room_outbox.store.dialect import Dialect

PARKED_TABLE = "room_outbox_tail_parked"
PARKED = "parked"
REQUEUED = "requeued"


def parked_ddl(dialect: Dialect) -> list[str]:
    return [
        f"""CREATE TABLE {PARKED_TABLE} (
  lane          VARCHAR(64)   NOT NULL,
  outbox_id     {dialect.id_type} NOT NULL,
  event_id      VARCHAR(64)   NOT NULL,
  room_id       VARCHAR(64)   NOT NULL,
  status        VARCHAR(16)   NOT NULL DEFAULT '{PARKED}',
  last_error    VARCHAR(1024) NULL,
  created_at_ms BIGINT        NOT NULL,
  updated_at_ms BIGINT        NOT NULL,
  PRIMARY KEY (lane, outbox_id)
){dialect.table_options}"""
    ]


__all__ = ["PARKED", "PARKED_TABLE", "REQUEUED", "parked_ddl"]
