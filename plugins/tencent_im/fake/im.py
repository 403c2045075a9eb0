"""A fake Tencent Cloud IM: ``send_group_msg`` checked and answered as Tencent does.

What it checks, in Tencent's order and with Tencent's ErrorCodes: the query parameters
(``sdkappid``, ``identifier``, ``usersig``, ``random``, ``contenttype=json``), the UserSig
against the app's key (70003 undecodable, 70014/70013 sdkappid/identifier mismatch, 70009
wrong key, 70001 expired), that the identifier is an app admin (60010), and the body
(``GroupId``, u32 ``Random``, ``MsgBody`` elements, ``MsgPriority``; 60003 not JSON, 10004
malformed, 80002 too large, 10010 unknown group when ``groups`` is set).

What it answers: ``ActionStatus``/``ErrorCode``/``ErrorInfo`` and, on success, ``MsgSeq``
(per group, from 1) and ``MsgTime``. A message whose (GroupId, Random) was accepted within
the last 5 minutes is answered OK again with the first copy's MsgSeq and not recorded twice.

Faults (:class:`Faults`, settable in-process or with ``POST /_fake/faults``) are applied in
this order: hang → latency → HTTP 5xx → (checks above) → rate limits (60011 per app, 10023
per group, above a QPS) → ``fail_next`` → ``error_rate`` → ``drop_rate`` (OK with
``MsgDropReason``, not recorded).

The HTTP side lives in :mod:`.server`; this module is plain logic, easy to drive directly.
"""

from __future__ import annotations

import json
import random
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

import anyio
from pydantic import BaseModel, ConfigDict, Field

from room_outbox.plugins.tencent_im.message import SEND_GROUP_MSG
from room_outbox.plugins.tencent_im.usersig import UserSigError, verify_usersig

CONTROL_PREFIX = "/_fake/"

#: A key for local development and tests only; never use it for a real app.
DEV_SDKAPPID = 1400000000
DEV_KEY = "room-outbox-dev-key-not-a-secret"
DEFAULT_ADMIN = "administrator"

DEDUP_WINDOW = 300.0
MAX_MESSAGE_BYTES = 8000
MSG_TYPES = frozenset(
    {"TIMTextElem", "TIMLocationElem", "TIMFaceElem", "TIMCustomElem", "TIMSoundElem", "TIMImageElem",
     "TIMFileElem", "TIMVideoFileElem"}
)  # fmt: skip
PRIORITIES = frozenset({"High", "Normal", "Low"})


class Faults(BaseModel):
    """Fault injection. Rates are probabilities in [0, 1] drawn per request."""

    model_config = ConfigDict(extra="forbid")

    #: Answer this share of requests with an ErrorCode drawn from ``error_codes``.
    error_rate: float = Field(default=0.0, ge=0, le=1)
    error_codes: list[int] = [10002]
    #: Answer the next requests with these ErrorCodes, one each, in order (then normally).
    fail_next: list[int] = []
    #: Answer this share with a bare HTTP ``http_status`` (a gateway failure, no JSON).
    http_error_rate: float = Field(default=0.0, ge=0, le=1)
    http_status: int = Field(default=502, ge=400, le=599)
    #: Seconds added before every answer.
    latency: float = Field(default=0.0, ge=0)
    #: Never answer this share of requests (until the client gives up and disconnects).
    hang_rate: float = Field(default=0.0, ge=0, le=1)
    #: Answer OK but drop this share (``MsgDropReason``), as Tencent's rate control does.
    drop_rate: float = Field(default=0.0, ge=0, le=1)
    drop_reason: str = "MsgFreqCtrl"
    #: Above this many requests per second per app: ErrorCode 60011.
    app_qps_limit: float | None = Field(default=None, gt=0)
    #: Above this many messages per second per group: ErrorCode 10023.
    group_qps_limit: float | None = Field(default=None, gt=0)


@dataclass(frozen=True)
class ReceivedMessage:
    sdkappid: int
    group_id: str
    random: int
    priority: str | None
    msg_body: list[dict[str, Any]]
    msg_seq: int
    msg_time: int
    cloud_custom_data: str | None = None

    @property
    def data(self) -> str | None:
        """``Data`` of the first TIMCustomElem."""
        for element in self.msg_body:
            if element.get("MsgType") == "TIMCustomElem":
                data = element.get("MsgContent", {}).get("Data")
                return data if isinstance(data, str) else None
        return None

    @property
    def payload(self) -> dict[str, Any] | None:
        """``Data`` parsed as JSON (the room-outbox envelope), or ``None``."""
        try:
            value = json.loads(self.data or "")
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    @property
    def event_id(self) -> str | None:
        value = (self.payload or {}).get("event_id")
        return value if isinstance(value, str) else None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "event_id": self.event_id}


@dataclass(frozen=True)
class Arrival:
    """One request to ``send_group_msg`` as it arrived (monotonic time), and its answer."""

    at: float
    sdkappid: int | None
    group_id: str | None
    http_status: int
    error_code: int | None


@dataclass
class Reply:
    status: int
    body: bytes = b""
    hang: bool = False
    content_type: str = "application/json"


class _Refusal(Exception):
    def __init__(self, code: int, info: str) -> None:
        super().__init__(info)
        self.code = code
        self.info = info


@dataclass
class FakeTencentIM:
    """State and behaviour of the fake; serve it with :func:`room_outbox.plugins.tencent_im.fake.serve_fake_im`.

    ``apps`` maps SDKAppID → secret key; ``admins`` are the identifiers allowed to call the
    REST API; ``groups`` (``None``: any) are the groups that exist.
    """

    apps: dict[int, str] = field(default_factory=lambda: {DEV_SDKAPPID: DEV_KEY})
    admins: set[str] = field(default_factory=lambda: {DEFAULT_ADMIN})
    groups: set[str] | None = None
    faults: Faults = field(default_factory=Faults)
    seed: int | None = None
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time

    messages: list[ReceivedMessage] = field(default_factory=list, init=False)
    arrivals: list[Arrival] = field(default_factory=list, init=False)
    duplicates: int = field(default=0, init=False)
    #: Requests refused for being above ``app_qps_limit`` / ``group_qps_limit``: what Tencent
    #: would have rejected with 60011 / 10023.
    over_quota: dict[str, int] = field(default_factory=lambda: {"app": 0, "group": 0}, init=False)
    base_url: str = field(default="", init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._seq: dict[str, int] = {}
        self._seen: dict[tuple[str, int], tuple[float, ReceivedMessage]] = {}
        self._app_window: dict[int, deque[float]] = {}
        self._group_window: dict[str, deque[float]] = {}

    # -- in-process control --------------------------------------------------------------

    def set_faults(self, **changes: Any) -> Faults:
        self.faults = Faults.model_validate({**self.faults.model_dump(), **changes})
        return self.faults

    def reset(self) -> None:
        """Forget messages, arrivals, de-duplication state and faults."""
        self.messages.clear()
        self.arrivals.clear()
        self.duplicates = 0
        self.over_quota = {"app": 0, "group": 0}
        self.faults = Faults()
        self.__post_init__()

    def sink_section(self) -> dict[str, Any]:
        """The ``sinks.tencent_im`` settings that point the sink at this fake (its first app,
        as its first admin); serve it first, for ``base_url``."""
        (sdkappid, key), admin = next(iter(self.apps.items())), min(self.admins)
        return {"base_url": self.base_url, "sdkappid": sdkappid, "secret_key": key, "identifier": admin}

    def event_ids(self) -> list[str | None]:
        return [m.event_id for m in self.messages]

    def max_in_window(self, window: float = 1.0, *, group_id: str | None = None, sdkappid: int | None = None) -> int:
        """Most requests that arrived within any ``window`` seconds (optionally for one
        group or app): what a server-side rate limit would have counted."""
        times = [
            a.at
            for a in self.arrivals
            if (group_id is None or a.group_id == group_id) and (sdkappid is None or a.sdkappid == sdkappid)
        ]
        best, start = 0, 0
        for end, t in enumerate(times):
            while t - times[start] >= window:
                start += 1
            best = max(best, end - start + 1)
        return best

    # -- HTTP entry point ----------------------------------------------------------------

    async def handle(self, method: str, target: str, body: bytes) -> Reply:
        url = urlsplit(target)
        if url.path.startswith(CONTROL_PREFIX):
            return self._control(method, url.path.removeprefix(CONTROL_PREFIX), body)
        if url.path != SEND_GROUP_MSG:
            return _answer(60009, f"request resource error: {url.path} is not served by this fake")
        arrived = self.clock()
        faults = self.faults
        if faults.hang_rate and self._rng.random() < faults.hang_rate:
            self._arrive(arrived, None, None, 0, None)
            return Reply(status=0, hang=True)
        if faults.latency:
            await anyio.sleep(faults.latency)
        if faults.http_error_rate and self._rng.random() < faults.http_error_rate:
            self._arrive(arrived, None, None, faults.http_status, None)
            return Reply(faults.http_status, b"<html><body>bad gateway</body></html>", content_type="text/html")
        sdkappid: int | None = None
        group_id: str | None = None
        try:
            if method != "POST":
                raise _Refusal(60002, "HTTP parse error: send_group_msg takes POST")
            sdkappid = self._authenticate(parse_qs(url.query))
            message = self._parse_body(body)
            group_id = message["GroupId"]
            self._limit_rate(arrived, sdkappid, group_id)
            if faults.fail_next:
                raise _Refusal(faults.fail_next.pop(0), "injected failure (fail_next)")
            if faults.error_rate and self._rng.random() < faults.error_rate:
                raise _Refusal(self._rng.choice(faults.error_codes or [10002]), "injected failure (error_rate)")
            if faults.drop_rate and self._rng.random() < faults.drop_rate:
                self._arrive(arrived, sdkappid, group_id, 200, 0)
                return _ok(self._next_seq(group_id), int(self.wall_clock()), faults.drop_reason)
            received = self._accept(arrived, sdkappid, message)
        except _Refusal as refusal:
            self._arrive(arrived, sdkappid, group_id, 200, refusal.code)
            return _answer(refusal.code, refusal.info)
        self._arrive(arrived, sdkappid, group_id, 200, 0)
        return _ok(received.msg_seq, received.msg_time)

    # -- checks --------------------------------------------------------------------------

    def _authenticate(self, query: Mapping[str, list[str]]) -> int:
        def one(name: str) -> str:
            values = query.get(name)
            if not values or not values[0]:
                code = 60012 if name == "sdkappid" else 60002
                raise _Refusal(code, f"HTTP parse error: query parameter {name} is missing")
            return values[0]

        try:
            sdkappid = int(one("sdkappid"))
        except ValueError:
            raise _Refusal(60002, "HTTP parse error: sdkappid is not a number") from None
        identifier = one("identifier")
        usersig = one("usersig")
        try:
            request_random = int(one("random"))
        except ValueError:
            raise _Refusal(60002, "HTTP parse error: random is not a number") from None
        if not 0 <= request_random < 2**32:
            raise _Refusal(60002, "HTTP parse error: random is not a 32-bit unsigned integer")
        if one("contenttype") != "json":
            raise _Refusal(60002, "HTTP parse error: contenttype must be json")
        key = self.apps.get(sdkappid)
        if key is None:
            raise _Refusal(70020, "SDKAppID not found, UserSig verification failed")
        try:
            verify_usersig(usersig, sdkappid=sdkappid, identifier=identifier, key=key, now=self.wall_clock())
        except UserSigError as exc:
            raise _Refusal(exc.code, str(exc)) from None
        if identifier not in self.admins:
            raise _Refusal(60010, "the request needs App admin permission")
        return sdkappid

    def _parse_body(self, body: bytes) -> dict[str, Any]:
        try:
            message = json.loads(body)
        except ValueError:
            raise _Refusal(60003, "HTTP request JSON parse error") from None
        if not isinstance(message, dict):
            raise _Refusal(60003, "HTTP request JSON parse error: expected an object")
        group_id = message.get("GroupId")
        if not isinstance(group_id, str) or not group_id:
            raise _Refusal(10004, "parameter invalid: GroupId must be a non-empty string")
        rnd = message.get("Random")
        if not isinstance(rnd, int) or isinstance(rnd, bool) or not 0 <= rnd < 2**32:
            raise _Refusal(10004, "parameter invalid: Random must be a 32-bit unsigned integer")
        priority = message.get("MsgPriority")
        if priority is not None and priority not in PRIORITIES:
            raise _Refusal(10004, "parameter invalid: MsgPriority must be High, Normal or Low")
        body_elems = message.get("MsgBody")
        if not isinstance(body_elems, list) or not body_elems:
            raise _Refusal(10004, "parameter invalid: MsgBody must be a non-empty array")
        for element in body_elems:
            if not isinstance(element, dict) or element.get("MsgType") not in MSG_TYPES:
                raise _Refusal(10004, "parameter invalid: MsgBody element with an unknown MsgType")
            content = element.get("MsgContent")
            if not isinstance(content, dict):
                raise _Refusal(10004, "parameter invalid: MsgBody element without MsgContent")
            if element["MsgType"] == "TIMCustomElem" and not isinstance(content.get("Data"), str):
                raise _Refusal(10004, "parameter invalid: TIMCustomElem needs a string Data")
        size = len(json.dumps(body_elems, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
        if size > MAX_MESSAGE_BYTES:
            raise _Refusal(80002, f"message too long: {size} bytes, at most {MAX_MESSAGE_BYTES}")
        if self.groups is not None and group_id not in self.groups:
            raise _Refusal(10010, "the group does not exist or has been dismissed")
        return message

    def _limit_rate(self, now: float, sdkappid: int, group_id: str) -> None:
        app_limit, group_limit = self.faults.app_qps_limit, self.faults.group_qps_limit
        if app_limit is not None and _over(self._app_window.setdefault(sdkappid, deque()), app_limit, now):
            self.over_quota["app"] += 1
            raise _Refusal(60011, f"SDKAppID request frequency exceeds {app_limit:g}/s")
        if group_limit is not None and _over(self._group_window.setdefault(group_id, deque()), group_limit, now):
            self.over_quota["group"] += 1
            raise _Refusal(10023, f"message frequency in this group exceeds {group_limit:g}/s")

    def _accept(self, now: float, sdkappid: int, message: dict[str, Any]) -> ReceivedMessage:
        key = (message["GroupId"], message["Random"])
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < DEDUP_WINDOW:
            self.duplicates += 1
            return seen[1]
        received = ReceivedMessage(
            sdkappid=sdkappid,
            group_id=message["GroupId"],
            random=message["Random"],
            priority=message.get("MsgPriority"),
            msg_body=message["MsgBody"],
            msg_seq=self._next_seq(message["GroupId"]),
            msg_time=int(self.wall_clock()),
            cloud_custom_data=message.get("CloudCustomData"),
        )
        self._seen[key] = (now, received)
        self.messages.append(received)
        return received

    def _next_seq(self, group_id: str) -> int:
        self._seq[group_id] = self._seq.get(group_id, 0) + 1
        return self._seq[group_id]

    def _arrive(self, at: float, sdkappid: int | None, group_id: str | None, status: int, code: int | None) -> None:
        self.arrivals.append(Arrival(at, sdkappid, group_id, status, code))

    # -- control endpoints ---------------------------------------------------------------

    def _control(self, method: str, action: str, body: bytes) -> Reply:
        if method == "GET" and action == "messages":
            return _json(200, {"messages": [m.to_json() for m in self.messages]})
        if method == "GET" and action == "stats":
            return _json(200, self._stats())
        if method == "POST" and action == "faults":
            try:
                changes = json.loads(body or b"{}")
                if not isinstance(changes, dict):
                    raise ValueError("expected a JSON object")
                self.set_faults(**changes)
            except ValueError as exc:  # pydantic's ValidationError is a ValueError
                return _json(400, {"error": str(exc)})
            return _json(200, {"faults": self.faults.model_dump()})
        if method == "POST" and action == "reset":
            self.reset()
            return _json(200, self._stats())
        return _json(404, {"error": f"unknown control endpoint {method} {CONTROL_PREFIX}{action}"})

    def _stats(self) -> dict[str, Any]:
        return {
            "requests": len(self.arrivals),
            "messages": len(self.messages),
            "duplicates": self.duplicates,
            "over_quota": dict(self.over_quota),
            "faults": self.faults.model_dump(),
        }


def _over(window: deque[float], limit: float, now: float) -> bool:
    """Count ``now`` in a one-second sliding window; true when that would exceed ``limit``."""
    while window and now - window[0] >= 1.0:
        window.popleft()
    if len(window) >= limit:
        return True
    window.append(now)
    return False


def _json(status: int, doc: dict[str, Any]) -> Reply:
    return Reply(status, json.dumps(doc, ensure_ascii=False).encode("utf-8"))


def _answer(code: int, info: str) -> Reply:
    return _json(200, {"ActionStatus": "FAIL", "ErrorCode": code, "ErrorInfo": info})


def _ok(msg_seq: int, msg_time: int, drop_reason: str | None = None) -> Reply:
    doc: dict[str, Any] = {
        "ActionStatus": "OK",
        "ErrorCode": 0,
        "ErrorInfo": "",
        "MsgTime": msg_time,
        "MsgSeq": msg_seq,
    }
    if drop_reason:
        doc["MsgDropReason"] = drop_reason
    return _json(200, doc)
