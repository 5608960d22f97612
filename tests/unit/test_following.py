"""A thread that follows a table's log without committing to it (the publisher at ``op``,
:meth:`DeltaTables.latest_version`): it finds the latest version when entries it had not read
were cleaned below a checkpoint, and, with the hint lagging that checkpoint, within its
periodic reload."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from deltalake import DeltaTable

from rmq_spark import LocalTransactionState, Message, Store
from rmq_spark.delta.tables import RELOAD_CHECKS, DeltaTables
from rmq_spark.model.schema import TABLES
from rmq_spark.store.decisions import Decision

FRESH = 0.2


def decide(store: Store, n: int) -> int:
    """``n`` transactions, each decided in a commit of its own; the last ``op`` version."""
    for prepared in store.prepare([Message("T", b"x")] * n, "g"):
        decision = Decision(prepared.transaction_id, "g", LocalTransactionState.COMMIT, "producer")
        store.end_transactions([decision], publish=False)
    return store.table("op").version()


def checkpoint_and_clean(log: Path, below: int) -> int:
    """A checkpoint of ``op`` at its latest version (deltalake's, with its hint), and the log
    entries after ``below`` up to it deleted, as a log cleanup under a stalled reader leaves
    it; the checkpoint's version."""
    table = DeltaTable(str(log.parent))
    table.create_checkpoint()
    for version in range(below + 1, table.version()):
        os.remove(log / f"{version:020d}.json")
    return table.version()


def test_a_follower_finds_the_latest_version_across_a_cleaned_hole(store: Store) -> None:
    follower = DeltaTables(store.root, TABLES, {}, FRESH)
    start = follower.latest_version("op")
    decide(store, 3)
    checkpointed = checkpoint_and_clean(Path(store.root) / "op" / "_delta_log", start)
    latest = decide(store, 1)
    time.sleep(FRESH * 1.5)
    assert checkpointed > start and follower.latest_version("op") == latest


def test_a_follower_finds_it_under_a_lagging_hint_by_its_periodic_reload(store: Store) -> None:
    follower = DeltaTables(store.root, TABLES, {}, FRESH)
    start = follower.latest_version("op")
    log = Path(store.root) / "op" / "_delta_log"
    hint = (log / "_last_checkpoint").read_bytes() if (log / "_last_checkpoint").exists() else b""
    decide(store, 3)
    checkpoint_and_clean(log, start)
    if hint:  # as if the checkpoint's writer died before its hint
        (log / "_last_checkpoint").write_bytes(hint)
    else:
        (log / "_last_checkpoint").unlink()
    latest = decide(store, 1)
    time.sleep(FRESH * 1.5)
    assert follower.latest_version("op") == start  # the hint names no newer checkpoint
    deadline = time.monotonic() + FRESH * (RELOAD_CHECKS + 3)
    while follower.latest_version("op") != latest and time.monotonic() < deadline:
        time.sleep(FRESH / 2)
    assert follower.latest_version("op") == latest
    lagging = (log / "_last_checkpoint").read_bytes() if hint else b"{}"
    assert json.loads(lagging).get("version", -1) < latest
