"""This process's part of the rate limits every process of the deployment shares.

The destination counts an app's requests, and a group's messages, over the whole deployment:
three processes each sending at the app's limit send three times it. So each process keeps to
a share, ``limit / nodes``, ``nodes`` being the live processes (:mod:`.membership`), and the
shares must never let the deployment's sum exceed the limit, not even while processes join,
leave or die (:class:`QuotaShare`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

#: Added to the one-second window of every rate limit (a sink's own limiter adds it too): clear of rounding in however the
#: server buckets time, and small: every slot cycle pays it, out of the quota.
JITTER_MARGIN = 0.01
#: The window rate limits are counted over, as the limiters count it.
WINDOW = 1.0 + JITTER_MARGIN


class QuotaShare:
    """This process's share of each shared limit. Without a membership (one process, SQLite):
    every limit whole. A group whose every message comes from one process (per-room ordering
    and a group per room: the owner of the room's bucket) keeps the whole group limit there.

    The processes learn of a change at different heartbeats, so (:mod:`.membership` applies):

    * more nodes (a share shrinks): applied at once;
    * fewer nodes (a share grows): applied only once every live node reports the same view of
      the membership and one rate-limit window has passed since the last of them took it, so
      the requests sent under the larger count have left the destination's window;
    * a node that joins sends nothing until the same holds for its first view, so the others
      have shrunk before it starts;
    * a node that could not renew its heartbeat for ``node_timeout`` minus two windows sends
      nothing until it can: the others declare it dead only at ``node_timeout``, and then
      still wait a window before they grow. Once it can again, it sends nothing until its
      view settles, as a joining node: the others may have grown into its share meanwhile
      (a frozen process resumed), and shrink only once they see it again."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        #: Live nodes the shares are computed for; ``inf`` until a joining node may send.
        self._nodes: float = 1.0
        #: Monotonic time after which this process may send nothing (a stale heartbeat).
        self._valid_until = math.inf
        #: Whether a room's messages all come from this process (per-room ordering on buckets).
        self.rooms_owned = False
        #: Whether a sink limits each room's messages over a rate-limit window (a group per
        #: room): with :attr:`rooms_owned`, the room's owner keeps that limit whole.
        self.limits_rooms = False

    @property
    def keeps_room_limits(self) -> bool:
        """Whether a room's owner keeps a limit of the room's messages whole: a room then
        changes owner only a rate-limit window after (:mod:`.membership`)."""
        return self.rooms_owned and self.limits_rooms

    @property
    def nodes(self) -> float:
        return self._nodes

    @property
    def lapsed(self) -> bool:
        """Whether this share ran out before it was renewed (see :meth:`apply`)."""
        return self._clock() > self._valid_until

    def apply(self, nodes: float, valid_until: float) -> None:
        self._nodes = nodes
        self._valid_until = valid_until

    def split(self, limit: int, per_room: bool = False) -> int:
        """This process's part of a deployment-wide ``limit`` (per second) right now; 0: send
        nothing now. ``per_room``: a limit of one room's messages (a group per room)."""
        if self.lapsed or math.isinf(self._nodes):
            return 0
        if per_room and self.rooms_owned:
            return limit
        # At least 1, or a limit smaller than the node count could never be used at all;
        # the deployment's sum then exceeds such a tiny limit (documented).
        return max(1, int(limit // self._nodes))
