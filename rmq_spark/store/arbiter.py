"""First decision wins in one conditional put: a transaction's decision object.

A transaction whose id says so (:func:`rmq_spark.model.messages.object_decided`) is decided by
whoever first puts its decision object, ``op/_rmqtx_decisions/<transaction id>.json`` in its
shard: written only if absent (a hard link of a complete file on a local filesystem, a PUT
with ``If-None-Match: *`` on S3), never changed, and removed only by retention, after its
transaction's ``half`` and ``op`` rows (a late decision then has nothing to publish). A decider
that finds it there reads the decision in force from it. A decision in ``op`` (one Delta commit:
three round trips on an object store) was the arbiter before; one conditional put is one round
trip, and the decision recorded in ``op`` follows it (landed by the decider, in the background
for a producer, or by the check-back job for a decider that died first:
:mod:`rmq_spark.store.decisions`). So ``op`` says what was decided; the object says which
decision won, and ``op`` never says otherwise.

Delta readers, VACUUM and rmq-spark's own vacuum skip folders that start with an underscore.
Each object holds a token of the put that wrote it: a put retried after a lost answer
(an object store's request timed out after it landed) finds its own object and knows it won.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from rmq_spark.delta.parallel import each
from rmq_spark.delta.storage import filesystem, scheme
from rmq_spark.model.errors import CorruptStoreError
from rmq_spark.model.messages import LocalTransactionState

#: The folder of ``op`` that holds the decision objects.
DECISIONS_DIR = "_rmqtx_decisions"


#: Decision objects a process puts at once: a batch of 64 senders' decisions in one round trip
#: (16 at once took four, one after the other).
CLAIMS_AT_ONCE = 64


@dataclass(frozen=True)
class Claimed:
    """The decision in force for a transaction after a claim: ``won`` when the claim's own
    put wrote it."""

    transaction_id: str
    producer_group: str
    state: LocalTransactionState
    decided_by: str
    decided: datetime
    won: bool


def supports_objects(uri: str) -> bool:
    """Whether decision objects can be put at ``uri``: a filesystem with a put-if-absent that
    rmq-spark uses (local, S3)."""
    return scheme(uri) in ("file", "s3", "s3a")


class DecisionObjects:
    """The decision objects of one shard's ``op`` table at ``op_uri``."""

    def __init__(self, op_uri: str, storage_options: Mapping[str, str]) -> None:
        self.local = scheme(op_uri) == "file"
        self.fs, path = filesystem(op_uri, storage_options)
        self.path = f"{path.rstrip('/')}/{DECISIONS_DIR}"
        self._made = False

    def claim(
        self, decisions: Sequence[tuple[str, str, LocalTransactionState, str]], at: datetime
    ) -> list[Claimed]:
        """Put the decision object of each ``(transaction_id, producer_group, state,
        decided_by)`` unless one exists; return the decision in force for each, in order."""
        return each(lambda d: self._claim(*d, at), decisions, "decisions", CLAIMS_AT_ONCE)

    def read(self, transaction_ids: Sequence[str]) -> dict[str, Claimed]:
        """The decision objects found for ``transaction_ids`` (absent: none put yet)."""
        found = each(self._read, transaction_ids, "decision-reads")
        return {c.transaction_id: c for c in found if c is not None}

    def remove(self, transaction_ids: Sequence[str]) -> None:
        """Delete the decision objects of ``transaction_ids`` (absent ones are skipped): only
        for transactions retention removed from ``half`` and ``op``, whose late decisions have
        nothing to publish (:mod:`rmq_spark.store.retention`)."""
        names = [self._name(t) for t in transaction_ids]
        if self.local:
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name)
        elif names:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(names)

    def _name(self, transaction_id: str) -> str:
        return f"{self.path}/{transaction_id}.json"

    def _claim(
        self,
        transaction_id: str,
        producer_group: str,
        state: LocalTransactionState,
        decided_by: str,
        at: datetime,
    ) -> Claimed:
        token = uuid.uuid4().hex
        body = {
            "transaction_id": transaction_id,
            "producer_group": producer_group,
            "decision": state.value,
            "decided_by": decided_by,
            "decided_timestamp": at.isoformat(),
            "token": token,
        }
        if self._put_if_absent(self._name(transaction_id), json.dumps(body).encode()):
            return Claimed(transaction_id, producer_group, state, decided_by, at, True)
        found = self._read(transaction_id)
        if found is None:  # only retention removes one, after its transaction's rows
            raise CorruptStoreError(
                f"the decision object of transaction {transaction_id!r} was there when this "
                f"put was refused and is gone now ({self._name(transaction_id)}); only "
                f"retention may delete decision objects (see storage/README.md)."
            )
        return found if found.token != token else _won(found)

    def _read(self, transaction_id: str) -> Claimed | None:
        try:
            data = self.fs.cat_file(self._name(transaction_id))
        except FileNotFoundError:
            return None
        try:
            body = json.loads(data)
            return _Found(
                body["transaction_id"],
                body["producer_group"],
                LocalTransactionState(body["decision"]),
                body["decided_by"],
                datetime.fromisoformat(body["decided_timestamp"]).astimezone(UTC),
                False,
                body["token"],
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptStoreError(
                f"the decision object {self._name(transaction_id)} is not one rmq-spark wrote "
                f"({exc}); restore it from a backup or remove the damaged store."
            ) from exc

    def _put_if_absent(self, name: str, data: bytes) -> bool:
        """Write ``data`` as ``name`` unless it exists; False when it does."""
        try:
            if not self.local:  # If-None-Match: * (rmq_spark.delta.s3requests)
                self.fs.pipe_file(name, data, mode="create")
                return True
            if not self._made:
                os.makedirs(self.path, exist_ok=True)
                self._made = True
            temp = f"{self.path}/.{uuid.uuid4().hex}.tmp"
            with open(temp, "wb") as out:
                out.write(data)
            try:
                os.link(temp, name)  # whole, and only if absent
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp)
        except FileExistsError:
            return False
        return True


@dataclass(frozen=True)
class _Found(Claimed):
    token: str = ""


def _won(found: _Found) -> Claimed:
    return Claimed(
        found.transaction_id,
        found.producer_group,
        found.state,
        found.decided_by,
        found.decided,
        True,
    )
