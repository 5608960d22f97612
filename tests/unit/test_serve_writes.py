"""What ``rmqtx serve`` writes (rmq_spark.serve.writes): a batch of sends of several topics (each
its own producer group) is prepared group by group; one group's failure is that group's alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.full_disk import run_on_a_full_disk

pytest.importorskip("rocketmq", reason="the serve extra (rocketmq-python-client) is not installed")


def test_a_group_whose_write_fails_fails_its_sends_alone(tmp_path: Path) -> None:
    """Two topics' sends in one batch: the first group's half message is stored, the second's
    write is refused by the disk (the process's file size limit, as a full disk would). The
    first send must be answered as stored: answered as failed, its client would send it again,
    and the first copy, pending, could be committed by check-back and published twice."""
    root = tmp_path / "store"
    done = run_on_a_full_disk(
        root,
        65536,
        """
        from rmq_spark.serve.writes import ServerWrites
        results = ServerWrites(store, 64)._prepare_batch(
            [(Message("Small", b"x"), "Small"), (Message("Large", b"y" * 262144), "Large")]
        )
        for r in results:
            print(type(r).__name__, getattr(r, "transaction_id", ""), flush=True)
        """,
    )
    assert done.returncode == 0, done.stderr
    (stored, failed) = [line.split() for line in done.stdout.splitlines()]
    assert stored[0] == "PreparedMessage" and failed == ["OSError"], done.stdout
    from rmq_spark import Store

    halves = Store.open(root).half_messages([stored[1]], staged=True)
    assert halves.column("topic").to_pylist() == ["Small"]
