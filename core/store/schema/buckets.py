"""The cluster's tables: their names. Live nodes and room buckets (:mod:`room_outbox.store.membership`)
live in tables of their own, and a row's bucket in a column of the outbox and lane tables."""

from __future__ import annotations

BUCKET_COLUMN = "room_bucket"
NODE_TABLE = "room_outbox_node"
BUCKET_TABLE = "room_outbox_bucket"
