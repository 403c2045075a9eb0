"""The Tencent IM sink: one ``send_group_msg`` call per event.

Per delivery: pick the app by ``app_code`` → build the body (refuse > ``max_message_bytes``
without a request) → wait for a group slot, then an app slot → POST → read the verdict from
the body. Errors are translated here, once (see :mod:`.errors`), and their text carries the
HTTP status or ErrorCode/ErrorInfo, never the key, the UserSig or the response body.
"""

from __future__ import annotations

import http.client
import http.cookiejar
import json
import random
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlencode, urlsplit

import aiohttp
import anyio
import httpx
from httpx_aiohttp import AiohttpTransport

from room_outbox import (
    EventEnvelope,
    PermanentSinkError,
    Redactor,
    RetryableSinkError,
    SinkContext,
    ThrottledSinkError,
    http_client_span,
)
from room_outbox.plugins.tencent_im.errors import (
    APP_RATE_CODES,
    GROUP_RATE_CODES,
    GROUP_RATE_DROP,
    USERSIG_EXPIRED,
    error_for_code,
    short_info,
)
from room_outbox.plugins.tencent_im.message import SEND_GROUP_MSG, body_size, group_id_for, msg_body, request_body
from room_outbox.plugins.tencent_im.ratelimit import KeyedLimiter, SlidingWindowLimiter
from room_outbox.plugins.tencent_im.settings import TencentIMSettings
from room_outbox.plugins.tencent_im.usersig import UserSigCache
from room_outbox.tls import as_servers_clients_check

#: UserSigs of one app masked at a time: the one in use and the one before it, which a request
#: still in flight may have sent.
USERSIGS_KEPT = 2


@dataclass
class TencentApp:
    """One Tencent IM app: where to call, as whom, and its own request-rate limiter."""

    name: str
    sdkappid: int
    identifier: str
    base_url: str
    usersig: UserSigCache
    limiter: SlidingWindowLimiter
    #: The request URL up to ``random=``, and the UserSig it was built with.
    _url_prefix: str = field(default="", repr=False)
    _url_usersig: str = field(default="", repr=False)

    def url(self) -> httpx.URL:
        """The request URL. Only ``random`` changes per request; the rest only when the UserSig
        is renewed. ``random`` only tells requests apart (Tencent de-duplicates by the body's
        ``Random``), so it needs no unpredictability: the secrets module's system call per
        request cost more than building the rest of the URL. One parsed URL per request: a
        string plus params would be parsed and encoded again by the client."""
        usersig = self.usersig.get()
        if usersig != self._url_usersig:
            query = {
                "sdkappid": self.sdkappid,
                "identifier": self.identifier,
                "usersig": usersig,
                "contenttype": "json",
            }
            self._url_prefix = f"{httpx.URL(self.base_url + SEND_GROUP_MSG)}?{urlencode(query)}&random="
            self._url_usersig = usersig
        return httpx.URL(f"{self._url_prefix}{random.getrandbits(32)}")


class TencentIMSink:
    def __init__(self, settings: TencentIMSettings, context: SinkContext) -> None:
        self.settings = settings
        self.log = context.logger
        self._room_column = context.room_column
        self._add_secret = context.add_secret
        self._remove_secret = context.remove_secret
        # The sink's own secrets, masked in its error texts even before they reach the core
        # (which masks them again with the process's redactor, told through add_secret).
        self._own_secrets = Redactor()
        self._apps_by_code: dict[str, TencentApp] = {}
        # Both limits are Tencent's for the whole deployment: this process keeps to its share
        # of what room-service's pushes leave (reserved_share).
        self._quota = context.quota
        app_limit, group_limit = settings.usable(settings.app_rate_limit), settings.usable(settings.group_rate_limit)
        self._app_rate = lambda: self._quota.split(app_limit)
        # Tencent counts requests per SDKAppID: app codes sharing one share its limiter.
        self._app_limiters: dict[int, SlidingWindowLimiter] = {}
        default = self._make_app(
            "default", settings.sdkappid, settings.identifier, settings.base_url, settings.secret_key.get_secret_value()
        )
        for code in settings.default_app_codes:
            self._apps_by_code[code] = default
        for code, creds in settings.apps.items():
            self._apps_by_code[code] = self._make_app(
                code,
                creds.sdkappid,
                creds.identifier or settings.identifier,
                creds.base_url or settings.base_url,
                creds.secret_key.get_secret_value(),
            )
        group_per_room = self._one_room_per_group()
        if group_per_room:
            # A room that changes owner then waits a window, until its former owner's last
            # messages to its group have left Tencent's window.
            self._quota.limits_rooms = True
        self._groups = KeyedLimiter(lambda: self._quota.split(group_limit, per_room=group_per_room))
        proxy = urlsplit(settings.proxy.get_secret_value())
        if proxy.password:
            self._remember_secret(proxy.password)
            self._remember_secret(unquote(proxy.password))
        self._client = http_client(settings)

    def _make_app(self, name: str, sdkappid: int, identifier: str, base_url: str, key: str) -> TencentApp:
        self._remember_secret(key)
        usersig = UserSigCache(sdkappid, identifier, key, int(self.settings.usersig_ttl), on_new=self._usersigs_kept())
        limiter = self._app_limiters.get(sdkappid)
        if limiter is None:
            limiter = self._app_limiters[sdkappid] = SlidingWindowLimiter(self._app_rate)
        return TencentApp(name, sdkappid, identifier, base_url, usersig, limiter)

    def _one_room_per_group(self) -> bool:
        """Whether every Tencent group is fed by one room bucket's events, so that with per-room
        ordering its owner may keep the whole group limit. A room bucket is an (app_code, room)
        pair; a group is a group_id within an SDKAppID. So the template must hold {room_id},
        and either {app_code} too or no SDKAppID may serve two app codes (their rooms of one
        name, in two buckets with two owners, would be one group). The empty app code is not
        counted: it is the app of rows whose producer writes none, and such a producer writes
        it for every row, so its rooms never share a group with another code's."""
        template = self.settings.group_id_template
        if "{room_id}" not in template:
            return False
        if "{app_code}" in template:
            return True
        codes: dict[int, int] = {}
        for code, app in self._apps_by_code.items():
            if code:
                codes[app.sdkappid] = codes.get(app.sdkappid, 0) + 1
        return all(count == 1 for count in codes.values())

    def _remember_secret(self, secret: str) -> None:
        """Every secret key and every UserSig the cache makes (raw and URL-encoded forms)."""
        self._own_secrets.add(secret)
        self._add_secret(secret)

    def _usersigs_kept(self) -> Callable[[str], None]:
        """One app's UserSig cache's ``on_new``: each new UserSig is a secret, and the one before
        the last is forgotten (no request sends it any more). A cache renewed over and over (a
        clock behind Tencent's by more than ``usersig_ttl``: every UserSig answered 70001)
        would otherwise pile up secrets, each making every later one dearer to add.

        Only distinct UserSigs are kept: those made within one second are identical (the issue
        time is in whole seconds), so several deliveries renewing at once hand the same one in
        again. Kept twice, it would push itself out and be forgotten while still in use."""
        kept: deque[str] = deque()

        def remember(usersig: str) -> None:
            if usersig in kept:
                kept.remove(usersig)  # the newest again: it moves to the end, never pushed out
            else:
                self._remember_secret(usersig)
            kept.append(usersig)
            if len(kept) > USERSIGS_KEPT:
                old = kept.popleft()
                self._own_secrets.discard(old)
                self._remove_secret(old)

        return remember

    # -- the Sink protocol ---------------------------------------------------------------

    async def deliver(self, envelope: EventEnvelope) -> None:
        app = self._apps_by_code.get(envelope.app_code)
        if app is None:
            # A configuration gap, like Tencent's own credential errors (70009, 70020):
            # permanent for this configuration; the event stays in the outbox until fixed.
            raise PermanentSinkError(
                f"no Tencent IM credentials for app_code {envelope.app_code!r}: "
                f"add sinks.tencent_im.apps.{envelope.app_code or '<app_code>'} or list it in default_app_codes"
            )
        group_id = group_id_for(self.settings.group_id_template, envelope, self._room_column)
        body = msg_body(envelope)
        size = body_size(body)
        if size > self.settings.max_message_bytes:
            raise PermanentSinkError(
                f"message is {size} bytes; Tencent IM accepts at most {self.settings.max_message_bytes}"
                f" (GroupId {group_id}, app {app.name})"
            )
        content = request_body(group_id, envelope, body, self.settings.priority_for(envelope.event_type))
        answer = await self._send(app, content, group_id)
        if answer.get("ErrorCode") == USERSIG_EXPIRED:
            # Our clock or cache disagrees with Tencent's: make a fresh UserSig, try once more.
            app.usersig.invalidate()
            self.log.info("UserSig expired at Tencent (70001); regenerated, retrying once", extra={"app": app.name})
            answer = await self._send(app, content, group_id)
        self._verdict(answer, app, group_id, envelope.event_id)

    async def aclose(self) -> None:
        await self._client.aclose()

    # -- helpers -------------------------------------------------------------------------

    async def _send(self, app: TencentApp, content: bytes, group_id: str) -> dict[str, Any]:
        """POST within both rate limits; the slots stay busy until the answer is back. A limit
        with no slot in time: :class:`ThrottledSinkError`, as nothing was sent (not an attempt)."""
        group = self._groups.get(self._group_key(app, group_id))
        if not (group.try_acquire() or await group.acquire(self._max_wait())):
            raise ThrottledSinkError(
                f"client-side rate limit: group {group_id} is above this process's share"
                f" ({group.rate}/s of {self.settings.group_rate_limit}/s)",
                retry_after=group.next_slot_in(),
            )
        sent = False
        try:
            if not (app.limiter.try_acquire() or await app.limiter.acquire(self._max_wait())):
                raise ThrottledSinkError(
                    f"client-side rate limit: app {app.name} is above this process's share"
                    f" ({app.limiter.rate}/s of {self.settings.app_rate_limit}/s)",
                    retry_after=app.limiter.next_slot_in(),
                )
            try:
                sent = True
                return await self._post(app, content, group_id)
            finally:
                app.limiter.release()
        finally:
            group.release(sent)

    @staticmethod
    def _group_key(app: TencentApp, group_id: str) -> str:
        """A group is Tencent's within its app: one name in two apps is two groups."""
        return f"{app.sdkappid}/{group_id}"

    def _max_wait(self) -> float:
        """How long to wait for a rate-limit slot. Waiting spends the caller's publish_timeout:
        a request sent at the end of it would be cut off after it may have arrived, and sent
        again later. So at most half of what is left is spent waiting."""
        left = anyio.current_effective_deadline() - anyio.current_time()
        return min(self.settings.rate_limit_max_wait, left / 2)

    async def _post(self, app: TencentApp, content: bytes, group_id: str) -> dict[str, Any]:
        url = app.url()
        try:
            # The child span's URL carries the query with usersig masked (redact_url).
            with http_client_span("POST", lambda: str(url)) as span, anyio.fail_after(self.settings.request_timeout):
                response = await self._client.post(url, content=content)
                span.set_attribute("http.response.status_code", response.status_code)
        except TimeoutError as exc:  # request_timeout: the whole request
            raise RetryableSinkError(f"timeout ({type(exc).__name__}) calling Tencent IM app {app.name}") from exc
        except httpx.TimeoutException as exc:
            if exc.__cause__ is not None and not isinstance(exc.__cause__, TimeoutError):
                # The aiohttp transport reports a refused or dropped connection as ConnectTimeout;
                # the cause tells, and names it (no timeout to speak of).
                raise RetryableSinkError(
                    f"network error ({self._scrub(exc.__cause__)}) calling Tencent IM app {app.name}"
                ) from exc
            raise RetryableSinkError(f"timeout ({type(exc).__name__}) calling Tencent IM app {app.name}") from exc
        except (httpx.HTTPError, aiohttp.ClientError) as exc:  # the latter: what the transport leaves untranslated
            raise RetryableSinkError(f"network error ({self._scrub(exc)}) calling Tencent IM app {app.name}") from exc
        status, raw = response.status_code, response.content
        if status != 200:
            raise RetryableSinkError(f"HTTP {status} from Tencent IM (GroupId {group_id}, app {app.name})")
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or "ActionStatus" not in answer:
            raise RetryableSinkError(
                f"unexpected answer from Tencent IM: HTTP 200 with {len(raw)} bytes that are not "
                f"the expected JSON (GroupId {group_id}, app {app.name})"
            )
        return answer

    def _verdict(self, answer: dict[str, Any], app: TencentApp, group_id: str, event_id: str) -> None:
        try:
            code = int(answer.get("ErrorCode", 0))
        except (TypeError, ValueError):
            raise RetryableSinkError(
                f"unexpected answer from Tencent IM: ErrorCode is not a number (GroupId {group_id}, app {app.name})"
            ) from None
        redact = self._own_secrets.redact
        if answer.get("ActionStatus") != "OK" or code != 0:
            info = str(answer.get("ErrorInfo", ""))
            if code in APP_RATE_CODES | GROUP_RATE_CODES:
                limiter = app.limiter if code in APP_RATE_CODES else self._groups.get(self._group_key(app, group_id))
                text = f"ErrorCode {code}: {short_info(info, redact)}"
                raise self._refused_for_rate(limiter, text, app, group_id, event_id)
            raise error_for_code(code or -1, info, f"GroupId {group_id}, app {app.name}", redact)
        drop = answer.get("MsgDropReason")
        if drop == GROUP_RATE_DROP:
            text = f"MsgDropReason {GROUP_RATE_DROP}"
            raise self._refused_for_rate(
                self._groups.get(self._group_key(app, group_id)), text, app, group_id, event_id
            )
        if drop:
            # Accepted, then dropped by Tencent: not delivered, so not a success.
            raise RetryableSinkError(
                f"Tencent IM dropped the message: MsgDropReason {short_info(str(drop), redact)}"
                f" (GroupId {group_id}, app {app.name})"
            )

    def _refused_for_rate(
        self, limiter: SlidingWindowLimiter, text: str, app: TencentApp, group_id: str, event_id: str
    ) -> ThrottledSinkError:
        """Tencent refused (or dropped) the message for its rate limit: nothing was delivered,
        so it is no attempt (the event keeps its retries and is never parked for it) but a
        throttled delivery, due again once the limiter has a slot, with the answer in the
        row's ``last_error`` (``refused``). The limiter it names (the app's or the group's) is
        slowed down, as others (room-service's pushes) are using the rate this process's share
        assumed free; sending at the share again would only be refused again."""
        refused = limiter.slow_down()
        if refused:  # once a window at most, with how many it stands for: an app's is worth a warning
            log = self.log.warning if limiter is app.limiter else self.log.info
            log(
                "Tencent IM refused for its rate limit; sending slower for a while",
                extra={
                    "app": app.name,
                    "sdkappid": app.sdkappid,
                    "group_id": group_id,
                    "event_id": event_id,  # one of them, this one
                    "refused": refused,
                    "answer": text,
                },
            )
        retry_after = limiter.next_slot_in()
        return ThrottledSinkError(
            f"refused by Tencent IM for its rate limit: {text} (GroupId {group_id}, app {app.name});"
            " this process sends slower for a while",
            retry_after=limiter.window if retry_after is None else retry_after,
            refused=True,
        )

    def _scrub(self, exc: BaseException) -> str:
        # Masked before it is shortened: a secret cut in two would no longer match.
        return short_info(self._own_secrets.redact(f"{type(exc).__name__}: {exc}"))


def http_client(settings: TencentIMSettings) -> httpx.AsyncClient:
    """One pooled client for every app (keep-alive connections are per host anyway), as many
    connections kept alive as may be open. httpx on aiohttp's transport: httpx's own
    (httpcore) spent several times its CPU per request at the lane's concurrency, and left some
    requests without an answer until their timeout (bench/ part b).
    Timeouts: connect_timeout bounds a new connection's TCP connect; the sink bounds the whole
    request with request_timeout, one timer per request (a timeout per read re-arms a timer on
    every packet). No redirects, cookies kept from answers or proxies from the environment:
    only the configured ``proxy``."""
    limits = httpx.Limits(max_connections=settings.max_connections, max_keepalive_connections=settings.max_connections)
    # Its credentials (user:password@) go to the proxy alone, as Proxy-Authorization.
    proxy = settings.proxy.get_secret_value()
    verify = httpx.create_ssl_context(trust_env=False)  # the public CAs (certifi's)
    if settings.ca_file:  # a proxy's or a private CA, checked as curl checks it
        as_servers_clients_check(verify).load_verify_locations(cafile=settings.ca_file)
    return httpx.AsyncClient(
        transport=AiohttpTransport(
            verify=verify, limits=limits, trust_env=False, proxy=httpx.Proxy(proxy) if proxy else None
        ),
        timeout=httpx.Timeout(None, connect=settings.connect_timeout),
        headers={"Content-Type": "application/json"},
        follow_redirects=False,
        trust_env=False,
        cookies=NoCookies(),
    )


class NoCookies(http.cookiejar.CookieJar):
    """Keeps no cookie from an answer, so none is ever sent back (Tencent's API sets none)."""

    def extract_cookies(self, response: http.client.HTTPResponse, request: urllib.request.Request) -> None:
        return None
