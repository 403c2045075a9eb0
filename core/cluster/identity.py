"""Who a running process is to the others: its ``node_id`` plus a token drawn at each start.

``node_id`` names a process to people (log lines, metrics) and comes from the configuration,
so two processes can share one: a copied configuration, a fixed pod name, or a restart that
finds its previous run's heartbeat still fresh. What the processes tell one another apart by
uses the identity ``<node_id>~<token>`` instead: the membership row (and with it bucket
ownership and the quota share), the claim ids written into leased rows, a consumer's retry
leases. Two processes with one ``node_id`` therefore run as two members sharing the quota,
and a restart joins at once while its previous run's row expires as any dead node's does.
"""

from __future__ import annotations

import secrets

from room_outbox.store.dialect import ascii_text

SEPARATOR = "~"
#: Hex digits of the token: 32 bits, so two starts of one node_id practically never draw the same.
TOKEN_DIGITS = 8
#: The longest ``node_id`` whose identity and claim ids (``<identity>#<n>``) fit the
#: databases' 128-character node, owner and ``worker_id`` columns, with room for the claim
#: number of a process that runs for years.
MAX_NODE_ID_LENGTH = 128 - len(SEPARATOR) - TOKEN_DIGITS - len("#") - 18


def stored_node_id(node_id: str) -> str:
    """``node_id`` as identities carry it into the database: in ASCII (``\\u8282``). Claim ids
    go into room-service's ``worker_id``, which a table in latin1 cannot hold otherwise: every
    claim would fail."""
    return ascii_text(node_id)


def longest_claim_id(node_id: str) -> int:
    """How long the claim ids of a process started with ``node_id`` may grow: its identity,
    ``#`` and the claim number :data:`MAX_NODE_ID_LENGTH` allows for."""
    return len(stored_node_id(node_id)) + 128 - MAX_NODE_ID_LENGTH


def process_identity(node_id: str) -> str:
    """A new identity for a process started with ``node_id``."""
    return f"{stored_node_id(node_id)}{SEPARATOR}{secrets.token_hex(TOKEN_DIGITS // 2)}"


def node_id_of(identity: str) -> str:
    """The ``node_id`` an identity was made from (a name without a token: itself)."""
    node_id, separator, token = identity.rpartition(SEPARATOR)
    if separator and len(token) == TOKEN_DIGITS and all(c in "0123456789abcdef" for c in token):
        return node_id
    return identity
