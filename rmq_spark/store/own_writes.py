"""What a process knows it wrote to ``op``'s arbiters, so that it need not read it back.

A decision recorded in ``op`` is arbitrated by the Delta application id of its transaction's
bucket (:func:`decision_app_id`): a commit records the ids of the buckets it decides, and a
racing commit of the same bucket conflicts. Loading the latest ``op`` snapshot to look a
transaction's decision up is a listing and a replay of the log (tens of milliseconds on an
object store); :class:`MadeIds` and :class:`OwnDecisions` tell
:meth:`rmq_spark.store.decisions.Decisions.record` when the snapshot it holds already answers.
"""

from __future__ import annotations

import threading
import zlib
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

_DECISION_APP_ID = "rmqtx.decision.{bucket}"

#: Buckets of transaction ids for the decision arbiter: ``op``'s snapshot keeps one
#: application id per bucket, however many transactions were ever decided.
DECISION_BUCKETS = 1024


def decision_app_id(transaction_id: str) -> str:
    """The application id an ``op`` commit deciding ``transaction_id`` records: one per bucket
    of ids (CRC-32, stable across processes), so racing deciders of a transaction conflict."""
    bucket = zlib.crc32(transaction_id.encode()) % DECISION_BUCKETS
    return _DECISION_APP_ID.format(bucket=bucket)


#: A thread keeps at most this many of its own decisions after its ``op`` snapshot before it
#: loads a newer one (:class:`OwnDecisions`).
OWN_COMMITS_KEPT = 256


#: Transaction ids whose making :class:`MadeIds` remembers (the oldest are forgotten, and then
#: looked up as any other).
_MADE_KEPT = 65536


class MadeIds:
    """When this process made its newest transaction ids (just before, on
    :func:`rmq_spark.model.clock.elapsed`).

    Nobody can decide a transaction before its id exists, so an ``op`` snapshot loaded before
    that holds no decision of it (and one recorded since moved its arbiter past the snapshot):
    its decision is not looked up there, which on an object store is a read of an ``op`` file
    on every decision's path.
    """

    def __init__(self) -> None:
        self._at: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, transaction_ids: Sequence[str], at: float) -> None:
        """Remember ``transaction_ids``, made after ``at``."""
        with self._lock:
            for t in transaction_ids:
                self._at[t] = at
            while len(self._at) > _MADE_KEPT:
                self._at.popitem(last=False)

    def after(self, transaction_ids: Sequence[str], moment: float) -> set[str]:
        """Which of ``transaction_ids`` this process made after ``moment``."""
        with self._lock:
            return {t for t in transaction_ids if self._at.get(t, moment) > moment}


class OwnDecisions:
    """The ``op`` commits one thread made after its snapshot: the version each landed at, the
    arbiters it recorded with their version (see :meth:`Decisions.write_decisions`; another
    writer's commit can record the same version for another arbiter) and the transactions it
    decided.

    A thread's decisions move the arbiters of its transactions past its snapshot; loading the
    latest snapshot each time (a listing and a replay of the log, tens of milliseconds on an
    object store) would cost nearly every decision, as each shares a bucket with a recent one.
    An arbiter whose latest recording is one of these commits was recorded after the snapshot
    by nobody else: each of them found the same (or the arbiter unmoved), and Delta's conflict
    check covered the versions its head had not read. So the snapshot holds every decision of
    the other transactions of that bucket. A transaction decided by one of these commits is
    looked up in the latest snapshot (a retried or late end: another writer may have removed
    the decision since).

    The arbiters and transactions of the commits kept are counted as commits come and go, so
    that a decision's check costs what it decides, not what the kept commits decided (a set of
    them built for each decision took a fifth of the interpreter's time with 64 senders).
    """

    def __init__(self) -> None:
        self.commits: list[tuple[int, frozenset[tuple[str, int]], frozenset[str]]] = []
        self._arbiters: Counter[tuple[str, int]] = Counter()
        self._decided: Counter[str] = Counter()

    def since(self, snapshot_version: int) -> None:
        """Forget the commits the snapshot holds."""
        # A thread's commits land one after another, at growing versions.
        while self.commits and self.commits[0][0] <= snapshot_version:
            _, arbiters, decided = self.commits.pop(0)
            _forget(self._arbiters, arbiters)
            _forget(self._decided, decided)

    def recorded(self, arbiters: set[tuple[str, int]]) -> bool:
        """Whether these commits recorded every one of ``arbiters`` (with its version)."""
        return all(a in self._arbiters for a in arbiters)

    def add(self, landed: int, arbiter_version: int, transaction_ids: Sequence[str]) -> None:
        """Remember a commit that landed at ``landed`` deciding ``transaction_ids``, recording
        their arbiters at ``arbiter_version``."""
        arbiters = frozenset((decision_app_id(t), arbiter_version) for t in transaction_ids)
        decided = frozenset(transaction_ids)
        self.commits.append((landed, arbiters, decided))
        self._arbiters.update(arbiters)
        self._decided.update(decided)

    def decided(self, ids: Sequence[str]) -> bool:
        """Whether these commits decided one of ``ids``."""
        return any(t in self._decided for t in ids)


def _forget(counts: Counter[T], keys: frozenset[T]) -> None:
    """Count ``keys`` once less, dropping the ones no longer counted."""
    for key in keys:
        counts[key] -= 1
        if not counts[key]:
            del counts[key]
