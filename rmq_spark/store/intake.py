"""Half messages durable in one request: intake objects, landed in ``half`` in the background.

* **Nothing is lost** (rule 4). On an object store a ``half`` commit is three sequential round
  trips (the data file, the log entry, the check that the entry is reachable). With intake
  (``store.intake``), :meth:`Intake.stage` makes a prepare's half messages durable in one put of
  an *intake object* in its shard, ``half/_rmqtx_intake/<first id>-<last id>-<writer>.arrow``
  (Arrow IPC, ``half``'s schema, named by its transactions' id range; Delta readers, VACUUM and
  rmq-spark's vacuum skip folders that start with an underscore), and the send returns. The
  process's background publisher lands its intake objects in ``half`` (:meth:`Intake.land`, one
  commit for all of that moment) before it lands any decision in ``op``; a process killed first
  leaves them to the check-back job, which lands every intake object older than the transaction
  timeout before it reads ``half`` (:meth:`Intake.recover`), and so does any process that lands
  in ``op`` a decision of a transaction it did not prepare itself (the objects whose id range
  covers it). A process's landing takes the decisions to land before the objects it staged: each
  of those transactions was staged before it was decided. So ``op`` never holds a decision whose
  half messages ``half`` lacks (a publisher would find nothing to publish for it).
* **Landed once.** An object may be landed by its writer and by a recoverer at the same time
  (a writer stalled, not dead). Each landing records the Delta application id of the bucket of
  its objects' writer (:func:`intake_app_id`), so two landings of one object conflict and the
  second, retried on the latest snapshot, looks the object's transactions up in ``half`` and
  finds them there. A writer skips that lookup while the application id of its bucket is the one
  its own last landing recorded (no one landed any of its objects since). An object is deleted
  after its landing (by its writer, once the decisions of that moment are in ``op``); one whose
  deletion failed is found landed by the next recoverer, which deletes it. So an object gone
  was landed: a landing that did not read the application id as its own lands only the objects
  it lists after reading the snapshot it commits on. A writer stalled while a recoverer landed
  its objects, the transactions were decided and retention removed them, does not bring them
  back from memory (nor does a recoverer stalled after reading an object). No clock or file
  time is trusted: the age a recoverer waits for only spares a live writer the race (a
  landing that must have every object, for a decision or for retention, lands them whatever
  their time), and the hour after which a temp file on local disk is taken for a killed
  writer's can fail a send that was stalled (its rename then finds nothing), never lose one.

An intake object left unlanded (its writer killed, no check-back job running) is pending all
the same, and the check-back job lands it when it runs. An object landed but not deleted would
bring its transactions back once retention removed their rows: retention lands (and so deletes)
every object first, and keeps the rows of the transactions whose ids an object left over still
covers (:meth:`Intake.covering`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
import zlib
from collections.abc import Sequence
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc

from rmq_spark.delta.parallel import each
from rmq_spark.delta.retry import retry_commits
from rmq_spark.delta.storage import check_conditional_put, filesystem, scheme
from rmq_spark.model.errors import RmqSparkError
from rmq_spark.model.failpoints import failpoint
from rmq_spark.model.schema import HALF_SCHEMA
from rmq_spark.store.context import StoreConcept, StoreContext
from rmq_spark.store.reads import half_messages, held_in_half

log = logging.getLogger(__name__)

#: The folder of ``half`` that holds the intake objects.
INTAKE_DIR = "_rmqtx_intake"
_SUFFIX = ".arrow"
_TEMP = ".tmp"
#: A temp file is removed once this old (seconds), whatever the transaction timeout: a killed
#: writer's only wastes space, and a live writer stalled this long fails its send.
_TEMP_MIN_AGE = 3600.0
_APP_ID = "rmqtx.intake.{bucket}"
#: Buckets of writers for the landing arbiter: ``half``'s snapshot keeps one application id per
#: bucket, however many processes ever wrote intake objects.
INTAKE_BUCKETS = 1024


def intake_app_id(token: str) -> str:
    """The application id a landing of the objects of writer ``token`` records (CRC-32)."""
    return _APP_ID.format(bucket=zlib.crc32(token.encode()) % INTAKE_BUCKETS)


def _base(name: str) -> str:
    """An intake object's name without its folder."""
    return name.rsplit("/", 1)[-1]


def _parts(name: str) -> list[str]:
    """An intake object's name's parts: its first and last transaction ids and its writer
    token (``<first>-<last>-<token>.arrow``)."""
    return _base(name).removesuffix(_SUFFIX).split("-")


def _mtime(entry: os.DirEntry[str]) -> list[float]:
    """The modification time of a listed file, none when it was deleted since the listing (a
    landing by another process): one gone must not throw away the rest of the listing."""
    try:
        return [entry.stat().st_mtime]
    except FileNotFoundError:
        return []


def _covers(name: str, transaction_ids: Sequence[str]) -> bool:
    """Whether the object ``name`` may hold one of ``transaction_ids`` (by its id range)."""
    parts = _parts(name)
    if len(parts) != 3:
        return True  # not named by this release: read it
    return any(parts[0] <= t <= parts[1] for t in transaction_ids)


class Intake(StoreConcept):
    """The intake objects of one shard's ``half`` (see the module docstring)."""

    def __init__(self, context: StoreContext, *, stages: bool) -> None:
        super().__init__(context)
        #: Whether this process stages its prepares here (``store.intake``); either way it
        #: lands and reads the shard's objects that others left.
        self.stages = stages
        uri = self.tables.uri("half")
        self.local = scheme(uri) == "file"
        self.fs, path = filesystem(uri, self.tables.storage_options)
        self.path = f"{path.rstrip('/')}/{INTAKE_DIR}"
        #: This writer's objects are named with it; its bucket's application id is its arbiter.
        self._token = uuid.uuid4().hex[:16]
        self._app_id = intake_app_id(self._token)
        #: The value of ``_app_id`` this writer's last landing recorded (None: none yet).
        self._landed_at: int | None = None
        #: Objects staged here and not landed yet: (name, rows), in staging order.
        self._staged: list[tuple[str, pa.Table]] = []
        self._lock = threading.Lock()
        #: One landing at a time (the publisher's loop, a flush, a shutdown).
        self._landing = threading.Lock()
        self._made = False

    # ------------------------------------------------------------------ writing
    def stage(self, rows: pa.Table) -> None:
        """Make ``rows`` (``half``'s schema) durable in one put of a new intake object; they
        are landed in ``half`` by :meth:`land` (or a recoverer)."""
        # Before this process's first write to the store: its decision objects need an
        # endpoint that honours If-None-Match.
        check_conditional_put(self.tables.root, self.tables.storage_options)
        ids = rows.column("transaction_id")
        first, last = pc.min_max(ids).values()
        name = f"{self.path}/{first}-{last}-{self._token}{_SUFFIX}"
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, rows.schema) as writer:
            writer.write_table(rows)
        self._put(name, sink.getvalue().to_pybytes())
        with self._lock:
            self._staged.append((name, rows))

    def _put(self, name: str, data: bytes) -> None:
        if not self.local:
            self.fs.pipe_file(name, data, mode="create")  # a unique name: never refused
            return
        if not self._made:
            os.makedirs(self.path, exist_ok=True)
            self._made = True
        temp = f"{self.path}/.{uuid.uuid4().hex}{_TEMP}"  # a dot: not listed as an object
        try:
            with open(temp, "wb") as out:
                out.write(data)
            failpoint("intake.written")
            os.replace(temp, name)  # whole or not at all
        except FileNotFoundError as exc:
            if os.path.exists(name):  # renamed (an NFS client's retried rename finds it done)
                return
            raise RmqSparkError(
                f"the intake object's temp file {temp} was removed before it was renamed into "
                f"place: this process stalled for over {_TEMP_MIN_AGE:.0f} s and the check-back "
                "job took it for one a killed writer left (or the folder was removed); nothing "
                "of this send is stored, send it again"
            ) from exc
        except BaseException:  # a full disk: nothing left behind
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise

    # ------------------------------------------------------------------ landing
    def land(self) -> tuple[list[str], set[str]]:
        """Land in ``half`` the objects this process staged so far, in one commit; return
        their names, for :meth:`delete` (after the decisions of that moment are landed: the
        deletion is not on the way to ``op``; those gone already are gone), and the
        transactions of those that another process landed and deleted and that ``half`` no
        longer holds (retention removed them while this one stalled): their decisions must
        not land (see :class:`rmq_spark.store.landing.Landing`). A failed landing keeps them
        for the next call."""
        with self._landing:
            with self._lock:
                batch = list(self._staged)
            if not batch:
                return [], set()
            failpoint("intake.landing")
            _, gone = self._land(batch, own=True)
            with self._lock:
                del self._staged[: len(batch)]
            return [name for name, _ in batch], gone

    def recover(
        self,
        older_than: float,
        now: float | None = None,
        covering: Sequence[str] | None = None,
        just_landed: Sequence[str] = (),
    ) -> int:
        """Land the intake objects any process staged in this shard and left unlanded (killed,
        stalled, or not landed yet) that are at least ``older_than`` seconds old at ``now``
        (seconds since the epoch, default: this machine's clock) by the time their storage
        lists (0: all of them), or only those whose id range covers one of ``covering``, and
        delete them; return how many transactions' messages were landed (objects landed
        already are deleted only). ``just_landed``: objects this process has just landed
        itself, left alone (it deletes them). With an age (``older_than`` > 0), the temp
        files that killed writers left on local disk are removed first, once an hour old.
        Without (0), every object is landed, whatever its time: on NFS that is the server's
        clock, which may be ahead of this host's."""
        now = time.time() if now is None else now
        with self._landing:
            if older_than > 0:
                self._sweep(max(older_than, _TEMP_MIN_AGE), now)
            found = self._listed(older_than, now)
            mine = {_base(name) for name in just_landed}
            found = [name for name in found if _base(name) not in mine]
            if covering is not None:
                found = [name for name in found if _covers(name, covering)]
            if not found:
                return 0
            datas = each(self._read, found, "intake-reads")
            objects = [(n, r) for n, r in zip(found, datas, strict=True) if r is not None]
            failpoint("intake.read")
            landed = self._land(objects, own=False)[0] if objects else 0
            self.delete([n for n, _ in objects])
            if landed:
                log.info(
                    "landed %d transaction(s) of %d intake object(s) that their writer had not "
                    "landed in %s (e.g. %s)",
                    landed,
                    len(objects),
                    self.tables.uri("half"),
                    _base(objects[0][0]),
                )
            return landed

    def covering(self, transaction_ids: Sequence[str]) -> set[str]:
        """Those of ``transaction_ids`` that the id range of an intake object in this shard
        covers (one listing): retention keeps their rows, which such an object (landed, its
        deletion failed) would otherwise bring back."""
        names = self._listed(0.0, float("inf"))
        return {t for t in transaction_ids if any(_covers(name, [t]) for name in names)}

    def half_messages(self, transaction_ids: Sequence[str], in_half: pa.Table) -> pa.Table:
        """``in_half`` (the half messages of ``transaction_ids`` read from ``half``) with those
        of the others that an intake object of this shard holds, not landed yet (one listing,
        and a read of each object whose id range covers one), then of those still missing
        that ``half`` holds now: an object gone by its read was landed (deleted after its
        landing commit)."""
        found = set(in_half.column("transaction_id").to_pylist())
        rest = [t for t in transaction_ids if t not in found]
        if not rest:
            return in_half
        names = [name for name in self._listed(0.0, float("inf")) if _covers(name, rest)]
        datas = [d for d in each(self._read, names, "intake-reads") if d is not None]
        staged = pa.concat_tables([HALF_SCHEMA.empty_table(), *datas])
        staged = staged.filter(pc.is_in(staged.column("transaction_id"), pa.array(rest)))
        rest = sorted(set(rest) - set(staged.column("transaction_id").to_pylist()))
        landed = [half_messages(self.tables, rest)] if rest else []
        return pa.concat_tables([in_half, staged, *landed])

    def _land(self, objects: Sequence[tuple[str, pa.Table]], *, own: bool) -> tuple[int, set[str]]:
        """Append the rows of ``objects`` to ``half`` unless they are there; return how many
        transactions that was (the landing arbiter: see the module docstring), and the
        transactions of the objects found gone (landed by another process) that ``half`` does
        not hold."""
        ids = sorted({t for _, rows in objects for t in rows.column("transaction_id").to_pylist()})
        apps = {intake_app_id(_parts(name)[-1]) for name, _ in objects}
        gone: set[str] = set()

        def attempt(n: int) -> tuple[int, int | None]:
            gone.clear()
            head = self.tables.head("half", reload=n > 0 or not own)
            mine = own and n == 0 and head.txns.get(self._app_id) == self._landed_at
            if not mine and head.snapshot.version() != head.version:
                head = self.tables.head("half", reload=True)
            todo = list(objects)
            if not mine:
                # Listed after the snapshot is read: an object gone by now was landed (a
                # recoverer deletes one only after landing it), on this snapshot, on one the
                # commit below then conflicts with, or (nothing left to commit) on one read again
                # for those found gone. Its rows may be gone from half too (retention, while this
                # process was stalled): landing them would bring them back.
                failpoint("intake.listing")
                listed = {_base(name) for name, _ in self._entries()}
                present = listed | {  # each one not listed asked alone: a listing may lag
                    _base(n) for n, _ in objects if _base(n) not in listed and self._exists(n)
                }
                there = held_in_half(self.tables, ids, head.snapshot)
                for name, rows in objects:
                    if _base(name) not in present:  # in half still, the decision may land
                        gone.update(set(rows.column("transaction_id").to_pylist()) - there)
                if gone:
                    now = self.tables.head("half", reload=True).snapshot
                    gone.difference_update(held_in_half(self.tables, sorted(gone), now))
                todo = [
                    (name, rows)
                    for name, rows in objects
                    if _base(name) in present
                    and not there.intersection(rows.column("transaction_id").to_pylist())
                ]
            if not todo:
                return 0, None
            rows = pa.concat_tables([r for _, r in todo])
            files = self.tables.write("half", [rows])
            value = head.version + 1
            self.tables.commit(
                "half",
                files,
                head.snapshot,
                app_ids=dict.fromkeys(sorted(apps), value),
                info={"rmqtx.operation": "land-intake"},
                after=head.version,
            )
            failpoint("intake.landed")
            return len(set(rows.column("transaction_id").to_pylist())), value

        landed, value = retry_commits(f"land {len(objects)} intake object(s)", "half", attempt)
        if own and value is not None:
            self._landed_at = value
        if gone:
            log.warning(
                "%d transaction(s) (e.g. %s) of intake objects were landed by another process "
                "and removed from half since (retention, while this one stalled): not landed "
                "again, nor their decisions",
                len(gone),
                min(gone),
            )
        return landed, gone

    # ------------------------------------------------------------------ objects
    def waiting(self, now: float) -> tuple[int, float | None]:
        """How many intake objects this shard holds (not landed yet, or landed and not deleted
        yet), and the age of the oldest at ``now`` (seconds since the epoch) by its storage's
        time: one listing, for ``rmqtx status``."""
        times = [at for _, at in self._entries()]
        return len(times), (max(0.0, now - min(times)) if times else None)

    def _listed(self, older_than: float, now: float) -> list[str]:
        """The intake objects of this shard put at least ``older_than`` seconds before ``now``
        (all of them when it is 0, whatever their time), oldest first."""
        return sorted(
            name for name, at in self._entries() if older_than <= 0 or now - at >= older_than
        )

    def _entries(self) -> list[tuple[str, float]]:
        """Every intake object of this shard with the time its storage lists (one listing)."""
        try:
            if self.local:
                return [
                    (e.path, at)
                    for e in os.scandir(self.path)
                    if e.name.endswith(_SUFFIX) and not e.name.startswith(".")
                    for at in _mtime(e)
                ]
            return [
                (i["name"], _seconds(i.get("LastModified") or i.get("mtime")))
                for i in self.fs.ls(self.path, detail=True, refresh=True)
                if i["name"].endswith(_SUFFIX)
            ]
        except FileNotFoundError:
            return []

    def _sweep(self, older_than: float, now: float) -> None:
        """Remove the temp files (local disk) put at least ``older_than`` seconds before
        ``now``: a writer killed between writing one and renaming it into place left it. A
        writer only stalled there finds it gone and its send fails (:meth:`_put`): a clock
        that is wrong fails a send, it loses none."""
        if not self.local:
            return
        try:
            temps = [
                e.path
                for e in os.scandir(self.path)
                if e.name.startswith(".") and e.name.endswith(_TEMP)
                for at in _mtime(e)
                if now - at >= older_than
            ]
        except FileNotFoundError:
            return
        removed = 0
        for temp in temps:
            try:
                os.unlink(temp)
                removed += 1
            except FileNotFoundError:
                pass
            except OSError as exc:  # one that cannot go holds up nothing else
                log.warning("could not remove the temp file %s (%s)", temp, exc)
        if removed:
            log.info(
                "removed %d temp file(s) that writers killed before renaming them left in %s",
                removed,
                self.path,
            )

    def _exists(self, name: str) -> bool:
        """Whether the object ``name`` is in storage, asked of it alone."""
        if self.local:
            return os.path.exists(name)
        self.fs.invalidate_cache(self.path)
        return bool(self.fs.exists(name))

    def _read(self, name: str) -> pa.Table | None:
        """The rows of an intake object; None when it is gone (landed and deleted meanwhile) or
        damaged: that one is left where it is, with an error logged each time it is read, and
        holds up no other (a check-back round that failed on it would stop every shard's
        progress, apache/rocketmq#9500)."""
        try:
            data = self.fs.cat_file(name)
        except FileNotFoundError:
            return None
        try:
            return pa.ipc.open_stream(data).read_all().cast(HALF_SCHEMA)
        except (pa.ArrowInvalid, pa.ArrowTypeError, ValueError) as exc:
            log.error(
                "the intake object %s is not one rmq-spark wrote (%s); its half messages cannot "
                "be read, so it is left where it is: restore it from a backup, or remove it "
                "(its transactions are then lost)",
                name,
                exc,
            )
            return None

    def delete(self, names: Sequence[str]) -> None:
        """Delete landed objects; a failure is logged (a recoverer finds them landed)."""
        if not names:
            return
        try:
            if self.local:
                for name in names:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name)
            else:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm(list(names))
        except OSError as exc:
            log.warning(
                "could not delete %d landed intake object(s) of %s (%s); the check-back job "
                "deletes them",
                len(names),
                self.tables.uri("half"),
                exc,
            )


def _seconds(at: object) -> float:
    """A listing's time as seconds since the epoch."""
    if isinstance(at, datetime):
        return (at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp()
    return float(at)  # type: ignore[arg-type]
