"""Group commit's linger: how long a committer waits for the callers about to submit."""

from __future__ import annotations

import threading
import time

from rmq_spark.group_commit import GroupCommitter


def _batches(wave: bool) -> list[list[str]]:
    """Two concurrent items (so that the committer lingers next time), then ``a`` and ``b``
    at once and ``c`` 0.2 s later, with a 2 s linger: the batches the handler got."""
    batches: list[list[str]] = []
    first_in = threading.Event()

    def handler(items: list[str]) -> list[str]:
        batches.append(items)
        first_in.wait(5)  # the first batch holds until both early items are queued
        return items

    committer = GroupCommitter("test", handler, max_batch=16, linger=2.0, wave=wave)
    try:
        early = [committer.submit("x")]
        time.sleep(0.2)
        early.append(committer.submit("y"))
        early.append(committer.submit("z"))
        first_in.set()
        for slot in early:
            slot.result()
        batches.clear()  # [x], then [y, z]: the last batch had two items
        slots = [committer.submit("a"), committer.submit("b")]
        time.sleep(0.2)
        slots.append(committer.submit("c"))
        assert [s.result() for s in slots] == ["a", "b", "c"]
    finally:
        committer.close()
    return batches


def test_a_wave_committer_goes_once_the_last_batch_size_is_back() -> None:
    """In-process callers come back together: once as many items as the last batch had are
    queued, the batch goes (``c``, later, waits for the next)."""
    assert _batches(wave=True) == [["a", "b"], ["c"]]


def test_a_committer_without_waves_lingers_its_whole_linger() -> None:
    """Remote callers (``rmqtx serve``'s clients) arrive spread out: the committer waits its
    whole linger, and ``c`` shares the batch."""
    assert _batches(wave=False) == [["a", "b", "c"]]
