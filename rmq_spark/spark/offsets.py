"""Source offsets: ``{topic: {queue_id: offset}}``, as Spark's Kafka source writes them.

An offset is the next ``queue_offset`` to read in a queue; in JSON, -2 means earliest and -1
latest (Kafka's convention). Queue offsets are dense and only grow, and a queue's latest
offset is the version of a Delta application transaction committed atomically with its rows,
so reading up to it never skips or duplicates a message, whatever writers do meanwhile.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence

from deltalake import DeltaTable

from rmq_spark.model.errors import DataLossError, InvalidOptionError
from rmq_spark.store.facade import Store

log = logging.getLogger(__name__)

#: Per-topic, per-queue offsets. Queue ids are strings in JSON, ints here.
Offsets = dict[str, dict[int, int]]

EARLIEST, LATEST = -2, -1
_DIGITS = re.compile(r"[0-9]+", re.ASCII)
OFFSETS_EXAMPLE = '{"OrderEvents": {"0": 42, "1": -2}}'


def latest_offsets(
    store: Store, topics: Sequence[str], commitlog: DeltaTable | None = None
) -> Offsets:
    """The next offset of every queue of ``topics`` (queues that have messages), from one read
    of a ``commitlog`` snapshot (default: the latest; :meth:`Store.next_offsets`)."""
    result: Offsets = {topic: {} for topic in topics}
    for (topic, queue_id), offset in sorted(store.next_offsets(commitlog).items()):
        if topic in result:
            result[topic][queue_id] = offset
    return result


def earliest_offsets(store: Store, topics: Sequence[str]) -> Offsets:
    """The earliest offset still stored in every queue of ``topics`` that has had messages (0
    unless retention removed some: :mod:`rmq_spark.store.retention`), from one read of the latest
    ``commitlog`` snapshot."""
    commitlog = store.table("commitlog")
    trimmed = store.earliest_stored(commitlog)
    return {
        topic: {q: trimmed.get((topic, q), 0) for q in queues}
        for topic, queues in latest_offsets(store, topics, commitlog).items()
    }


def skip_lost(start: Offsets, earliest: Offsets, *, fail: bool) -> Offsets:
    """``start`` with every queue that starts below its earliest offset moved up to it.

    Parameters
    ----------
    start : Offsets
        Where a read starts.
    earliest : Offsets
        The earliest offset still stored per queue (:func:`earliest_offsets`).
    fail : bool
        ``failOnDataLoss``: raise instead of moving up (and log a warning when moving).

    Raises
    ------
    DataLossError
        With ``fail``, naming every queue's lost range.
    """
    lost = [
        (topic, queue_id, offset, earliest[topic][queue_id])
        for topic, queues in sorted(start.items())
        for queue_id, offset in sorted(queues.items())
        if offset < earliest.get(topic, {}).get(queue_id, 0)
    ]
    if not lost:
        return start
    ranges = describe_ranges(lost)
    if fail:
        raise DataLossError(
            f"messages were removed by retention before this read reached them: {ranges}. "
            "They cannot be read any more. Set option failOnDataLoss to false to go on from the "
            "earliest offsets (with a warning), or read from startingOffsets 'earliest'."
        )
    log.warning("skipping messages removed by retention (failOnDataLoss is false): %s", ranges)
    moved = {topic: dict(queues) for topic, queues in start.items()}
    for topic, queue_id, _, first in lost:
        moved[topic][queue_id] = first
    return moved


def describe_ranges(ranges: Sequence[tuple[str, int, int, int]]) -> str:
    """``(topic, queue id, first, end)`` offset ranges as an error names them (ten at most)."""
    named = ", ".join(f"{t} queue {q} offsets [{s}, {e})" for t, q, s, e in ranges[:10])
    return named + (f" and {len(ranges) - 10} more range(s)" if len(ranges) > 10 else "")


def parse_offsets(text: str, option: str, topics: Sequence[str]) -> str | Offsets:
    """Parse ``earliest``, ``latest`` or an offsets JSON naming only subscribed topics."""
    word = text.strip().lower()
    if word in ("earliest", "latest"):
        return word
    try:
        raw = json.loads(text)
        if not isinstance(raw, Mapping):
            raise ValueError("not a JSON object")
        parsed: Offsets = {
            str(topic): {_queue_id(q): _offset(o) for q, o in dict(queues).items()}
            for topic, queues in raw.items()
        }
    except (ValueError, TypeError, AttributeError) as exc:
        raise InvalidOptionError(
            f"option {option!r} needs 'earliest', 'latest' or a JSON object of per-topic, "
            f"per-queue offsets. Expected e.g. {OFFSETS_EXAMPLE}, got {text!r}."
        ) from exc
    unknown = sorted(set(parsed) - set(topics))
    if unknown:
        raise InvalidOptionError(
            f"option {option!r} names topic(s) {', '.join(unknown)} that are not in option "
            f"'topic' ({', '.join(topics)})."
        )
    for topic, queues in parsed.items():
        for queue_id, offset in queues.items():
            if queue_id < 0 or offset < LATEST - 1:
                raise InvalidOptionError(
                    f"option {option!r}: queue {queue_id} of topic {topic!r} has offset {offset}; "
                    "offsets are >= 0, or -2 (earliest) / -1 (latest)."
                )
    return parsed


def _queue_id(key: str) -> int:
    """A queue id as JSON writes it: a key of ASCII digits (``int()`` takes ``" 1"`` and other
    scripts' digits)."""
    if not _DIGITS.fullmatch(key):
        raise ValueError(f"queue id {key!r} is not a number")
    return int(key)


def _offset(value: object) -> int:
    """An offset as JSON writes it: an integer a Spark long holds (``int()`` truncated 1.5
    and took strings)."""
    if isinstance(value, bool) or not isinstance(value, int) or not -(2**63) <= value < 2**63:
        raise ValueError(f"offset {value!r} is not a 64-bit integer")
    return value


def resolve(
    spec: str | Offsets, latest: Offsets, *, earliest: Offsets | None = None, cap: bool = True
) -> Offsets:
    """Concrete offsets for every queue of ``latest``: ``spec`` where it says, else its rule.

    Queues a JSON spec does not name start at the earliest offset (``earliest``, default 0),
    as in the Kafka source.
    With ``cap`` (batch bounds), offsets are capped at ``latest`` and only its queues count.
    Without it (a stream's starting offsets), a JSON offset is kept as given, and queues the
    spec names that have no messages yet are included: reading them starts there once they
    fill up.
    """
    resolved: Offsets = {}
    for topic, queues in latest.items():
        named = spec.get(topic, {}) if isinstance(spec, dict) else {}
        resolved[topic] = {}
        for queue_id in sorted(set(queues) | (set() if cap else set(named))):
            end = queues.get(queue_id, 0)
            wanted = named.get(queue_id, LATEST if spec == "latest" else EARLIEST)
            first = (earliest or {}).get(topic, {}).get(queue_id, 0)
            offset = end if wanted == LATEST else first if wanted == EARLIEST else wanted
            resolved[topic][queue_id] = min(offset, end) if cap else offset
    return resolved


def check_queues(spec: str | Offsets, option: str, queue_nums: int, latest: Offsets) -> None:
    """Refuse a JSON spec naming a queue the store does not have.

    A store's queues are ``0 .. queue_nums - 1`` (``store.queue_nums``), plus any queue that
    already holds messages (a producer configured with more queues).
    """
    if not isinstance(spec, dict):
        return
    for topic, queues in sorted(spec.items()):
        for queue_id in sorted(queues):
            if queue_id >= queue_nums and queue_id not in latest.get(topic, {}):
                raise InvalidOptionError(
                    f"option {option!r} names queue {queue_id} of topic {topic!r}, but the store "
                    f"has queues 0 to {queue_nums - 1} (store.queue_nums = {queue_nums}) and "
                    f"that queue holds no messages. Name only the store's queues, or raise "
                    f"store.queue_nums in the settings if producers use more queues."
                )


def to_json(offsets: Offsets) -> dict[str, dict[str, int]]:
    """Offsets as Spark wants them: plain dicts, string keys, sorted for determinism."""
    return {
        topic: {str(q): offsets[topic][q] for q in sorted(offsets[topic])}
        for topic in sorted(offsets)
    }
