"""This process's share of deployment-wide limits (the rules, without processes)."""

from __future__ import annotations

import logging
import math
from typing import cast

from room_outbox.cluster.membership import Membership, plan
from room_outbox.cluster.quota import WINDOW, QuotaShare
from room_outbox.plugins.tencent_im import TencentIMSettings
from room_outbox.plugins.tencent_im.fake import DEV_KEY, DEV_SDKAPPID
from room_outbox.plugins.tencent_im.sink import TencentIMSink
from room_outbox.sink import SinkContext
from room_outbox.store.membership import BucketRow
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.buckets import BUCKETS


def test_shares_split_limits_and_a_room_owner_keeps_its_groups_whole() -> None:
    clock = [0.0]
    share = QuotaShare(clock=lambda: clock[0])
    assert share.split(180) == 180  # one process alone
    share.apply(3, valid_until=10.0)
    assert share.split(180) == 60 and share.split(36) == 12
    assert share.split(36, per_room=True) == 12  # groups shared while rooms are not owned
    share.rooms_owned = True
    assert share.split(36, per_room=True) == 36
    assert share.split(2) == 1  # a limit below the node count: at least one
    clock[0] = 10.5  # the heartbeat went stale: nothing at all
    assert share.split(180) == 0
    share.apply(math.inf, valid_until=20.0)  # joining: nothing until the others made room
    assert share.split(180) == 0


def test_bucket_plan_is_fair_and_moves_as_little_as_it_can() -> None:
    empty = [BucketRow(b, None, False, 0) for b in range(BUCKETS)]
    first = plan(empty, ["a"])
    assert set(first.values()) == {"a"} and len(first) == BUCKETS
    rows = [BucketRow(b, "a", False, 0) for b in range(BUCKETS)]
    second = plan(rows, ["a", "b"])
    assert len(second) == BUCKETS // 2 and set(second.values()) == {"b"}
    rows = [BucketRow(b, second.get(b, "a"), False, 0) for b in range(BUCKETS)]
    third = plan(rows, ["a", "b", "c"])
    assert set(third.values()) == {"c"} and len(third) == BUCKETS // 3  # only c's part moves
    owners = [third.get(r.bucket, r.owner) for r in rows]
    assert sorted(owners.count(n) for n in "abc") == [85, 85, 86]
    assert plan([BucketRow(r.bucket, o, False, 0) for r, o in zip(rows, owners, strict=True)], ["a", "b", "c"]) == {}
    after_death = plan([BucketRow(r.bucket, o, False, 0) for r, o in zip(rows, owners, strict=True)], ["a", "c"])
    assert {owners[b] for b in after_death} == {"b"}  # only the dead node's buckets move


def test_bucket_plan_moves_buckets_without_leased_rows_first() -> None:
    rows = [BucketRow(b, "a", False, 0) for b in range(BUCKETS)]
    leased = set(range(BUCKETS // 2, BUCKETS // 2 + 10))  # a plan blind to leases moves these
    moves = plan(rows, ["a", "b"], leased)
    assert len(moves) == BUCKETS // 2 and not leased & set(moves)  # a fair count, all idle
    all_leased = plan(rows, ["a", "b"], set(range(BUCKETS)))
    assert len(all_leased) == BUCKETS // 2  # none idle: busy ones move (handed over) all the same


def test_a_bucket_waits_a_window_before_its_new_owner_only_where_a_room_limit_follows_the_room() -> None:
    """The Tencent IM sink with a group per room bucket declares a limit of each room's messages:
    with per-room ordering the room's owner keeps it whole, so a bucket that changes hands waits
    a rate-limit window (the former owner's last messages must leave it first). A group per
    app, a group fed by two app codes' rooms (two buckets), rooms not owned, or no such sink:
    claimable at once."""
    one, two = ["", "default"], ["game1", "game2"]  # app codes of the default app (the empty one not counted)
    cases = [
        ("im_{room_id}", one, True, True),
        ("im_{room_id}", one, False, False),
        ("im_{room_id}", two, True, False),  # ("game1", r) and ("game2", r): one group, two buckets
        ("im_{app_code}_{room_id}", two, True, True),
        ("im_{app_code}", one, True, False),
    ]
    for template, codes, per_room, waits in cases:
        quota = QuotaShare()
        quota.rooms_owned = per_room
        settings = TencentIMSettings(
            sdkappid=DEV_SDKAPPID, secret_key=DEV_KEY, group_id_template=template, default_app_codes=codes
        )
        TencentIMSink(settings, SinkContext("n", logging.getLogger("test"), quota=quota))
        membership = Membership(cast(SQLStore, None), "n", [], quota=quota)
        expected = int(WINDOW * 1000) + 1 if waits else 0
        assert membership._handover_delay_ms() == expected, (template, codes, per_room)
    quota = QuotaShare()
    quota.rooms_owned = True  # per-room ordering, and no sink limiting a room's messages
    assert Membership(cast(SQLStore, None), "n", [], quota=quota)._handover_delay_ms() == 0
