"""What a server's DSN (``mysql://``, ``postgresql://``) says, read one way for every database:
``scheme://user:password@host:port/database?options``. Errors name the part that is wrong and
never echo the DSN, which holds the password."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import SplitResult, parse_qs, unquote, urlsplit


class DsnOptionError(ValueError):
    """A DSN whose form is right but whose options (or the user part's characters) are not:
    its message says what to change, without the forms a DSN may take."""


@dataclass(frozen=True)
class ServerDsn:
    host: str
    port: int
    user: str
    password: str
    database: str
    #: Each option's values, as ``parse_qs`` gives them; the caller decides which it takes.
    query: dict[str, list[str]]


def dsn_parts(dsn: str) -> SplitResult:
    """``dsn`` split as a URL; a :class:`ValueError` naming ``database.dsn`` (never echoing it)
    where it cannot be: a user part holding a URL delimiter, or brackets not around an IPv6
    host (urlsplit's own error would quote the host part, password included)."""
    _check_userinfo(dsn)
    try:
        return urlsplit(dsn)
    except ValueError:
        raise ValueError("database.dsn: is not a URL: its host is not a name, an IPv4 address or [IPv6]") from None


def parse_server_dsn(dsn: str, schemes: tuple[str, ...], default_port: int, default_user: str) -> ServerDsn:
    """``dsn`` read, its scheme one of ``schemes`` (the first is the one error messages show)."""
    parts = dsn_parts(dsn)
    shown = schemes[0]
    if parts.scheme not in schemes:
        raise ValueError(f"database.dsn: scheme must be {shown}:// (got {parts.scheme or 'none'}://)")
    database = parts.path.lstrip("/")
    if not database:
        raise ValueError(f"database.dsn: names no database ({shown}://user:password@host:port/DATABASE)")
    try:
        port = parts.port or default_port
    except ValueError:
        raise ValueError("database.dsn: port is not a number") from None
    return ServerDsn(
        host=parts.hostname or "127.0.0.1",
        port=port,
        user=unquote(parts.username or default_user),
        password=unquote(parts.password or ""),
        database=unquote(database),
        query=parse_qs(parts.query),
    )


#: The hosts a DSN may name beside a Unix socket: this machine's (or none, which reads as the first).
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def socket_option(dsn: ServerDsn, option: str) -> str:
    """The Unix socket ``option`` names ("" when absent): an absolute path, on a DSN whose host
    is this machine (or left out); another host beside it would be ignored by the driver."""
    path = dsn.query.get(option, [""])[-1]
    if not path:
        return ""
    if not path.startswith("/"):
        raise DsnOptionError(f"database.dsn: {option} must be an absolute path (got {path!r})")
    if dsn.host not in LOCAL_HOSTS:
        raise DsnOptionError(
            f"database.dsn: {option} connects to this machine's server; the host {dsn.host!r} would be"
            " ignored: leave the host out (scheme://user:password@/database?...)"
        )
    return path


def host_and_port(host: str, port: int) -> str:
    """``host:port`` as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_userinfo(dsn: str) -> None:
    """Refuse a user or password holding ``#``, ``/``, ``?``, ``[`` or ``]`` as written: a URL
    ends its user part at the first three, so the DSN would be read as another host, port or
    database and the error would name the wrong part; the brackets make it no URL at all. The
    password is never shown."""
    found = sorted({c for c in _userinfo(dsn.partition("://")[2]) if c in "#/?[]"})
    if found:
        codes = ", ".join(f"{c} as %{ord(c):02X}" for c in found)
        raise DsnOptionError(f"database.dsn: the user or password holds {' '.join(found)}; percent-encode it ({codes})")


def _userinfo(rest: str) -> str:
    """What comes before the @ that ends the user part of ``rest`` (the DSN after ``://``):
    the last @, unless it is in an option's value (``?name=…@…``); "" without one."""
    while "@" in rest:
        userinfo = rest[: rest.rfind("@")]
        option = re.search(r"\?[A-Za-z_]+=", userinfo)
        if option is None:
            return userinfo
        rest = userinfo[: option.start()]
    return ""
