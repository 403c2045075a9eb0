"""TLS contexts that check a server's certificate as the servers' own clients do.

Python 3.13 turned strict X.509 checks on by default (``ssl.VERIFY_X509_STRICT``). They refuse,
among others, a CA certificate without the key usage extension, which CAs made by hand or by a
server's own set-up tools often lack, and which MySQL's, libpq's and Kafka's own clients, and
curl, accept. A database or broker their own clients reach would then be refused by
room-outbox alone, and only under a newer Python. The chain, the dates and (where asked) the
host name are checked as before.
"""

from __future__ import annotations

import ssl


def as_servers_clients_check(context: ssl.SSLContext) -> ssl.SSLContext:
    """``context`` without Python's strict X.509 checks (a no-op before Python 3.13)."""
    context.verify_flags &= ~ssl.VERIFY_X509_STRICT
    return context
