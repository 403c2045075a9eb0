"""The fake Tencent IM over real HTTP: its checks, answers, de-duplication, faults, control API."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from support import kill_if_running

from room_outbox.plugins.tencent_im.fake import DEV_KEY, DEV_SDKAPPID, FakeTencentIM, serve_fake_im
from room_outbox.plugins.tencent_im.usersig import gen_usersig

pytestmark = pytest.mark.anyio

PATH = "/v4/group_open_http_svc/send_group_msg"


@pytest.fixture
async def fake() -> AsyncIterator[FakeTencentIM]:
    async with serve_fake_im(FakeTencentIM(seed=1)) as fake:
        yield fake


@pytest.fixture
async def client(fake: FakeTencentIM) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=fake.base_url, timeout=5) as client:
        yield client


def params(
    identifier: str = "administrator", key: str = DEV_KEY, sdkappid: int = DEV_SDKAPPID, **more: str
) -> dict[str, str]:
    usersig = gen_usersig(sdkappid, key, identifier, 3600)
    return {
        "sdkappid": str(sdkappid),
        "identifier": identifier,
        "usersig": usersig,
        "random": "99",
        "contenttype": "json",
        **more,
    }


def body(group: str = "r_1", random: int = 1, data: str = '{"event_id":"e1"}', **more: Any) -> dict[str, Any]:
    return {
        "GroupId": group,
        "Random": random,
        "MsgBody": [{"MsgType": "TIMCustomElem", "MsgContent": {"Data": data}}],
        **more,
    }


async def send(
    client: httpx.AsyncClient, query: dict[str, str] | None = None, payload: Any = None, raw: bytes | None = None
) -> dict[str, Any]:
    content = raw if raw is not None else json.dumps(body() if payload is None else payload).encode()
    response = await client.post(PATH, params=params() if query is None else query, content=content)
    assert response.status_code == 200
    answer: dict[str, Any] = response.json()
    return answer


async def test_accepts_a_good_message_and_answers_like_tencent(fake: FakeTencentIM, client: httpx.AsyncClient) -> None:
    first = await send(client)
    second = await send(client, payload=body(random=2, MsgPriority="High"))
    other_group = await send(client, payload=body(group="r_2", random=3))
    assert first["ActionStatus"] == "OK" and first["ErrorCode"] == 0 and first["ErrorInfo"] == ""
    assert isinstance(first["MsgTime"], int)
    assert (first["MsgSeq"], second["MsgSeq"], other_group["MsgSeq"]) == (1, 2, 1)  # per group
    assert [m.event_id for m in fake.messages] == ["e1", "e1", "e1"]
    assert fake.messages[1].priority == "High"


@pytest.mark.parametrize(
    ("query", "code"),
    [
        ({"usersig": ""}, 60002),
        ({"sdkappid": ""}, 60012),
        ({"contenttype": "xml"}, 60002),
        ({"random": "-1"}, 60002),
        ({"usersig": "garbage"}, 70003),
        ({"sdkappid": "1400000009"}, 70020),
        ({"identifier": "someone-else"}, 70013),  # the UserSig was made for administrator
    ],
)
async def test_query_and_usersig_checks(client: httpx.AsyncClient, query: dict[str, str], code: int) -> None:
    answer = await send(client, {**params(), **query})
    assert (answer["ActionStatus"], answer["ErrorCode"]) == ("FAIL", code)


async def test_wrong_key_and_non_admin(client: httpx.AsyncClient) -> None:
    assert (await send(client, params(key="another-key")))["ErrorCode"] == 70009
    assert (await send(client, params(identifier="user1")))["ErrorCode"] == 60010


async def test_expired_usersig(client: httpx.AsyncClient) -> None:
    old = gen_usersig(DEV_SDKAPPID, DEV_KEY, "administrator", 60, int(time.time()) - 61)
    assert (await send(client, {**params(), "usersig": old}))["ErrorCode"] == 70001


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"{not json", 60003),
        ({"Random": 1, "MsgBody": body()["MsgBody"]}, 10004),
        (body(random=2**32), 10004),
        (body(random=-1), 10004),
        (body(MsgPriority="Urgent"), 10004),
        ({**body(), "MsgBody": []}, 10004),
        ({**body(), "MsgBody": [{"MsgType": "TIMMagicElem", "MsgContent": {}}]}, 10004),
        ({**body(), "MsgBody": [{"MsgType": "TIMCustomElem", "MsgContent": {"Data": 5}}]}, 10004),
        (body(data="x" * 8000), 80002),
    ],
)
async def test_body_checks(fake: FakeTencentIM, client: httpx.AsyncClient, payload: Any, code: int) -> None:
    answer = await send(client, raw=payload if isinstance(payload, bytes) else json.dumps(payload).encode())
    assert answer["ErrorCode"] == code
    assert fake.messages == []


async def test_unknown_group(fake: FakeTencentIM, client: httpx.AsyncClient) -> None:
    fake.groups = {"r_1"}
    assert (await send(client, payload=body(group="r_404")))["ErrorCode"] == 10010
    assert (await send(client))["ErrorCode"] == 0


async def test_dedup_by_group_and_random_within_five_minutes() -> None:
    now = [1000.0]
    async with (
        serve_fake_im(FakeTencentIM(clock=lambda: now[0])) as fake,
        httpx.AsyncClient(base_url=fake.base_url) as client,
    ):
        first = await send(client)
        again = await send(client)
        other_group = await send(client, payload=body(group="r_2"))
        now[0] += 300  # the window is over: the same Random is a new message
        later = await send(client)
    assert again["MsgSeq"] == first["MsgSeq"] == 1 and again["ActionStatus"] == "OK"
    assert other_group["MsgSeq"] == 1 and later["MsgSeq"] == 2
    assert len(fake.messages) == 3 and fake.duplicates == 1


async def test_injected_error_codes_http_errors_drops_and_latency(
    fake: FakeTencentIM, client: httpx.AsyncClient
) -> None:
    fake.set_faults(error_rate=0.5, error_codes=[10002, 60018])
    codes = [(await send(client, payload=body(random=i)))["ErrorCode"] for i in range(60)]
    assert set(codes) == {0, 10002, 60018}
    assert 15 <= codes.count(0) <= 45

    fake.set_faults(error_rate=0, http_error_rate=1.0, http_status=504)
    assert (await client.post(PATH, params=params(), content=b"{}")).status_code == 504

    fake.set_faults(http_error_rate=0, drop_rate=1.0)
    before = len(fake.messages)
    dropped = await send(client, payload=body(random=1000))
    assert dropped["ActionStatus"] == "OK" and dropped["MsgDropReason"] == "MsgFreqCtrl"
    assert len(fake.messages) == before

    fake.set_faults(drop_rate=0, latency=0.2)
    started = time.monotonic()
    await send(client, payload=body(random=1001))
    assert time.monotonic() - started >= 0.2


async def test_hang_holds_the_request_until_the_client_gives_up(fake: FakeTencentIM) -> None:
    fake.set_faults(hang_rate=1.0)
    async with httpx.AsyncClient(base_url=fake.base_url, timeout=0.3) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(PATH, params=params(), content=json.dumps(body()).encode())
    assert len(fake.arrivals) == 1 and fake.messages == []


async def test_chunked_bodies_are_read_and_oversized_ones_refused(
    fake: FakeTencentIM, client: httpx.AsyncClient
) -> None:
    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: Transfer-Encoding chunked
        data = json.dumps(body()).encode()
        yield data[:10]
        yield data[10:]

    chunked = await client.post(PATH, params=params(), content=chunks())
    assert chunked.json()["ErrorCode"] == 0 and len(fake.messages) == 1
    too_large = await client.post(PATH, params=params(), content=b"x" * (2 << 20))
    assert too_large.status_code == 413 and too_large.json() == {"error": "body too large"}
    assert len(fake.messages) == 1
    assert (await send(client, payload=body(random=7)))["ErrorCode"] == 0  # the server still answers


async def test_rate_limit_errors_above_a_qps(fake: FakeTencentIM, client: httpx.AsyncClient) -> None:
    fake.set_faults(group_qps_limit=3)
    codes = [(await send(client, payload=body(random=i)))["ErrorCode"] for i in range(5)]
    assert codes == [0, 0, 0, 10023, 10023]
    assert fake.over_quota == {"app": 0, "group": 2}
    fake.reset()
    fake.set_faults(app_qps_limit=2)
    codes = [(await send(client, payload=body(group=f"g{i}", random=i)))["ErrorCode"] for i in range(4)]
    assert codes == [0, 0, 60011, 60011]
    assert (await client.get("/_fake/stats")).json()["over_quota"] == {"app": 2, "group": 0}


async def test_control_endpoints(fake: FakeTencentIM, client: httpx.AsyncClient) -> None:
    await send(client)
    messages = (await client.get("/_fake/messages")).json()["messages"]
    assert [(m["group_id"], m["event_id"]) for m in messages] == [("r_1", "e1")]
    assert (await client.get("/_fake/stats")).json()["messages"] == 1

    answer = await client.post("/_fake/faults", json={"fail_next": [10010]})
    assert answer.status_code == 200 and answer.json()["faults"]["fail_next"] == [10010]
    assert (await send(client, payload=body(random=5)))["ErrorCode"] == 10010
    assert (await client.post("/_fake/faults", json={"error_rate": 3})).status_code == 400
    assert (await client.post("/_fake/faults", json={"nonsense": 1})).status_code == 400

    assert (await client.post("/_fake/reset")).json() == {**(await client.get("/_fake/stats")).json()}
    assert fake.messages == [] and fake.arrivals == []


def test_cli_subcommand_serves_until_sigterm() -> None:
    env = {**os.environ, "ROOM_OUTBOX_FAKE_IM_KEY": "cli-test-key"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "room_outbox.cli", "fake-im", "--port", "0", "--sdkappid", "1400000007"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "fake Tencent IM on http://127.0.0.1:" in line, proc.stderr.read() if proc.stderr else ""
        base_url = line.split()[4]
        good = httpx.post(
            base_url + PATH, params=params(key="cli-test-key", sdkappid=1400000007), content=json.dumps(body())
        )
        bad = httpx.post(base_url + PATH, params=params(sdkappid=1400000007), content=json.dumps(body()))
        assert good.json()["ErrorCode"] == 0 and bad.json()["ErrorCode"] == 70009
        assert httpx.get(base_url + "/_fake/messages").json()["messages"][0]["event_id"] == "e1"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        kill_if_running(proc)
