"""The request the sink sends: body shape, Random, priority, group id, de-duplication."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from im_support import event, make_sink

from room_outbox.plugins.tencent_im.fake import FakeTencentIM, serve_fake_im
from room_outbox.plugins.tencent_im.message import random_for

pytestmark = pytest.mark.anyio


def test_random_is_a_stable_u32_of_the_app_code_and_event_id() -> None:
    # A fixed value: a change of the derivation would break de-duplication against
    # messages already sent by a previous version (or by room-service, if it copies it).
    expected = int.from_bytes(hashlib.sha256(b"default\0evt_1").digest()[:4], "big")
    assert random_for("default", "evt_1") == expected == 0x1E06CF20
    assert random_for("default", "evt_1") == random_for("default", "evt_1")
    assert random_for("other", "evt_1") == 0x73C03DC8  # same event_id, another app: another Random
    assert random_for("a", "bc") != random_for("ab", "c")  # the pair is unambiguous
    values = {random_for("default", f"evt_{i}") for i in range(10_000)}
    assert all(0 <= v < 2**32 for v in values)
    assert len(values) >= 9_990  # birthday bound: ~0.012 expected collisions among 10k


def test_random_is_the_same_in_another_process() -> None:
    """Not Python's salted ``hash()``: a fresh interpreter (another PYTHONHASHSEED) agrees."""
    code = "from room_outbox.plugins.tencent_im.message import random_for; print(random_for('default', 'evt_1'))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == random_for("default", "evt_1")


async def test_two_app_codes_sharing_a_tencent_app_may_reuse_an_event_id(fake: FakeTencentIM) -> None:
    """Both reach the group: with Random from event_id alone Tencent would discard the second
    as a copy of the first."""
    sink = make_sink(fake, default_app_codes=["shop", "live"])
    try:
        await sink.deliver(event("evt_1", room_id="r_1", app_code="shop"))
        await sink.deliver(event("evt_1", room_id="r_1", app_code="live"))
    finally:
        await sink.aclose()
    assert fake.duplicates == 0
    assert [json.loads(m.data or "")["app_code"] for m in fake.messages] == ["shop", "live"]
    assert {m.group_id for m in fake.messages} == {"r_1"}
    assert [m.random for m in fake.messages] == [random_for("shop", "evt_1"), random_for("live", "evt_1")]


async def test_body_carries_one_custom_element_with_the_envelope(fake: FakeTencentIM) -> None:
    sink = make_sink(fake)
    envelope = event("evt_1", "RoomUserJoined", "r_42", room_version=7, payload={"user_id": "u1", "名字": "小军"})
    try:
        await sink.deliver(envelope)
    finally:
        await sink.aclose()
    (message,) = fake.messages
    assert message.group_id == "r_42"
    assert message.random == random_for("default", "evt_1")
    assert message.priority == "Normal"
    assert [e["MsgType"] for e in message.msg_body] == ["TIMCustomElem"]
    assert message.data is not None and " " not in message.data  # compact JSON
    assert json.loads(message.data) == {
        "event_id": "evt_1",
        "event_type": "RoomUserJoined",
        "app_code": "default",
        "room_id": "r_42",
        "room_version": 7,
        "occurred_at_ms": 1764400000000,
        "payload": {"user_id": "u1", "名字": "小军"},
    }


async def test_priority_per_event_type(fake: FakeTencentIM) -> None:
    sink = make_sink(fake, msg_priority={"RoomUserLeft": "Low", "RoomClosed": "Normal"})
    types = ["RoomGiftSent", "RoomUserKicked", "RoomClosed", "RoomUserLeft", "RoomMicChanged"]
    try:
        for i, event_type in enumerate(types):
            await sink.deliver(event(f"e{i}", event_type))
    finally:
        await sink.aclose()
    # Defaults High for gifts/kicks/close, a configured type overrides only itself.
    assert [m.priority for m in fake.messages] == ["High", "High", "Normal", "Low", "Normal"]


async def test_group_id_template(fake: FakeTencentIM) -> None:
    sink = make_sink(fake, group_id_template="@TGS#{app_code}_{room_id}")
    try:
        await sink.deliver(event("e1", room_id="r_9"))
    finally:
        await sink.aclose()
    assert fake.messages[0].group_id == "@TGS#default_r_9"


async def test_a_retried_event_is_deduplicated_by_tencent(fake: FakeTencentIM) -> None:
    sink = make_sink(fake)
    try:
        for _ in range(3):
            await sink.deliver(event("evt_same"))
        await sink.deliver(event("evt_other"))
    finally:
        await sink.aclose()
    assert fake.event_ids() == ["evt_same", "evt_other"]
    assert fake.duplicates == 2 and len(fake.arrivals) == 4


class QueryRecordingFake(FakeTencentIM):
    """The fake Tencent IM, also keeping every request's query parameters."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.queries: list[dict[str, list[str]]] = []

    async def handle(self, method: str, target: str, body: bytes) -> Any:
        self.queries.append(parse_qs(urlsplit(target).query))
        return await super().handle(method, target, body)


async def test_each_request_has_its_own_random_and_the_current_usersig() -> None:
    """The URL is built once per UserSig: a renewed UserSig is in the very next request."""
    async with serve_fake_im(QueryRecordingFake(seed=7)) as fake:
        secrets: list[str] = []
        sink = make_sink(fake, secrets)
        now = [time.time()]
        sink._apps_by_code["default"].usersig.clock = lambda: now[0]
        try:
            await sink.deliver(event("e1"))
            await sink.deliver(event("e2"))
            now[0] += 86400 / 2  # half the default lifetime: renewed on the next request
            await sink.deliver(event("e3"))
        finally:
            await sink.aclose()
    usersigs = [query["usersig"] for query in fake.queries]
    assert usersigs[0] == usersigs[1] != usersigs[2]
    assert [usersigs[0][0], usersigs[2][0]] == secrets[1:]  # each made once, each registered
    assert len({query["random"][0] for query in fake.queries}) == 3
    assert fake.event_ids() == ["e1", "e2", "e3"]
