"""Publishing in the background: one process at a time moves every producer's COMMITs into the
CommitLog.

A producer's end-transaction returns once its decision is durable in its decision object
(RocketMQ's end-transaction is a one-way request too); recording it in ``op`` (landing it, with
the other decisions of the process of that moment, in one commit) and moving the committed
messages into ``commitlog`` are left to a :class:`BackgroundPublisher`, which lands in every
process and publishes in one. Producers on many hosts that each published their own
COMMITs would race for ``commitlog``'s log, and every loser re-reads the winners' entries: on an
object store, adding producers made the store slower. So the loop of one process, the holder of
the lease :data:`LEASE` in the root's ``locks``, publishes everything committed (by anyone, in
every shard, in one commit a round) every ``store.publish_interval``, and ``store.publish_linger``
after a COMMIT of its own process (by default 50 ms on a local filesystem, 200 ms on an object
store), with the COMMITs of that moment in the same commit. The others only check the lease now and
then; one of them takes it over when the holder stops renewing it (killed, stalled, cut off from
the store). A COMMIT is visible after about ``publish_interval`` (or the linger) and one publish
(up to :data:`IDLE_PAUSE` after a quiet spell: the loop of an idle store looks less often), or
up to one and a half ``store.publish_lease`` more when the holder died.

The lease is about cost, not correctness (rules 2, 4 and 5 hold without it): publishing is safe
with any number of publishers at once (:mod:`rmq_spark.store.publishing`), so two holders for a
moment (clocks apart, a stalled holder waking up) publish nothing twice, and a COMMIT nobody
published yet goes out with the next publish of anyone, the check-back job's included.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import random
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rmq_spark.delta.storage import scheme
from rmq_spark.model.config import StoreSettings

if TYPE_CHECKING:
    from rmq_spark.store.decisions import Decision, EndTransactionResult
    from rmq_spark.store.facade import Store

log = logging.getLogger(__name__)

#: The name of the store's publisher lease, in the root's ``locks``.
LEASE = "publish:commitlog"
#: The name of a producer process's claim of a shard to write to, in the shard's ``locks``.
CLAIM = "producer:shard"
#: A claim lasts this many times ``store.publish_lease``: it only spreads producer processes
#: over the shards when they start, so a dead process's shard may wait a minute for the next,
#: and sixteen processes renewing it do not keep the store busy while idle.
CLAIM_LEASES = 6
#: The longest pause of a holder's loop on an idle store (its own COMMITs wake it at once).
IDLE_PAUSE = 1.0
#: ``store.publish_linger`` on an object store when unset (seconds): at 20 transactions a
#: second and 20 ms a request, a third as many publish commits, 0.2 s later.
OBJECT_STORE_LINGER = 0.2
#: ``store.publish_linger`` on a local filesystem when unset (seconds): a publish commit after
#: every transaction of one sender took more of the process's CPU than the sends themselves
#: (8.7 ms a transaction against 4.8 with the linger, at 110 against 250 transactions a second).
LOCAL_LINGER = 0.05


def publisher_for(store: Store) -> BackgroundPublisher:
    """The background publisher of a producer process, started, with the shard it writes to
    (:attr:`BackgroundPublisher.writer`).

    In a store of several shards (:mod:`rmq_spark.store.shards`) a producer process claims a
    shard (the lease :data:`CLAIM` in its ``locks``), trying the shards from a random one:
    while there are at least as many shards as producer processes, each writes to logs no other
    process appends to. With every shard claimed, it shares a shard picked at random. In a
    store of one shard, that shard. Either way one process of the store, the holder of its
    publisher lease, publishes every shard's COMMITs.

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
        if shard.lock(CLAIM, holder, CLAIM_LEASES * shard.settings.publish_lease):
            log.info("writing to shard %d of %s (claimed)", shard.shard, store.root)
            claim = Lease(shard, CLAIM, holder, CLAIM_LEASES, held=True)
            return BackgroundPublisher(store, holder, writer=shard, claim=claim)
    shared = store.shard_store(random.choice(numbers))
    log.info(
        "every shard of %s has a producer process; sharing shard %d (more shards: [store] shards)",
        store.root,
        shared.shard,
    )
    return BackgroundPublisher(store, holder, writer=shared)


def publish_own(store: Store, who: str) -> None:
    """Publish up to this process's last decision on ``store`` (the publisher lease's holder
    may be another process, or none right now); a failure is logged, not raised: the COMMITs
    are recorded, and the lease's holder or the check-back job publishes them.

    ``who`` names the caller in the log (``"this producer"``, ``"this server"``).
    """
    with contextlib.suppress(Exception):  # logged; the publish goes on without them
        store.land_decisions()
    try:
        store.publish(latest=False)
    except Exception as exc:
        log.warning(
            "publishing %s's COMMITs failed (%s); they are recorded, and the holder of the "
            "publisher lease or the check-back job publishes them (and lands those only "
            "their decision objects hold)",
            who,
            exc,
        )


def end_in_background(
    store: Store,
    publisher: BackgroundPublisher | None,
    decisions: Sequence[Decision],
    *,
    normal: bool,
) -> list[EndTransactionResult]:
    """End a producer process's ``decisions`` (a producer's or a server's batch): durable in
    their decision objects when this returns, landed in ``op`` and published by ``publisher``
    (woken; without one, landed at once). With ``normal`` messages to publish next, every
    decision of the process is landed first, so those come after the COMMITs sent before them.
    """
    results = (
        store.end_transactions(decisions, publish=False, land=publisher is None)
        if decisions
        else []
    )
    if publisher is not None:
        if normal:
            with contextlib.suppress(Exception):  # logged; the messages go out regardless
                store.land_decisions()
        if decisions:
            publisher.wake()  # lands them, and publishes the COMMITs
    return results


class Lease:
    """A lease in a store's ``locks``, looked at on a thread of its own: renewed every third
    of it while held, looked at every half of it while another process holds it, and taken
    when free or expired. Each look is several requests: sixteen idle producer processes
    that looked at two leases each every third of one kept half of a two-core machine busy
    on an object store.

    Parameters
    ----------
    store : Store
        The store (or shard) whose ``locks`` hold it.
    name : str
        The lease (:data:`LEASE`, :data:`CLAIM`).
    holder : str
        This process's name in it.
    leases : int, default 1
        It lasts this many times ``store.publish_lease``.
    held : bool, default False
        It was just taken for ``holder``.
    """

    def __init__(
        self, store: Store, name: str, holder: str, leases: int = 1, *, held: bool = False
    ) -> None:
        self.store, self.name, self.holder = store, name, holder
        self.seconds = leases * store.settings.publish_lease
        self._held = held
        #: time.monotonic() of the last look that took or renewed it.
        self._renewed = time.monotonic()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._keep, name=f"rmqtx-lease-{name}", daemon=True)
        self._thread.start()

    @property
    def held(self) -> bool:
        """Whether this process holds it: it took or renewed it when it last looked, less than
        the lease ago (a look that hangs or fails for longer lets another process take it over,
        and this one stops acting on it)."""
        return self._held and time.monotonic() - self._renewed < self.seconds

    def stop(self) -> None:
        """Stop looking at it, and give it back if held."""
        self._stopping.set()
        self._thread.join()
        if self._held:
            self._held = False
            try:
                self.store.lock(self.name, self.holder, 0.0)
            except Exception as exc:  # it expires by itself
                log.warning("could not give the lease %s back (%s); it expires", self.name, exc)

    def _keep(self) -> None:
        pause = self.seconds / 3 if self._held else 0.0
        while not self._stopping.wait(pause):
            try:
                looked = time.monotonic()
                # Held: renewed (granted to its holder). Else taken only if nobody holds it
                # (a read first: a take is a write).
                held = (
                    self._held or self.store.lock_holder(self.name) in (None, self.holder)
                ) and self.store.lock(self.name, self.holder, self.seconds)
                if held:
                    self._renewed = looked
            except Exception as exc:  # looked at again next time; work goes on meanwhile
                log.warning("could not look at the lease %s (%s); trying again", self.name, exc)
                pause = self.seconds / 3
                continue
            # Another's lease is taken over within half a lease of its end.
            pause = self.seconds / 3 if held else self.seconds * random.uniform(0.4, 0.5)
            if held != self._held:
                state = "took" if held else "lost"
                log.info("%s the lease %s of %s", state, self.name, self.store.root)
                self._held = held


class BackgroundPublisher:
    """Publishes every COMMIT of a store on a background thread while this process holds the
    store's publisher lease (see the module docstring), and keeps the claim of the shard this
    process writes to.

    Parameters
    ----------
    store : Store
        The store's root; ``store.settings.publish_interval`` and ``publish_lease`` set the
        pace.
    holder : str
        This process's name in the leases.
    writer : Store, optional
        The shard this process writes to (default: the root).
    claim : Lease, optional
        This process's claim of ``writer``, given back by :meth:`stop`.
    """

    def __init__(
        self,
        store: Store,
        holder: str,
        *,
        writer: Store | None = None,
        claim: Lease | None = None,
    ) -> None:
        self.store = store
        self.writer = writer or store
        self.holder = holder
        self.interval = store.settings.publish_interval
        self.linger = linger(store.settings, store.root)
        self._claim = claim
        self._wake = threading.Event()
        self._stopping = threading.Event()
        #: time.monotonic() of the last publish that listed every shard's ``op``.
        self._listed = 0.0
        #: time.monotonic() of the last look for shards made since.
        self._looked = time.monotonic()
        # The lease is looked at on a thread of its own: a look reads and rewrites ``locks``,
        # several round trips on an object store, which held up the COMMITs waiting to be
        # published (the publish lag's p99 on S3 was a second).
        self._lease = Lease(store, LEASE, holder)
        self._thread = threading.Thread(target=self._run, name="rmqtx-publisher", daemon=True)
        _running.add(self)
        self._thread.start()

    @property
    def holding(self) -> bool:
        """Whether this process holds the store's publisher lease (:attr:`Lease.held`)."""
        return self._lease.held

    @property
    def claimed(self) -> bool:
        """Whether this process holds the claim of the shard it writes to."""
        return self._claim is not None and self._claim.held

    def wake(self) -> None:
        """Land this process's decisions, and publish if this process holds the lease (it has
        just decided transactions)."""
        self._wake.set()

    def stop(self) -> None:
        """Stop the loop (waiting for a publish under way), land the decisions left, and give
        the leases back."""
        self._stopping.set()
        self._wake.set()
        self._thread.join()
        _running.discard(self)
        with contextlib.suppress(Exception):  # logged; in force in their objects meanwhile
            self.store.land_decisions()
        for lease in (self._lease, self._claim):
            if lease is not None:
                lease.stop()

    def _run(self) -> None:
        pause = self.interval
        while not self._stopping.is_set():
            woken = self._wake.wait(pause)
            if woken and self.linger:
                self._stopping.wait(self.linger)  # the COMMITs coming meanwhile go along
            self._wake.clear()
            if self._stopping.is_set():
                return
            # A landing that fails (logged) holds up no publish of what others landed.
            with contextlib.suppress(Exception):
                self.store.land_decisions()
            try:
                published = 0
                if self.holding:
                    published = self._publish(woken)
                # An idle store is looked at less and less often (each look lists op's log: a
                # request, billed on an object store), down to once every IDLE_PAUSE.
                idle = not woken and not published
                pause = max(self.interval, min(pause * 2, IDLE_PAUSE)) if idle else self.interval
            except Exception as exc:
                pause = min(pause * 2, self._lease.seconds / 3)
                # Another holder, the check-back job or this loop's next turn publishes it.
                log.warning("background publish failed (%s); trying again", exc)
                log.debug("background publish traceback", exc_info=True)

    def _publish(self, woken: bool) -> int:
        """One publish of every shard: woken by this process's COMMITs, up to the ``op``
        versions it knows (no listing), but at least every interval up to the latest
        (anyone's: a holder woken all the time must not leave other processes' COMMITs
        behind); shards made since are looked for every third of the lease."""
        now = time.monotonic()
        if now - self._looked > self._lease.seconds / 3:
            self._looked = now
            self.store.shard_numbers(refresh=True)
        latest = not woken or now - self._listed >= self.interval
        if latest:
            self._listed = now
        return self.store.publish(latest=latest).published


_running: weakref.WeakSet[BackgroundPublisher] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    # A daemon thread stopped by the interpreter's exit inside pyarrow aborts the process.
    for publisher in list(_running):
        publisher.stop()


def linger(settings: StoreSettings, root: str) -> float:
    """How long the publisher of the store at ``root`` lingers after a COMMIT of its process
    (``store.publish_linger``; by default :data:`LOCAL_LINGER` on a local filesystem and
    :data:`OBJECT_STORE_LINGER` on an object store)."""
    if settings.publish_linger is not None:
        return settings.publish_linger
    return LOCAL_LINGER if scheme(root) == "file" else OBJECT_STORE_LINGER
