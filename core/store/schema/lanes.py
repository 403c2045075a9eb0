"""The lanes' tables: their names. A lane besides IM keeps its state in a table of its own,
``room_outbox_lane_<name>``, fed through the cursor table (:mod:`room_outbox.store.lanes.store`)."""

from __future__ import annotations

import re

from room_outbox.errors import ConfigurationError

CURSOR_TABLE = "room_outbox_lane_cursor"
#: At most 36 characters: the lane table's longest derived name, its claim index
#: ``idx_room_outbox_lane_<name>_claim``, must fit PostgreSQL's 63-byte identifiers.
_LANE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,35}$")


def lane_table(lane: str) -> str:
    if not _LANE_NAME.match(lane):
        raise ConfigurationError(
            f"lane name {lane!r}: use lower-case letters, digits and _, at most 36"
            " (idx_room_outbox_lane_<name>_claim must fit a 63-byte identifier)"
        )
    return f"room_outbox_lane_{lane}"
