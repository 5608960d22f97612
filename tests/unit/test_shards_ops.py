"""Jobs and reports over every shard of a store, without Spark: the fan-out, maintenance,
re-drive of discards, ``rmqtx shards``, ``tail`` and the summaries they combine."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest

from rmq_spark import Message, Store
from rmq_spark.checkback.discards import redrive
from rmq_spark.checkback.summary import CheckBackSummary, combine_summaries
from rmq_spark.model.config import RetentionSettings, StoreSettings
from rmq_spark.model.errors import InvalidOptionError
from rmq_spark.model.messages import shard_of
from rmq_spark.model.schema import DISCARD_SCHEMA, HALF_MESSAGE_SCHEMA
from rmq_spark.ops.cli import EXIT_CONFIG, EXIT_OK, main
from rmq_spark.ops.tail import tail
from rmq_spark.store.fanout import ShardsFailedError, on_every_shard
from rmq_spark.store.retention import maintain
from rmq_spark.store.retention_summary import MaintenanceSummary

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def sharded(path: Path, shards: int = 3, clock=None) -> Store:
    return Store.open(
        path, settings=StoreSettings(shards=shards, queue_nums=2, intake=False), clock=clock
    )


# --------------------------------------------------------------------------- the fan-out
def fake_shards(n: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(shard=k) for k in range(n)]


def test_one_shard_runs_as_before_and_raises_what_it_raised() -> None:
    def fail(_):
        raise KeyError("x")

    combine = pytest.fail  # never combined: the one shard's result is the result
    assert on_every_shard(fake_shards(1), "job", lambda s: "done", combine) == "done"
    with pytest.raises(KeyError):
        on_every_shard(fake_shards(1), "job", fail, combine)


def test_a_failing_shard_stops_no_other_and_fails_the_job_at_its_end() -> None:
    ran = []

    def work(shard):
        ran.append(shard.shard)
        if shard.shard == 1:
            raise OSError("gone")
        return shard.shard * 10

    def combine(results, failures):
        return results, sorted(failures)

    with pytest.raises(
        ShardsFailedError, match=r"job failed on 1 shard\(s\).*shard 1: OSError"
    ) as e:
        on_every_shard(fake_shards(3), "job", work, combine)
    assert ran == [0, 1, 2]
    assert e.value.result == ({0: 0, 2: 20}, [1])
    assert isinstance(e.value.__cause__, OSError)
    assert on_every_shard(fake_shards(2), "job", lambda s: s.shard, combine) == ({0: 0, 1: 1}, [])


def summary(run_id: str = "r", **values) -> CheckBackSummary:
    counts = {f: 0 for f in CheckBackSummary.__dataclass_fields__ if f not in ("run_id",)}
    counts |= {"started": T0, "finished": T0, "duration_seconds": 0.0, "status": "finished"}
    counts |= {"oldest_pending_age_seconds": None, "message": None}
    return CheckBackSummary(run_id=run_id, **{**counts, **values})


def test_check_back_summaries_combine() -> None:
    later = T0 + timedelta(seconds=5)
    parts = {
        0: summary(pending_found=2, committed=1, oldest_pending_age_seconds=3.0),
        1: summary(status="failed", message="OSError: gone", errors=1, finished=later),
        2: summary(pending_found=1, rolled_back=1, oldest_pending_age_seconds=9.0),
    }
    total = combine_summaries(parts, [1])
    assert (total.pending_found, total.committed, total.rolled_back) == (3, 1, 1)
    assert (total.errors, total.status, total.message) == (2, "failed", "shard 1: OSError: gone")
    assert (total.oldest_pending_age_seconds, total.duration_seconds) == (9.0, 5.0)
    fine = combine_summaries({0: parts[0], 2: parts[2]}, [])
    assert (fine.status, fine.message, fine.errors) == ("finished", None, 0)


def test_maintenance_summaries_combine() -> None:
    done = {
        0: MaintenanceSummary("r", messages_expired=2, files_vacuumed={"op": 1}),
        1: MaintenanceSummary("r", skipped="held"),
        2: MaintenanceSummary("r", messages_expired=3, files_vacuumed={"op": 2, "half": 1}),
    }
    total = MaintenanceSummary.combined("r", done)
    assert (total.messages_expired, total.files_vacuumed) == (5, {"op": 3, "half": 1})
    assert (total.skipped, total.shards, total.shards_skipped) == (None, 3, [1])
    assert "over 3 shards (skipped, another run holds their lock: 1)" in total.format()
    everyone = MaintenanceSummary.combined("r", {0: done[1], 1: done[1]})
    assert everyone.skipped and "skipped" in everyone.format()


# --------------------------------------------------------------------------- maintenance
def test_maintain_expires_old_messages_in_every_shard(tmp_path: Path) -> None:
    store = sharded(tmp_path / "s", clock=lambda: T0)
    for k in (0, 2):
        store.shard_store(k).send([Message("Orders", b"old", keys="k")], "pg")
    summary = maintain(store, RetentionSettings(), clock=lambda: T0 + timedelta(hours=73))
    assert (summary.messages_expired, summary.queues_advanced, summary.shards) == (2, 2, 3)
    assert all(store.shard_store(k).read("commitlog").num_rows == 0 for k in range(3))


def test_maintain_on_one_shard_is_unchanged(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s", clock=lambda: T0)
    store.send([Message("Orders", b"old")], "pg")
    summary = maintain(store, clock=lambda: T0 + timedelta(hours=73))
    assert (summary.messages_expired, summary.shards) == (1, 1)
    assert "shards" not in summary.format()


# --------------------------------------------------------------------------- re-drive
def discard(store: Store) -> str:
    """A discarded transaction in ``store`` (a shard), as the check-back job records it."""
    (p,) = store.prepare([Message("Orders", b"lost", keys="o-1")], "pg")
    half = store.half_messages([p.transaction_id]).select(HALF_MESSAGE_SCHEMA.names)
    n = half.num_rows
    rows = half.append_column("check_count", pa.array([15] * n, pa.int32()))
    rows = rows.append_column(
        "discarded_timestamp",
        pa.array([T0] * n, DISCARD_SCHEMA.field("discarded_timestamp").type),
    ).append_column("redriven_transaction_id", pa.nulls(n, pa.string()))
    store.append("discard", rows.cast(DISCARD_SCHEMA))
    return p.transaction_id


def test_redrive_in_the_discards_own_shard(tmp_path: Path) -> None:
    store = sharded(tmp_path / "s")
    in_0, in_2 = discard(store), discard(store.shard_store(2))
    assert shard_of(in_2) == 2
    (new_2,) = redrive(store, [in_2])
    assert shard_of(new_2) == 2
    half = store.shard_store(2).read("half").column("transaction_id").to_pylist()
    assert sorted(half) == sorted([in_2, new_2])
    (new_0,) = redrive(store)  # the rest: shard 0's
    assert shard_of(new_0) == 0 and redrive(store) == []
    (row,) = [h for h in store.read("half").to_pylist() if h["transaction_id"] == new_0]
    assert dict(row["properties"])["REDRIVEN_FROM_TRANSACTION_ID"] == in_0


def test_redrive_of_an_unknown_transaction_redrives_nothing(tmp_path: Path) -> None:
    store = sharded(tmp_path / "s")
    known = discard(store.shard_store(1))
    missing = f"{'0' * 32}.7"  # a shard the store does not have
    with pytest.raises(InvalidOptionError, match=f"already re-driven\\): {missing}"):
        redrive(store, [known, missing])
    assert store.shard_store(1).read("half").num_rows == 1  # nothing re-driven


# --------------------------------------------------------------------------- rmqtx shards, tail
def test_rmqtx_shards_shows_and_grows_never_shrinks(tmp_path: Path, capsys) -> None:
    root = Store.open(tmp_path / "s").root
    assert main(["--path", root, "shards"]) == EXIT_OK
    assert capsys.readouterr().out.strip() == f"store {root}: 1 shard(s)"
    # Growing cannot be undone: it is not done without --yes (stdin is not a terminal here).
    assert main(["--path", root, "shards", "--set", "3"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "from 1 to 3 shards cannot be undone" in err and "run it again with --yes" in err
    assert len(Store.open(root, create=False).shards(refresh=True)) == 1
    assert main(["--path", root, "shards", "--set", "3", "--yes"]) == EXIT_OK
    assert capsys.readouterr().out.strip() == f"store {root}: 3 shard(s) (had 1)"
    assert len(Store.open(root, create=False).shards()) == 3
    assert main(["--path", root, "shards", "--set", "2"]) == EXIT_CONFIG
    assert "has 3 shards and cannot have fewer" in capsys.readouterr().err
    assert main(["--path", root, "shards", "--set", "0"]) == EXIT_CONFIG
    assert "--set needs a shard count from 1 to" in capsys.readouterr().err
    assert main(["--path", root, "shards", "--set", "3"]) == EXIT_OK  # as it is: a no-op
    assert capsys.readouterr().out.strip() == f"store {root}: 3 shard(s)"


def test_tail_reads_every_shard(tmp_path: Path) -> None:
    store = sharded(tmp_path / "s", shards=2)
    store.send([Message("Orders", "first")], "pg")
    store.shard_store(1).send([Message("Orders", "second")], "pg")
    assert [m["body"] for m in tail(store, "Orders")] == ["second", "first"]


def test_check_and_status_write_an_age_the_same_way() -> None:
    """``status`` said ``14 min`` where ``check`` said ``1,371.0 s`` (#49)."""
    from rmq_spark.model.config import format_duration
    from rmq_spark.ops.status import format_status

    ages = (None, 0.25, 4.24, 42, 1371, 3600, 12_600, 259_200, 820_800)
    assert [format_duration(s) for s in ages] == [
        "-", "250 ms", "4.2 s", "42 s", "23 min", "1.0 h", "3.5 h", "72 h", "9.5 d"
    ]  # fmt: skip
    assert "oldest pending: 23 min" in summary(oldest_pending_age_seconds=1371.0).format()
    group = {
        "producer_group": "g",
        "pending_transactions": 1,
        "pending_messages": 1,
        "oldest_pending_age_seconds": 1371.0,
        "in_running_sink_epochs": 0,
        "in_committed_sink_epochs": 0,
        "in_aborted_sink_epochs": 0,
        "committed_last_hour": 0,
        "rolled_back_last_hour": 0,
    }
    status = {
        "store": "s",
        "generated": "now",
        "shards": [{"shard": 0, "intake_objects": 0, "oldest_intake_seconds": None}],
        "topics": [],
        "producer_groups": [group],
        "consumer_groups": [],
        "discards": {"messages": 0, "transactions": 0, "not_redriven": 0},
        "last_check_back": None,
    }
    assert "  g               1             1             23 min" in format_status(status)


def test_status_reads_the_newest_check_back_runs_only(store: Store) -> None:
    """check_runs grows by a row a round and was read whole by every status and page refresh
    (review of #49): the newest files are enough."""
    from dataclasses import asdict

    import pyarrow as pa

    from rmq_spark.model.schema import CHECK_RUNS_SCHEMA
    from rmq_spark.ops.status import store_status
    from rmq_spark.ops.views import newest_runs

    for i in range(30):
        row = asdict(summary(f"run{i:02d}", started=T0 + timedelta(minutes=i)))
        store.append("check_runs", pa.Table.from_pylist([row], CHECK_RUNS_SCHEMA))
    newest = newest_runs([store], 5)
    assert sorted(newest.column("run_id").to_pylist()) == [f"run{i}" for i in range(25, 30)]
    assert (
        store_status(store)["last_check_back"]["started"]
        == (T0 + timedelta(minutes=29)).isoformat()
    )
