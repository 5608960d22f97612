"""`rmqtx` commands that need no Spark: resume, and argument errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest

from rmq_spark import Message, Store
from rmq_spark.model.schema import DISCARD_SCHEMA, HALF_MESSAGE_SCHEMA
from rmq_spark.ops.cli import EXIT_CONFIG, EXIT_OK, main


def discard(store: Store) -> str:
    (p,) = store.prepare([Message("Orders", b"lost", keys="o-1")], "pg")
    half = store.half_messages([p.transaction_id]).select(HALF_MESSAGE_SCHEMA.names)
    rows = half.append_column("check_count", pa.array([15], pa.int32()))
    rows = rows.append_column(
        "discarded_timestamp",
        pa.array([datetime.now(UTC)], DISCARD_SCHEMA.field("discarded_timestamp").type),
    ).append_column("redriven_transaction_id", pa.nulls(1, pa.string()))
    store.append("discard", rows.cast(DISCARD_SCHEMA))
    return p.transaction_id


def test_resume_redrives_discarded_messages(store: Store, capsys) -> None:
    old = discard(store)
    assert main(["--path", store.root, "resume"]) == EXIT_OK
    assert "re-drove 1 discarded message(s)" in capsys.readouterr().out
    half = store.read("half").to_pylist()
    redriven = [h for h in half if h["transaction_id"] != old]
    assert len(redriven) == 1
    assert dict(redriven[0]["properties"]) == {"REDRIVEN_FROM_TRANSACTION_ID": old}
    assert redriven[0]["body"] == b"lost" and redriven[0]["keys"] == "o-1"
    assert main(["--path", store.root, "resume"]) == EXIT_OK  # nothing left: a no-op
    # It said "re-drove 0 ... the check-back job will check them again" (#49).
    assert capsys.readouterr().out.strip() == "nothing to re-drive: no discarded message waits"


def old_and_new(tmp_path: Path, hours: float, retention: str) -> tuple[Store, Path]:
    """A store with an Orders message sent ``hours`` ago and one now, and a settings file whose
    ``file_reserved_time`` is ``retention``."""
    then = datetime.now(UTC) - timedelta(hours=hours)
    old = Store.open(tmp_path / "store", clock=lambda: then)
    old.send([Message("Orders", b"old")], "pg")
    Store.open(tmp_path / "store").send([Message("Orders", b"new")], "pg")
    conf = tmp_path / "rmq.toml"
    conf.write_text(f'[retention]\nfile_reserved_time = "{retention}"\n')
    return old, conf


def test_maintain_expires_what_retention_no_longer_keeps(tmp_path, capfd) -> None:
    old, conf = old_and_new(tmp_path, 100, "72h")
    assert main(["--conf", str(conf), "--path", old.root, "maintain"]) == EXIT_OK
    out = capfd.readouterr().out
    assert "messages expired" in out and " 1   1 queue(s) moved up" in out


def test_maintain_prints_its_summary_once(tmp_path) -> None:
    """It was printed, and logged again in full at INFO (#49): the log has one line."""
    old, conf = old_and_new(tmp_path, 100, "72h")
    done = subprocess.run(
        [sys.executable, "-m", "rmq_spark.ops.cli", "--conf", str(conf), "--path", old.root,
         "maintain"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("messages expired") == 1
    assert "messages expired" not in done.stderr
    (logged,) = [line for line in done.stderr.splitlines() if "maintenance run" in line]
    assert "1 message(s) expired" in logged
    assert old.read("commitlog").column("body").to_pylist() == [b"new"]


def test_maintain_refuses_a_retention_without_a_unit_and_expires_nothing(tmp_path, capsys):
    """RocketMQ's fileReservedTime is in hours: ``file_reserved_time = 72`` was read as 72
    seconds, and maintain expired every message of the store (#48)."""
    store = Store.open(tmp_path / "store")
    store.send([Message("Orders", b"kept")], "pg")
    conf = tmp_path / "rmq.toml"
    conf.write_text("[retention]\nfile_reserved_time = 72\n")
    assert main(["--conf", str(conf), "--path", store.root, "maintain"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "retention.file_reserved_time = 72 has no unit" in err
    assert "RocketMQ's fileReservedTime is in hours: for the same, write '72h'" in err
    assert store.read("commitlog").column("body").to_pylist() == [b"kept"]


def test_maintain_dry_run_says_what_would_expire_and_asks_before_emptying_a_topic(
    tmp_path, capsys
) -> None:
    """``--dry-run`` tells per topic and queue and deletes nothing; a run that would expire a
    whole topic (or messages younger than a day) is not done without --yes (#48)."""
    long_ago = datetime.now(UTC) - timedelta(hours=100)
    old = Store.open(tmp_path / "store", clock=lambda: long_ago)
    old.send([Message("Orders", b"old")], "pg")
    old.send([Message("Audit", b"only old")], "pg")
    Store.open(tmp_path / "store").send([Message("Orders", b"new")], "pg")
    path = ["--path", old.root]
    assert main([*path, "maintain", "--dry-run"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "would expire 2 message(s) older than 259200 s" in out
    assert re.search(r"Audit +\d+ +1  0\.\.0, none left", out)
    assert re.search(r"Orders +\d+ +1  0\.\.0, (none left|kept from 1)", out)  # its queue
    assert "nothing changed (--dry-run)" in out
    assert main([*path, "maintain"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "every message of topic(s) Audit" in err and "run it again with --yes" in err
    bodies = sorted(old.read("commitlog").column("body").to_pylist())
    assert bodies == [b"new", b"old", b"only old"]
    assert main([*path, "maintain", "--yes"]) == EXIT_OK
    assert old.read("commitlog").column("body").to_pylist() == [b"new"]


def test_maintain_asks_before_expiring_messages_younger_than_a_day(tmp_path, capsys) -> None:
    store, conf = old_and_new(tmp_path, 2, "1h")
    assert main(["--conf", str(conf), "--path", store.root, "maintain"]) == EXIT_CONFIG
    assert "younger than a day (file_reserved_time 3600 s)" in capsys.readouterr().err
    assert store.read("commitlog").num_rows == 2


def test_resume_unknown_transaction_is_a_clear_error(store: Store, capsys) -> None:
    discard(store)
    code = main(["--path", store.root, "resume", "--transaction-id", "nope"])
    assert code == EXIT_CONFIG
    assert "not in the discard table (or already re-driven): nope" in capsys.readouterr().err


def test_resume_on_a_missing_store(tmp_path, capsys) -> None:
    assert main(["--path", str(tmp_path / "none"), "resume"]) == EXIT_CONFIG
    assert "no rmq-spark store" in capsys.readouterr().err


def test_bad_checker_option(store: Store, capsys) -> None:
    assert main(["--path", store.root, "check", "--once", "--checker", "no-equals"]) == EXIT_CONFIG
    assert "is not GROUP=MODULE:FUNCTION" in capsys.readouterr().err


def test_unknown_command() -> None:
    with pytest.raises(SystemExit):
        main(["launch"])


#: Runs the CLI in a fresh process and exits 99 if it started Spark (the suite's own Spark
#: session would hide that in this process).
_CLI_WITHOUT_SPARK = (
    "import sys; from pyspark import SparkContext; from rmq_spark.ops.cli import main; "
    "rc = main(sys.argv[1:]); sys.exit(99 if SparkContext._active_spark_context else rc)"
)


def _check(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _CLI_WITHOUT_SPARK, *args],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["check", "--once"], "no rmq-spark store"),
        (["check", "--interval", "bogus"], "--interval needs a duration"),
        (["check", "--interval", "30"], "--interval = '30' has no unit"),
        (["check", "--interval", "0s"], "--interval 0s is below the minimum of 5 s"),
        (["check", "--interval", "500ms"], "--interval 500ms is below the minimum of 5 s"),
        (["check", "--once", "--checker", "pg=no_such_module:fn"], "checker module 'no_such"),
    ],
)
def test_check_refuses_bad_arguments_before_touching_anything(tmp_path, args, match):
    typo = tmp_path / "storag"
    done = _check(["--path", str(typo), *args])
    assert done.returncode == EXIT_CONFIG, done.stderr  # 99: Spark was started first
    assert match in done.stderr
    assert not typo.exists()  # no store created at a mistyped path


def test_check_interval_minimum_applies_to_the_configured_default(store: Store, tmp_path):
    conf = tmp_path / "rmq.toml"
    conf.write_text('[transaction]\ntransaction_check_interval = "1s"\n')
    done = _check(["--conf", str(conf), "--path", store.root, "check"])
    assert done.returncode == EXIT_CONFIG, done.stderr  # 99: Spark was started first
    assert "transaction.transaction_check_interval 1s is below the minimum of 5 s" in done.stderr


def test_global_options_work_after_the_subcommand_too(store: Store, capsys) -> None:
    # A Kafka or git user types the store after the command: both places mean the same.
    assert main(["resume", "--path", store.root]) == EXIT_OK
    assert main(["status", "--path", store.root, "--json"]) == EXIT_OK
    assert '"topics"' in capsys.readouterr().out
    # Before the subcommand still works, and the later one wins when both are given.
    assert main(["--path", "/nowhere", "status", "--path", store.root]) == EXIT_OK


def test_version_and_subcommand_help_with_examples(capsys) -> None:
    from rmq_spark import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"rmqtx {__version__}"
    for command in ("check", "resume", "maintain", "status", "tail"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        assert "examples:" in text and f"rmqtx {command}" in text.split("examples:")[1], command
        assert "--path" in text and "--conf" in text, command


def test_a_topic_whose_messages_all_expired_stays_in_status(tmp_path, capsys) -> None:
    """It disappeared from ``status`` (#49): its queues and offsets are still the store's."""
    old, conf = old_and_new(tmp_path, 100, "72h")
    old.send([Message("Gone", b"expires")], "pg")
    assert main(["--conf", str(conf), "--path", old.root, "maintain", "--yes"]) == EXIT_OK
    capsys.readouterr()
    assert main(["--path", old.root, "status", "topics", "--json"]) == EXIT_OK
    topics = {t["topic"]: t for t in json.loads(capsys.readouterr().out)["topics"]}
    gone = topics["Gone"]
    assert gone["messages"] == 0 and gone["last_hour"] == 0 and gone["oldest_stored"] is None
    assert [q["earliest"] for q in gone["queues"].values()] == [1]  # offset 0 expired
    assert [q["next"] for q in gone["queues"].values()] == [1]
    assert main(["--path", old.root, "status"]) == EXIT_OK
    assert re.search(r"^  Gone +0 +\d+:1$", capsys.readouterr().out, re.M)


def _commitlog_file(store: Store, rows: list[tuple[str, int, int, datetime]]) -> None:
    """One CommitLog data file of Orders holding ``(body, queue, offset, stored)`` rows, as
    a compaction leaves one (written straight with deltalake)."""
    from deltalake import write_deltalake

    from rmq_spark.model.schema import COMMITLOG_SCHEMA

    table = pa.Table.from_pylist(
        [
            {"topic": "Orders", "queue_id": q, "queue_offset": o, "msg_id": b, "body": b.encode(),
             "producer_group": "pg", "properties": [], "born_timestamp": at,
             "store_timestamp": at}
            for b, q, o, at in rows
        ],
        COMMITLOG_SCHEMA,
    )  # fmt: skip
    write_deltalake(store.table_uri("commitlog"), table, mode="append", partition_by=["topic"])


def test_tail_reads_past_a_compacted_file_whose_newest_is_new(store: Store) -> None:
    """A compacted file with one new message among many old ones ended tail's search: -n 6
    missed the newer messages of the next file (review of #49)."""
    from rmq_spark.ops.tail import tail

    t0 = datetime(2026, 11, 1, tzinfo=UTC)
    at = [t0 + timedelta(minutes=m) for m in range(200)]
    _commitlog_file(
        store, [(f"old{i}", 0, i, at[i]) for i in range(9)] + [("newest", 0, 9, at[100])]
    )
    _commitlog_file(store, [(f"mid{i}", 1, i, at[50 + i]) for i in range(6)])
    bodies = [m["body"] for m in tail(store, "Orders", 6)]
    assert bodies == ["newest", "mid5", "mid4", "mid3", "mid2", "mid1"]


def test_follow_starts_where_the_tail_it_printed_ended(store: Store) -> None:
    """``tail --follow`` printed the tail of one snapshot and followed from a later one: a
    message committed in between was never printed (review of #49)."""
    from rmq_spark.ops.tail import Follower, tail

    store.send([Message("Orders", "first")], "pg")
    commitlog = store.table("commitlog")
    assert [m["body"] for m in tail(store, "Orders", 5, commitlog)] == ["first"]
    Store.open(store.root).send([Message("Orders", "in-the-gap")], "pg")  # another process
    follow = Follower(store, "Orders", commitlog)
    assert [m["body"] for m in follow.new_messages()] == ["in-the-gap"]
    assert follow.new_messages() == []


def test_lag_does_not_count_what_retention_removed_before_the_group_read_it(tmp_path) -> None:
    """A group whose next offset is below the earliest stored had every expired message
    counted as lag, with no word of data loss (review of #49)."""
    from deltalake import write_deltalake

    from rmq_spark.model.config import RetentionSettings
    from rmq_spark.model.schema import CONSUMER_OFFSETS_SCHEMA
    from rmq_spark.ops.views import groups_view

    old, conf = old_and_new(tmp_path, 100, "72h")  # Orders: one message 100 h old, one new
    rows = [
        {"consumer_group": "billing", "topic": "Orders", "queue_id": q, "next_offset": 0,
         "updated_timestamp": datetime.now(UTC)}
        for t, q in old.next_offsets() if t == "Orders"
    ]  # fmt: skip
    write_deltalake(
        old.table_uri("consumer_offsets"),
        pa.Table.from_pylist(rows, CONSUMER_OFFSETS_SCHEMA),
        mode="append",
    )
    assert main(["--conf", str(conf), "--path", old.root, "maintain", "--yes"]) == EXIT_OK
    (billing,) = groups_view(old, RetentionSettings())["groups"]
    # The new message is the lag; the old one expired before billing read it.
    assert (billing["lag"], billing["expired_unread"]) == (1, 1)
