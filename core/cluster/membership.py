"""The membership of live ``room-outbox run`` processes, the room buckets each one owns, and
the quota share that follows from them.

Every ``heartbeat_interval`` each process renews its row and, in the same transaction, counts
dead the nodes without a heartbeat for ``node_timeout``, reassigns as few buckets as it can
so that each live node owns its fair count (:func:`plan`), opens the buckets handed over to it
once no lease on them remains, and updates its quota share (:meth:`Membership.beat`). A
graceful stop gives the buckets up at once (:meth:`Membership.running`); a killed process's
buckets move once its heartbeat is stale and become claimable as its leases run out. The
fence that keeps two owners apart is :mod:`room_outbox.store.membership`'s.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio

from room_outbox.attempt.failure import describe_round_failure
from room_outbox.cluster.identity import node_id_of
from room_outbox.cluster.quota import WINDOW, QuotaShare
from room_outbox.observability.repeated import RepeatedFailure
from room_outbox.store import membership as sql
from room_outbox.store.clock import CLOCK, now_ms
from room_outbox.store.protocol import ReadAlong, SQLStore
from room_outbox.store.schema.buckets import BUCKETS
from room_outbox.store.schema.profiles import V1, Profile

log = logging.getLogger("room_outbox.cluster")

#: How long after a view turns a window old the heartbeat that applies it comes: past the
#: boundary, whatever the rounding of milliseconds.
SETTLE_MARGIN = 0.01
#: How soon a node looks again at buckets handed over to it that wait for their leases to end:
#: their rooms are claimed by nobody meanwhile, and a live former owner's leases end as its
#: deliveries do, within a moment, not a heartbeat. Each look that finds some still leased
#: doubles the wait, up to the heartbeat interval (a killed owner's leases just run out).
FIRST_HANDOVER_CHECK = 0.05


def plan(buckets: Sequence[sql.BucketRow], live: Sequence[str], leased: Collection[int] = ()) -> dict[int, str]:
    """New owners for the buckets that must move so that every node in ``live`` (the nodes that
    may own buckets) owns its fair count
    (``BUCKETS // n``, the first ``BUCKETS % n`` nodes in name order one more), moving as few
    buckets as possible, and of those, buckets with a row ``leased`` last: they stay with the
    owner delivering them, where others can move at once (a joining node takes over idle
    buckets and leaves the busy ones to their owner)."""
    if not live:
        return {}
    nodes = sorted(live)
    base, extra = divmod(len(buckets), len(nodes))
    fair = {node: base + (1 if i < extra else 0) for i, node in enumerate(nodes)}
    kept = dict.fromkeys(nodes, 0)
    loose: list[int] = []
    for row in sorted(buckets, key=lambda r: (r.bucket not in leased, r.bucket)):
        if row.owner in fair and kept[row.owner] < fair[row.owner]:
            kept[row.owner] += 1
        else:
            loose.append(row.bucket)
    loose.sort(key=lambda bucket: (bucket in leased, bucket))
    moves: dict[int, str] = {}
    for node in nodes:
        while kept[node] < fair[node]:
            moves[loose.pop(0)] = node
            kept[node] += 1
    return moves


#: The key of the main lane's routes among a heartbeat's orderings: no lane is named so.
ROUTES_KEY = "@routes"
#: Characters ``room_outbox_node.orderings`` holds.
ORDERINGS_WIDTH = 255


def shown_orderings(text: str) -> dict[str, str]:
    """A heartbeat's orderings column read back: each lane's ordering (and the routes' digest)."""
    return dict(pair.split("=", 1) for pair in text.split(",") if "=" in pair)


def routes_digest(routes: Mapping[str, str]) -> str:
    """A short name for a lane's routes (event type → sink): equal digests, equal routes."""
    return hashlib.sha256(",".join(f"{t}>{s}" for t, s in sorted(routes.items())).encode()).hexdigest()[:12]


def view_of(live: Sequence[str]) -> str:
    """A short name for a set of live nodes: equal views, equal sets."""
    return hashlib.sha256("\n".join(sorted(live)).encode()).hexdigest()[:32]


class Membership:
    def __init__(
        self,
        store: SQLStore,
        node_id: str,  # the process identity (see cluster.identity)
        tables: Sequence[str],
        heartbeat_interval: float = 1.0,
        node_timeout: float = 5.0,
        quota: QuotaShare | None = None,
        orderings: Mapping[str, str] | None = None,
        routes: Mapping[str, str] | None = None,
    ) -> None:
        self.store = store
        #: The ordering of each lane this process runs, as its heartbeat shows it to the others.
        self.orderings = dict(orderings or {})
        #: Which sink takes each event type on the main lane, where this process claims it, and
        #: their digest (None: it does not claim the main lane).
        self.routes = dict(routes or {})
        self._routes_digest = routes_digest(self.routes) if routes is not None else None
        # The heartbeat's orderings column carries both, the routes as a digest under a key no
        # lane can be named (earlier versions read lanes' names only, so they pass it by); the
        # lanes that do not fit in the column are left out (never compared), not the heartbeat.
        shown = [f"{ROUTES_KEY}={self._routes_digest}"] if self._routes_digest is not None else []
        for lane, ordering in sorted(self.orderings.items()):
            if len(",".join([*shown, f"{lane}={ordering}"])) <= ORDERINGS_WIDTH:
                shown.append(f"{lane}={ordering}")
        self._orderings_text = ",".join(shown)
        self.node_id = node_id
        #: Tables whose leases fence a handover: room_outbox and the lane tables.
        self.tables = list(tables)
        self.heartbeat_interval = heartbeat_interval
        self.node_timeout = node_timeout
        self.quota = quota or QuotaShare()
        self.quota.apply(math.inf, math.inf)  # a joining node sends nothing yet
        self.live: list[str] = []
        self.owned: list[int] = []
        self._view = ""
        self._view_since_ms = 0
        self._joined = anyio.Event()
        #: When this node joined (0: not yet), and whether its last heartbeat showed it.
        self._joined_ms = 0
        self._shown_joined = False
        #: Seconds until this node looks again at buckets handed over to it that wait for
        #: leases to end (:data:`FIRST_HANDOVER_CHECK`); None: none waits.
        self._handover_check: float | None = None
        #: Whether the last heartbeat succeeded.
        self._reachable = True
        #: Why the last failed heartbeat failed, as its log line says it.
        self._last_beat_error = ""
        #: Heartbeats failing one after another: the first logged, then a line a minute.
        self._failing_beats = RepeatedFailure(log, "membership heartbeat failed", "membership heartbeats succeed again")
        #: Other identities made from this process's node_id: the heartbeat last seen of each,
        #: and those already warned about.
        self._namesakes: dict[str, int] = {}
        self._warned: set[str] = set()
        #: The disagreements on a lane's ordering last warned about (none: all agree).
        self._disagreements: frozenset[tuple[str, str, str]] = frozenset()
        #: The live processes whose main lane routes differ from this one's, last warned about.
        self._other_routes: frozenset[str] = frozenset()
        #: Seconds from the last heartbeat until the quota could settle on the view every live
        #: node holds (see :meth:`_apply_quota`); ``None``: nothing to wait for.
        self._settles_in: float | None = None

    # -- what the rest of the process asks -----------------------------------------------

    async def room_buckets(self, cur: Any, along: ReadAlong | None = None) -> list[int] | None:
        """The buckets a claim may take now (``None``: all), read in the claim's transaction
        (with ``along``: see :class:`~room_outbox.store.protocol.BucketReader`)."""
        buckets = await sql.claimable_buckets(cur, self.store.dialect, self.node_id, along)
        return None if len(buckets) == BUCKETS else buckets

    async def wait_joined(self, timeout: float, stop: anyio.Event | None = None) -> bool:
        """Until this node may send (the others have made room for it) or ``stop`` is set;
        False on timeout or stop."""
        with anyio.move_on_after(timeout):
            async with anyio.create_task_group() as waits:

                async def end_waits_once(event: anyio.Event) -> None:
                    await event.wait()
                    waits.cancel_scope.cancel()

                waits.start_soon(end_waits_once, self._joined)
                if stop is not None:
                    waits.start_soon(end_waits_once, stop)
        return self._joined.is_set()

    # -- the loop ------------------------------------------------------------------------

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Membership]:
        """Heartbeats while the block runs; on exit the node leaves (:meth:`leave`), so the
        others claim its buckets' rows at once instead of after ``node_timeout``. The block ends
        once the dispatchers have written their results: a leave leaves no lease."""
        async with anyio.create_task_group() as beats:
            beats.start_soon(self._loop)
            try:
                yield self
            finally:
                beats.cancel_scope.cancel()
        if not self._reachable:
            # The last heartbeat failed: the database unreachable (a leave would only wait for
            # its deadline) or refusing its statements (as it would the leave's). The others
            # take the buckets over once the heartbeat is stale.
            log.warning(
                "not leaving the membership: the last heartbeat failed; the others take this"
                " process's buckets over once its heartbeat is stale",
                extra={"error": self._last_beat_error},
            )
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.node_timeout):
            try:
                await self.leave()
                log.info(
                    "left the membership; buckets handed to the processes that stay",
                    extra={"lifecycle": "membership_left"},
                )
            except Exception as exc:
                log.error(
                    "could not leave the membership; the others take over once the heartbeat is stale",
                    extra={"error": f"{type(exc).__name__}: {exc}"},
                )

    async def leave(self) -> None:
        """Hand this node's buckets to the live nodes that stay (their fair counts, as their
        next heartbeat would) and drop its row, in one transaction: they claim the buckets' rows
        at once, not a heartbeat later. With none staying, the buckets are left without owner."""
        async with self.store.transaction() as cur:
            nodes = await sql.read_nodes(cur)
            staying = [node for node in self._live(nodes) if node != self.node_id]
            if staying:
                await self._reassign(cur, self._owners(nodes, staying))
            await sql.leave(cur, self.node_id)

    async def _write_heartbeat(self, cur: Any, joined_ms: int) -> None:
        """This node's row as it stands: the heartbeat, when it joined, its view and orderings."""
        await sql.heartbeat(
            cur, self.store.dialect, self.node_id, self._view, self._view_since_ms, self._orderings_text, joined_ms
        )

    def _live(self, nodes: Sequence[sql.NodeRow]) -> list[str]:
        """The nodes with a heartbeat younger than ``node_timeout``, and this one."""
        now, timeout_ms = now_ms(), int(self.node_timeout * 1000)
        return sorted(n.node_id for n in nodes if now - n.heartbeat_ms <= timeout_ms or n.node_id == self.node_id)

    def _owners(self, nodes: Sequence[sql.NodeRow], live: Sequence[str]) -> list[str]:
        """The nodes buckets may go to: the live ones that have joined (may send), so that a node
        starting up does not hold rooms it cannot deliver yet; only where none has, every live
        one."""
        return [n.node_id for n in nodes if n.node_id in live and n.joined_ms] or list(live)

    async def _reassign(self, cur: Any, owners: Sequence[str]) -> dict[int, str]:
        """Under the bucket rows' locks, give ``owners`` their fair counts (:func:`plan`): a
        bucket without a leased row moves at once, one with a leased row is handed over. Each is
        claimable :meth:`_handover_delay_ms` after. Returns the moves."""
        buckets = await sql.read_buckets(cur, lock=True)
        leased = await sql.still_leased(cur, await self._leased_tables(cur), [b.bucket for b in buckets])
        moves = plan(buckets, owners, leased)
        await sql.assign(cur, moves, set(moves) - leased, self._handover_delay_ms())
        return moves

    async def _loop(self) -> None:
        while True:
            started = anyio.current_time()
            try:
                await self.beat()
                self._reachable = True
                self._failing_beats.succeeded()
            except Exception as exc:
                self._reachable = False
                self._settles_in = None
                self._last_beat_error = describe_round_failure(exc)
                self._failing_beats.failed(self._last_beat_error)
            wait = self.heartbeat_interval - (anyio.current_time() - started)
            if self._joined_ms and not self._shown_joined and self._reachable:
                wait = 0.0  # tell the others at once: buckets move to a node once it has joined
            elif self._handover_check is not None and self._reachable:
                wait = min(wait, self._handover_check)
            elif self._settles_in is not None:
                # A joining node sends nothing, and a share grows only, once a view is a window
                # old: beat as it turns so, not up to a heartbeat later.
                wait = min(wait, self._settles_in + SETTLE_MARGIN)
            await anyio.sleep(max(0.0, wait))

    async def beat(self) -> None:
        """One heartbeat, in one transaction: measure the clock's offset from the database's
        (every time compared between processes is the database's:
        :mod:`room_outbox.store.clock`); renew this node's row with its view of the membership;
        read the nodes (dead: no heartbeat for ``node_timeout``); when buckets belong to dead
        or departed nodes or are unevenly spread, reassign them (:func:`plan`) and forget the
        dead nodes' rows (:meth:`_reassign`, among :meth:`_owners`); open each bucket handed
        over to this node once no process holds a lease on its rows; update the quota share
        (:mod:`.quota`)."""
        began = time.monotonic()
        async with self.store.transaction() as cur:
            await CLOCK.measure(cur, self.store.dialect)  # every time below is the database's
            joined_ms = self._joined_ms
            await self._write_heartbeat(cur, joined_ms)
            nodes = await sql.read_nodes(cur)
            live = self._live(nodes)
            dead = [n.node_id for n in nodes if n.node_id not in live]
            owners = self._owners(nodes, live)
            buckets = await sql.read_buckets(cur)
            if dead or plan(buckets, owners):
                moves = await self._reassign(cur, owners)
                await sql.forget_nodes(cur, dead)
                if moves or dead:
                    log.info(
                        "buckets reassigned",
                        extra={"membership": "rebalanced", "nodes": live, "dead": dead, "moved": len(moves)},
                    )
                buckets = await sql.read_buckets(cur)
            waiting = [b.bucket for b in buckets if b.owner == self.node_id and b.handing_over]
            leased = await sql.still_leased(cur, await self._leased_tables(cur), waiting)
            await sql.open_buckets(cur, self.node_id, sorted(set(waiting) - leased), self._handover_delay_ms())
            view = view_of(live)
            if view != self._view:
                self._view, self._view_since_ms = view, now_ms()
                await self._write_heartbeat(cur, joined_ms)
        self.live = live
        self._shown_joined = joined_ms != 0
        if not leased:
            self._handover_check = None
        elif self._handover_check is None:
            self._handover_check = FIRST_HANDOVER_CHECK
        else:
            self._handover_check = min(2 * self._handover_check, self.heartbeat_interval)
        self.owned = [b.bucket for b in buckets if b.owner == self.node_id]
        self._apply_quota(nodes, live, began)
        self._notice_namesakes(nodes)
        others = {
            n.node_id: shown_orderings(n.orderings) for n in nodes if n.node_id in live and n.node_id != self.node_id
        }
        self._notice_orderings(others)
        self._notice_routes(others)

    def _notice_namesakes(self, nodes: Sequence[sql.NodeRow]) -> None:
        """Warn once about each other process started with this node_id whose heartbeat moves
        on: it runs (a copied configuration, a fixed pod name), and the two share the quota as
        any two members do. A previous run of this process, killed, leaves a heartbeat that
        never moves, and is not worth a warning."""
        mine = node_id_of(self.node_id)
        seen, self._namesakes = self._namesakes, {}
        for node in nodes:
            if node.node_id == self.node_id or node_id_of(node.node_id) != mine:
                continue
            self._namesakes[node.node_id] = node.heartbeat_ms
            moved = node.node_id in seen and seen[node.node_id] != node.heartbeat_ms
            if moved and node.node_id not in self._warned:
                self._warned.add(node.node_id)
                log.warning(
                    "another running process has this node_id; both run as separate members sharing"
                    " the quota: give each process its own node_id",
                    extra={"identity": self.node_id, "other": node.node_id},
                )

    def _notice_orderings(self, others: Mapping[str, Mapping[str, str]]) -> None:
        """Warn when a live process runs a lane of this one's with another ordering: per-room
        order holds only where every process claiming the lane's rows orders them by room (a
        process left with an old configuration claims any room's rows). Said again only when
        the disagreement changes, and once more when it ends."""
        found: set[tuple[str, str, str]] = set()
        for node_id, theirs in others.items():
            for lane, ordering in self.orderings.items():
                if lane in theirs and theirs[lane] != ordering:
                    found.add((lane, node_id, theirs[lane]))
        disagreements = frozenset(found)
        if disagreements == self._disagreements:
            return
        self._disagreements = disagreements
        if not disagreements:
            log.info("every live process runs its lanes with this process's ordering")
            return
        for lane in sorted({lane for lane, _, _ in disagreements}):
            log.warning(
                "processes disagree on a lane's outbox_worker.ordering: per-room order holds only"
                " when every process running the lane orders per room; give them one configuration",
                extra={
                    "lane": lane,
                    "ordering": self.orderings[lane],
                    "others": {node: ordering for other, node, ordering in sorted(disagreements) if other == lane},
                },
            )

    def _notice_routes(self, others: Mapping[str, Mapping[str, str]]) -> None:
        """Warn when a live process routes the main lane's event types to other sinks (or none):
        an event one process has no sink for is parked by it, though another would deliver it
        (a rolling deploy that enables a sink, a node left with an old configuration). Said
        again only when the set of such processes changes, and once more when it ends."""
        if self._routes_digest is None:
            return  # this process does not claim the main lane
        differ = frozenset(
            node_id
            for node_id, theirs in others.items()
            if ROUTES_KEY in theirs and theirs[ROUTES_KEY] != self._routes_digest
        )
        if differ == self._other_routes:
            return
        self._other_routes = differ
        if not differ:
            log.info("every live process routes the main lane's event types as this process does")
            return
        log.warning(
            "processes disagree on the main lane's routes (which sink takes which event type): an event"
            " one of them has no sink for is parked by it (`room-outbox requeue --event-type X` sends it"
            " again once every process routes it); give them one configuration",
            extra={"routes": dict(sorted(self.routes.items())), "others": sorted(differ)},
        )

    def _handover_delay_ms(self) -> int:
        """How long after it changes hands a bucket becomes claimable: one rate-limit window
        where a room's owner keeps a room's whole limit (:attr:`QuotaShare.keeps_room_limits`), so
        that the former owner's last messages to a room have left the destination's window
        before the new owner sends to it; at once otherwise (the fence and the leases keep
        two owners apart)."""
        return int(WINDOW * 1000) + 1 if self.quota.keeps_room_limits else 0

    async def _leased_tables(self, cur: Any) -> list[tuple[str, Profile, str]]:
        """The tables whose leases fence a handover, each with its rows' shape (the outbox
        table the store's profile describes, the lane tables room-outbox's own) and its rows'
        bucket as the claims on it read it."""
        tables = []
        for table in self.tables:
            profile = self.store.profile if table == self.store.profile.table else V1
            tables.append((table, profile, await self.store.row_bucket(cur, table, profile)))
        return tables

    def _apply_quota(self, nodes: Sequence[sql.NodeRow], live: Sequence[str], began: float) -> None:
        others = {n.node_id: n for n in nodes if n.node_id in live and n.node_id != self.node_id}
        agreed = all(n.view == self._view for n in others.values())
        since_ms = max([self._view_since_ms, *(n.view_since_ms for n in others.values())])
        settles_in = (since_ms - now_ms()) / 1000 + WINDOW
        settled = agreed and settles_in <= 0
        count = float(len(live))
        # A share that ran out (heartbeats that could not be written, a frozen process) counts
        # as none: the others may have grown into it, so this process sends again only as a
        # joining one does, once everyone has seen it and a window has passed.
        current = math.inf if self.quota.lapsed else self.quota.nodes
        # Shrink at once; grow (or start) only once everyone applies the same view since a window.
        nodes_applied = count if count >= current or settled else current
        self._settles_in = settles_in if agreed and nodes_applied != count else None
        valid_until = began + self.node_timeout - 2 * WINDOW
        self.quota.apply(nodes_applied, valid_until)
        if not math.isinf(nodes_applied) and not self._joined.is_set():
            self._joined.set()
            self._joined_ms = now_ms()
            log.info(
                "joined the membership",
                extra={"lifecycle": "membership_joined", "identity": self.node_id, "nodes": list(live)},
            )
