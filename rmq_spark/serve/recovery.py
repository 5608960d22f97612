"""Check-back through the clients, as RocketMQ 5 does it: the connected clients' telemetry
streams, and the loop that asks them about orphaned transactions.

A gRPC producer names no producer group; the server uses the topic (see
:mod:`rmq_spark.serve.service`). A client belongs to the groups of the topics it declared in its
settings or sent to. Every ``transaction.transaction_check_interval`` the loop reads each
shard's ``pending`` table, which the check-back job keeps (``rmqtx check``, with
``[checkers.<topic>] kind = "clients"``: :class:`rmq_spark.checkback.checkers.ClientsChecker`,
which counts the checks and rolls back at the check max, as for every group; the server only
reads, so any number of servers add no commits), and, for every pending transaction of a group
with a connected client that is older than ``transaction.transaction_timeout`` (or its
message's ``CHECK_IMMUNITY_TIME_IN_SECONDS``), writes a ``RecoverOrphanedTransactionCommand``
on the stream of one client of the group, at most once per interval, trying the group's
clients in turn. The client's ``TransactionChecker`` answers with an ``EndTransaction`` of source
``SOURCE_SERVER_CHECK``, decided as ``check-back:client``. A group with no connected client is
not asked (RocketMQ's UNKNOWN: ask again later); with several ``rmqtx serve`` processes, each
asks the clients connected to it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from rocketmq.grpc_protocol import service_pb2 as service_pb

from rmq_spark.model.config import TransactionSettings
from rmq_spark.model.messages import PROPERTY_CHECK_IMMUNITY, check_immunity
from rmq_spark.serve.accounts import Account
from rmq_spark.serve.protocol import check_command
from rmq_spark.store.facade import Store

log = logging.getLogger(__name__)

#: How many transactions asked about a server remembers (see :meth:`Clients.was_asked`).
REMEMBERED_CHECKS = 100_000
#: The most topics one client is asked about (what it declares beyond is ignored).
MAX_CLIENT_TOPICS = 1024


@dataclass(eq=False)
class Client:
    """A client's telemetry stream: the account that signed it (None: a server without
    accounts), the commands to write on it (None ends it), and the topics (producer groups) it
    declared or sent to."""

    client_id: str
    account: Account | None = None
    outbox: asyncio.Queue[service_pb.TelemetryCommand | None] = field(default_factory=asyncio.Queue)
    topics: set[str] = field(default_factory=set)


class Clients:
    """The clients connected to this server by a telemetry stream, by account and client id
    (the ``x-mq-client-id`` metadata of their calls, which a client chooses: a stream signed by
    another account never stands for it). Remembers the transactions the server asked about
    lately, so that an answer is known for one whatever ``source`` the client gives. Used on
    the event loop's thread only."""

    def __init__(self) -> None:
        self._by_id: dict[tuple[str, str], Client] = {}
        self._asked: OrderedDict[str, None] = OrderedDict()

    def connect(self, client_id: str, account: Account | None = None) -> Client:
        """Register a new stream of ``client_id`` of ``account`` (replacing an older one)."""
        client = Client(client_id, account)
        self._by_id[_key(client_id, account)] = client
        return client

    def disconnect(self, client: Client) -> bool:
        """Forget ``client``'s stream, unless a newer one of it replaced it already; whether it
        was its latest."""
        key = _key(client.client_id, client.account)
        if self._by_id.get(key) is not client:
            return False
        del self._by_id[key]
        return True

    def note_topics(self, client_id: str, account: Account | None, topics: Iterable[str]) -> None:
        """Add topics a client of ``account`` declared or sent to (a producer made without
        topics declares them only at its next settings sync, minutes later), up to
        :data:`MAX_CLIENT_TOPICS`."""
        client = self._by_id.get(_key(client_id, account))
        if client is None:
            return
        for topic in topics:
            if len(client.topics) >= MAX_CLIENT_TOPICS:
                log.warning("client %s declared over %d topics", client_id, MAX_CLIENT_TOPICS)
                return
            client.topics.add(topic)

    def asking(self, transaction_id: str) -> None:
        """Note that a client is being asked about ``transaction_id``."""
        self._asked[transaction_id] = None
        self._asked.move_to_end(transaction_id)
        while len(self._asked) > REMEMBERED_CHECKS:
            self._asked.popitem(last=False)

    def was_asked(self, transaction_id: str) -> bool:
        """Whether a client was asked about ``transaction_id`` lately."""
        return transaction_id in self._asked

    def groups(self) -> set[str]:
        """The producer groups (topics) that have a connected client."""
        return {t for c in self._by_id.values() for t in c.topics}

    def of_group(self, group: str, topics: Iterable[str] = ()) -> list[Client]:
        """The connected clients of a producer group, oldest connection first, whose account
        may be asked about every one of ``topics`` (a transaction's: its group need not be one
        of them)."""
        return [
            c
            for c in self._by_id.values()
            if group in c.topics
            and (c.account is None or all(c.account.may_be_asked(t) for t in topics))
        ]

    def close_all(self) -> None:
        """End every stream (the server is stopping)."""
        for client in list(self._by_id.values()):
            client.outbox.put_nowait(None)


def _key(client_id: str, account: Account | None) -> tuple[str, str]:
    return (account.access_key if account else "", client_id)


@dataclass(frozen=True)
class Orphan:
    """A pending transaction due for a check: its group, the topics of its messages and the
    command that asks."""

    transaction_id: str
    producer_group: str
    topics: frozenset[str]
    command: service_pb.TelemetryCommand


class ClientCheckBack:
    """The loop that asks connected clients about their groups' orphaned transactions.

    Parameters
    ----------
    store : Store
        The store's root (every shard is read).
    clients : Clients
        The connected clients.
    settings : TransactionSettings
        ``transaction_timeout`` and ``transaction_check_interval``.
    """

    def __init__(self, store: Store, clients: Clients, settings: TransactionSettings) -> None:
        self.store = store
        self.clients = clients
        self.settings = settings
        #: Commands written to clients so far.
        self.checks_sent = 0
        self._last_asked: dict[str, float] = {}
        self._asked_count: dict[str, int] = {}
        #: When this server first found each transaction pending (its monotonic clock).
        self._first_seen: dict[str, float] = {}

    async def run(self, stop: asyncio.Event) -> None:
        """Run rounds every check interval until ``stop`` is set; a failed round is logged
        and the next one tries again."""
        while not stop.is_set():
            try:
                await self.round()
            except Exception:
                log.exception("a check-back round through the clients failed; retrying later")
            try:
                await asyncio.wait_for(stop.wait(), self.settings.transaction_check_interval)
            except TimeoutError:
                pass

    async def round(self) -> int:
        """Ask the clients about every transaction due now; return how many were asked."""
        groups = self.clients.groups()
        if not groups:
            return 0
        orphans = await asyncio.get_running_loop().run_in_executor(None, self._due, groups)
        asked = 0
        for orphan in orphans:
            candidates = self.clients.of_group(orphan.producer_group, orphan.topics)
            if not candidates:
                continue  # disconnected meanwhile: UNKNOWN, ask again later
            count = self._asked_count.get(orphan.transaction_id, 0)
            client = candidates[count % len(candidates)]
            self._asked_count[orphan.transaction_id] = count + 1
            self._last_asked[orphan.transaction_id] = time.monotonic()
            self.clients.asking(orphan.transaction_id)
            client.outbox.put_nowait(orphan.command)
            log.info(
                "asked client %s about transaction %s of group %s",
                client.client_id,
                orphan.transaction_id,
                orphan.producer_group,
            )
            asked += 1
        self.checks_sent += asked
        return asked

    def _due(self, groups: set[str]) -> list[Orphan]:
        """The pending transactions of ``groups`` due for a check, over every shard (blocking:
        runs on a worker thread)."""
        due: list[Orphan] = []
        pending_ids: set[str] = set()
        now, interval = time.monotonic(), self.settings.transaction_check_interval
        for shard in self.store.shards(refresh=True):
            rows = shard.read("pending")
            for transaction_id in rows.column("transaction_id").to_pylist():
                pending_ids.add(transaction_id)
                self._first_seen.setdefault(transaction_id, now)
            rows = rows.filter(
                pc.is_in(rows.column("producer_group"), pa.array(sorted(groups), pa.string()))
            )
            # Aged on this server's clock from when it first found them pending, never by their
            # store_timestamp: another host's clock stamped it (apache/rocketmq#9640). Later
            # than their store, never earlier: a transaction is pending only once stored.
            ripe = [
                r
                for r in rows.to_pylist()
                if now - self._first_seen[r["transaction_id"]] >= self._timeout(r)
                and now - self._last_asked.get(r["transaction_id"], -interval) >= interval
            ]
            # The list is as old as the job's last round: not those decided since (in op, or
            # by a decision object that a killed process never recorded there).
            decided = set(shard.decisions([r["transaction_id"] for r in ripe]) if ripe else ())
            ripe = [r for r in ripe if r["transaction_id"] not in decided]
            decided = set(shard.object_decisions([r["transaction_id"] for r in ripe]))
            ripe = [r for r in ripe if r["transaction_id"] not in decided]
            if not ripe:
                continue
            halves = shard.half_messages([r["transaction_id"] for r in ripe]).to_pylist()
            first = {h["msg_id"]: h for h in halves}
            topics: dict[str, set[str]] = {}
            for h in halves:
                topics.setdefault(h["transaction_id"], set()).add(h["topic"])
            due.extend(
                Orphan(
                    r["transaction_id"],
                    r["producer_group"],
                    frozenset(topics[r["transaction_id"]]),
                    check_command(first[r["msg_id"]], r["transaction_id"]),
                )
                for r in ripe
                if r["msg_id"] in first
            )
        for gone in set(self._first_seen) - pending_ids:
            del self._first_seen[gone]
            self._last_asked.pop(gone, None)
            self._asked_count.pop(gone, None)
        return due

    def _timeout(self, row: dict[str, Any]) -> float:
        """Seconds before a transaction is checked: the store's transaction timeout, or its
        message's check immunity (at most the max check age) when that is longer, as in the
        check-back job's rounds (:mod:`rmq_spark.checkback.batch`)."""
        asked = (v for k, v in row["properties"] or () if k == PROPERTY_CHECK_IMMUNITY)
        immunity = check_immunity(next(asked, None))  # the first, as the job's rounds read it
        return max(self.settings.transaction_timeout, min(immunity, self.settings.max_check_age))
