"""Configuration of the ``tencent_im`` sink (section ``sinks.tencent_im``).

The top-level ``sdkappid`` / ``identifier`` / ``secret_key`` / ``base_url`` are the *default
app*: they serve events whose ``app_code`` is listed in ``default_app_codes`` (``""`` and
``"default"`` unless configured). Further Tencent apps go under ``apps.<app_code>``; an entry
may leave out ``identifier`` and ``base_url`` to inherit the default app's. An event whose
app_code matches neither has no credentials and fails with an error naming it.

Secrets come from the environment: ``ROOM_OUTBOX__SINKS__TENCENT_IM__SECRET_KEY`` and
``ROOM_OUTBOX__SINKS__TENCENT_IM__APPS__<APP_CODE>__SECRET_KEY``. Environment variable names
are case-insensitive, so an ``apps`` entry set only from the environment gets a lower-case
app code; an environment entry is merged into the file's entry of the same code in any case.
"""

from __future__ import annotations

import ssl
import string
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_validator

from room_outbox import Duration, SinkSettings

Priority = Literal["High", "Normal", "Low"]

ENV_SECRET_KEY = "ROOM_OUTBOX__SINKS__TENCENT_IM__SECRET_KEY"
ENV_APP_SECRET_KEY = "ROOM_OUTBOX__SINKS__TENCENT_IM__APPS__<APP_CODE>__SECRET_KEY"
DEFAULT_BASE_URL = "https://console.tim.qq.com"

#: Room messages users must not miss even when Tencent sheds load.
DEFAULT_HIGH_PRIORITY = ("RoomGiftSent", "RoomUserKicked", "RoomClosed")

#: The shortest ``usersig_ttl`` accepted. A UserSig is renewed at half its lifetime, so a
#: lifetime of T tolerates a clock difference of T/2 with Tencent and renews every T/2 (its
#: issue time in whole seconds): below a minute, a few seconds' difference already has every
#: request refused as expired.
MIN_USERSIG_TTL = 60.0

#: Placeholders ``group_id_template`` may use.
TEMPLATE_FIELDS = frozenset({"room_id", "app_code"})


def _check_base_url(value: str) -> str:
    value = value.strip().rstrip("/")
    if not value.startswith(("https://", "http://")):
        raise ValueError(f"{value!r} is not an http(s) URL, e.g. {DEFAULT_BASE_URL}")
    if "?" in value or "#" in value:
        # The API's path and query are appended to it: a query or fragment here would swallow
        # them, and every request would go to the wrong resource.
        raise ValueError(f"{value!r} has a query or fragment; give the endpoint alone, e.g. {DEFAULT_BASE_URL}")
    return value


#: The sink's name: its ``sinks.<name>`` section and its label in routes, metrics and logs.
SINK_NAME = "tencent_im"


class AppCredentials(BaseModel):
    """One more Tencent IM app, for the events of one ``app_code``."""

    model_config = ConfigDict(extra="forbid")

    sdkappid: int = Field(gt=0)
    secret_key: SecretStr = Field(default=SecretStr(""), validate_default=True)
    #: ``None``: the default app's identifier / base_url.
    identifier: str | None = None
    base_url: str | None = None

    @field_validator("secret_key")
    @classmethod
    def _key_given(cls, value: SecretStr) -> SecretStr:
        if not value.get_secret_value().strip():
            raise ValueError(f"is empty; set it through the environment as {ENV_APP_SECRET_KEY}")
        return value

    @field_validator("base_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        return None if value is None else _check_base_url(value)


class TencentIMSettings(SinkSettings):
    # -- the default app (for the app codes in default_app_codes) -----------------------
    base_url: str = DEFAULT_BASE_URL
    sdkappid: int = Field(default=0, validate_default=True)
    identifier: str = "administrator"
    secret_key: SecretStr = Field(default=SecretStr(""), validate_default=True)
    #: app_code values served by the default app.
    default_app_codes: list[str] = Field(default_factory=lambda: ["", "default"])
    #: More apps: app_code → credentials.
    apps: dict[str, AppCredentials] = Field(default_factory=dict)

    # -- messages ------------------------------------------------------------------------
    group_id_template: str = "{room_id}"
    #: Per event type; merged over the defaults (High for RoomGiftSent, RoomUserKicked,
    #: RoomClosed), so listing one type does not reset the others.
    msg_priority: dict[str, Priority] = Field(default={}, validate_default=True)
    default_msg_priority: Priority = "Normal"
    #: Tencent refuses larger message bodies (the compact JSON of ``MsgBody``).
    max_message_bytes: int = Field(default=8000, gt=0, le=12000)

    # -- limits and HTTP -----------------------------------------------------------------
    #: Requests per second per Tencent app (Tencent's default quota: 200).
    app_rate_limit: int = Field(default=200, ge=1)
    #: Messages per second per group (Tencent: 40).
    group_rate_limit: int = Field(default=40, ge=1)
    #: Share of both limits left to room-service's own synchronous pushes, which count against
    #: the same Tencent quota and cannot be paced by room-outbox. The processes of a
    #: deployment split the rest (see docs/explanation/several-processes.md).
    reserved_share: float = Field(default=0.1, ge=0.0, lt=1.0)
    #: Longest wait for a rate-limit slot; beyond it the delivery fails as retryable at once.
    rate_limit_max_wait: Duration = 1.0
    #: A new connection's TCP connect.
    connect_timeout: Duration = 2.0
    #: The whole request: waiting for a pooled connection, sending, the answer. Tencent's own
    #: server-side timeout is 3 s.
    request_timeout: Duration = 3.0
    max_connections: int = Field(default=64, ge=1)
    #: An HTTP proxy every request goes through (``http://[user:password@]host:port``), for a
    #: network whose only way out is one. Proxies in the environment (``HTTPS_PROXY``) are not
    #: used: every request's route is this file's choice.
    proxy: SecretStr = SecretStr("")
    #: A CA bundle (PEM) trusted besides the public CAs, for a proxy that inspects TLS or an
    #: endpoint whose certificate a private CA signed.
    ca_file: str = ""
    #: UserSig lifetime; renewed at half of it. Tencent advises at least 24 h.
    usersig_ttl: Duration = 86400.0

    @field_validator("sdkappid")
    @classmethod
    def _sdkappid_given(cls, value: int, info: ValidationInfo) -> int:
        if value <= 0 and info.data.get("enabled", True):
            raise ValueError("is required: the SDKAppID of the Tencent IM app (console → app → SDKAppID)")
        return value

    @field_validator("usersig_ttl")
    @classmethod
    def _usersig_lasts(cls, value: float) -> float:
        if value < MIN_USERSIG_TTL:
            raise ValueError(
                f"{value:g}s is too short: at least {MIN_USERSIG_TTL:g}s (Tencent advises 24h); a UserSig that"
                " short is refused as expired (ErrorCode 70001) on every request once clocks differ by a little"
            )
        return value

    @field_validator("secret_key")
    @classmethod
    def _key_given(cls, value: SecretStr, info: ValidationInfo) -> SecretStr:
        if not value.get_secret_value().strip() and info.data.get("enabled", True):
            raise ValueError(f"is empty; set it through the environment as {ENV_SECRET_KEY}")
        return value

    @field_validator("base_url")
    @classmethod
    def _url(cls, value: str) -> str:
        return _check_base_url(value)

    @field_validator("proxy")
    @classmethod
    def _proxy_url(cls, value: SecretStr) -> SecretStr:
        url = value.get_secret_value().strip()
        if url and not (url.startswith("http://") and urlsplit(url).hostname):
            raise ValueError("is not an http:// proxy URL, e.g. http://proxy.internal:3128")
        return SecretStr(url)

    @field_validator("ca_file")
    @classmethod
    def _usable_ca_file(cls, value: str) -> str:
        value = value.strip()
        if value:
            try:
                ssl.create_default_context(cafile=value)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(
                    f"{value!r}: not a usable CA bundle ({getattr(exc, 'strerror', None) or exc})"
                ) from None
        return value

    @field_validator("group_id_template")
    @classmethod
    def _template(cls, value: str) -> str:
        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(value) if name is not None}
        except ValueError as exc:
            raise ValueError(f"{value!r} is not a valid template: {exc}") from None
        unknown = fields - TEMPLATE_FIELDS
        if unknown or not fields:
            raise ValueError(
                f"{value!r} must use only and at least one of {{room_id}}, {{app_code}} (unknown: {sorted(unknown)})"
            )
        return value

    @field_validator("msg_priority")
    @classmethod
    def _merge_priorities(cls, value: dict[str, Priority]) -> dict[str, Priority]:
        return {**dict.fromkeys(DEFAULT_HIGH_PRIORITY, "High"), **value}

    @field_validator("apps", mode="before")
    @classmethod
    def _merge_env_case(cls, value: Any) -> Any:
        """Merge lower-cased environment entries into the file entry of the same app code."""
        if not isinstance(value, dict):
            return value
        merged: dict[str, Any] = {}
        for code, entry in value.items():
            same = [k for k in merged if k.lower() == str(code).lower()]
            if same and isinstance(entry, dict) and isinstance(merged[same[0]], dict):
                earlier = merged.pop(same[0])
                if str(code).islower():  # this one came from the environment: it wins
                    merged[same[0]] = {**earlier, **entry}
                else:
                    merged[code] = {**entry, **earlier}
            else:
                merged[code] = entry
        return merged

    @field_validator("apps")
    @classmethod
    def _no_overlap(cls, value: dict[str, AppCredentials], info: ValidationInfo) -> dict[str, AppCredentials]:
        clash = sorted(set(value) & set(info.data.get("default_app_codes", ())))
        if clash:
            raise ValueError(f"app codes {clash} are also in default_app_codes; list each app code once")
        return value

    def usable(self, limit: int) -> int:
        """What of a Tencent limit room-outbox's processes may use together: the limit less
        ``reserved_share`` (at least 1)."""
        return max(1, int(limit * (1.0 - self.reserved_share)))

    def priority_for(self, event_type: str) -> Priority:
        return self.msg_priority.get(event_type, self.default_msg_priority)
