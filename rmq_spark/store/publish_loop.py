"""Publishing in the background: one process at a time moves every producer's COMMITs into the
CommitLog.

A producer's end-transaction returns once its decision is durable in ``op`` (RocketMQ's
end-transaction is a one-way request too); moving the committed messages into ``commitlog`` is
left to a :class:`BackgroundPublisher`. Producers on many hosts that each published their own
COMMITs would race for ``commitlog``'s log, and every loser re-reads the winners' entries: on
an object store, adding producers made the store slower. So the loop of one process, the holder
of the lease :data:`LEASE` in ``locks``, publishes everything committed (by anyone) every
``store.publish_interval``, and at once after a COMMIT of its own process. The others only
check the lease now and then; one of them takes it over when the holder stops renewing it
(killed, stalled, cut off from the store). A COMMIT is visible after about
``publish_interval`` and one publish (up to :data:`IDLE_PAUSE` after a quiet spell: the loop
of an idle store looks less often), or ``store.publish_lease`` more when the holder died.

The lease is about cost, not correctness (rules 2, 4 and 5 hold without it): publishing is
safe with any number of publishers at once (:mod:`rmq_spark.store.publishing`), so two holders
for a moment (clocks apart, a stalled holder waking up) publish nothing twice, and a COMMIT
nobody published yet goes out with the next publish of anyone, the check-back job's included.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import socket
import threading
import time
import uuid
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rmq_spark.store.facade import Store

log = logging.getLogger(__name__)

#: The name of the publisher's lease in ``locks``.
LEASE = "publish:commitlog"
#: The longest pause of a holder's loop on an idle store (its own COMMITs wake it at once).
IDLE_PAUSE = 1.0


def publisher_for(store: Store) -> BackgroundPublisher:
    """The publisher of the shard a producer process writes to, started.

    In a store of several shards (:mod:`rmq_spark.store.shards`) a producer process claims a
    shard by taking its publisher lease, trying the shards from a random one: while there are
    at least as many shards as producer processes, each writes to logs no other process
    appends to, and publishes its own shard. With every lease held, it shares a shard picked
    at random (its holder publishes it). In a store of one shard, that shard.

    Parameters
    ----------
    store : Store
        The store's root.
    """
    holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    numbers = store.shard_numbers(refresh=True)
    if len(numbers) == 1:
        return BackgroundPublisher(store, holder)
    first = random.randrange(len(numbers))
    for number in numbers[first:] + numbers[:first]:
        shard = store.shard_store(number)  # opened only when tried
        if shard.lock(LEASE, holder, shard.settings.publish_lease):
            log.info(
                "writing to shard %d of %s (its publisher lease taken)", shard.shard, store.root
            )
            return BackgroundPublisher(shard, holder, holding=True)
    shared = store.shard_store(random.choice(numbers))
    log.info(
        "every shard of %s has a producer process; sharing shard %d (more shards: [store] shards)",
        store.root,
        shared.shard,
    )
    return BackgroundPublisher(shared, holder)


def publish_own(store: Store, who: str) -> None:
    """Publish up to this thread's last decision on ``store`` (the publisher lease's holder
    may be another process, or none right now); a failure is logged, not raised: the COMMITs
    are recorded, and the lease's holder or the check-back job publishes them.

    ``who`` names the caller in the log (``"this producer"``, ``"this server"``).
    """
    try:
        store.publish(latest=False)
    except Exception as exc:
        log.warning(
            "publishing %s's COMMITs failed (%s); they are recorded, and the holder of the "
            "publisher lease or the check-back job publishes them",
            who,
            exc,
        )


class BackgroundPublisher:
    """Publishes a store's COMMITs on a background thread while this process holds the
    publisher lease (see the module docstring).

    Parameters
    ----------
    store : Store
        The store (one shard of it); ``store.settings.publish_interval`` and ``publish_lease``
        set the pace.
    holder : str
        This process's name in the lease.
    holding : bool, default False
        The lease was just taken for ``holder`` (:func:`publisher_for`).
    """

    def __init__(self, store: Store, holder: str, *, holding: bool = False) -> None:
        self.store = store
        self.holder = holder
        self.interval = store.settings.publish_interval
        self.lease = store.settings.publish_lease
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._holding = holding
        #: time.monotonic() of the last look that took or renewed the lease.
        self._renewed = time.monotonic()
        # The lease is looked at on a thread of its own: a look reads and MERGEs ``locks``,
        # several round trips on an object store, which held up the COMMITs waiting to be
        # published (the publish lag's p99 on S3 was a second).
        self._threads = [
            threading.Thread(target=self._run, name="rmqtx-publisher", daemon=True),
            threading.Thread(
                target=self._keep_lease, args=(holding,), name="rmqtx-publisher-lease", daemon=True
            ),
        ]
        _running.add(self)
        for thread in self._threads:
            thread.start()

    @property
    def holding(self) -> bool:
        """Whether this process holds the lease: it took or renewed it when it last looked,
        less than the lease ago (a look that hangs or fails for longer lets another process
        take it over, and this one stops publishing)."""
        return self._holding and time.monotonic() - self._renewed < self.lease

    def wake(self) -> None:
        """Publish now if this process holds the lease (it has just recorded a COMMIT)."""
        self._wake.set()

    def stop(self) -> None:
        """Stop the loop (waiting for a publish under way) and give the lease back."""
        self._stopping.set()
        self._wake.set()
        for thread in self._threads:
            thread.join()
        _running.discard(self)
        if self._holding:
            self._holding = False
            try:
                self.store.lock(LEASE, self.holder, 0.0)
            except Exception as exc:  # it expires by itself
                log.warning("could not give the publisher lease back (%s); it expires", exc)

    def _run(self) -> None:
        pause = self.interval
        while not self._stopping.is_set():
            woken = self._wake.wait(pause)
            self._wake.clear()
            if self._stopping.is_set():
                return
            try:
                published = 0
                if self.holding:
                    # Woken by this process's COMMITs: up to the op version it wrote, with no
                    # listing of op's log; every interval: up to the latest (anyone's).
                    published = self.store.publish(latest=not woken).published
                # An idle store is looked at less and less often (each look lists op's log: a
                # request, billed on an object store), down to once every IDLE_PAUSE.
                idle = not woken and not published
                pause = max(self.interval, min(pause * 2, IDLE_PAUSE)) if idle else self.interval
            except Exception as exc:
                pause = min(pause * 2, self.lease / 3)
                # Another holder, the check-back job or this loop's next turn publishes it.
                log.warning("background publish failed (%s); trying again", exc)
                log.debug("background publish traceback", exc_info=True)

    def _keep_lease(self, holding: bool) -> None:
        """Look at the lease every third of it (at once, unless ``holding`` it already): take
        it when free or expired, renew it while held."""
        pause = self.lease / 3 if holding else 0.0
        while not self._stopping.wait(pause):
            pause = self.lease / 3
            try:
                looked = time.monotonic()
                held_by = self.store.lock_holder(LEASE)
                holding = held_by in (None, self.holder) and self.store.lock(
                    LEASE, self.holder, self.lease
                )
                if holding:
                    self._renewed = looked
            except Exception as exc:  # looked at again next time; publishing goes on meanwhile
                log.warning("could not look at the publisher lease (%s); trying again", exc)
                continue
            if holding != self._holding:
                state = "took" if holding else "lost"
                log.info("%s the publisher lease of %s", state, self.store.root)
                self._holding = holding


_running: weakref.WeakSet[BackgroundPublisher] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    # A daemon thread stopped by the interpreter's exit inside pyarrow aborts the process.
    for publisher in list(_running):
        publisher.stop()
