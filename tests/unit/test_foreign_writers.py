"""The store among other Delta writers (issue 29): a user's deltalake or delta-spark commits on
the store's tables, a stalled process, and the log cleanup must never lose or resurrect a
message silently."""

from __future__ import annotations

from rmq_spark.txnlog import checkpoint_guess


def test_the_checkpoint_guess_is_the_multiple_of_the_interval_at_or_before() -> None:
    """Checkpoints are written at versions that are multiples of the interval; the guess was
    one version short of it (19 for 20), so every lookup listed the whole log."""
    assert [checkpoint_guess(v, 10) for v in (9, 10, 15, 19, 20, 21)] == [0, 10, 10, 10, 20, 20]
    assert checkpoint_guess(100, 100) == 100
