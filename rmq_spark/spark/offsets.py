"""Source offsets: ``{topic: {queue_id: offset}}``, as Spark's Kafka source writes them.

An offset is the next ``queue_offset`` to read in a queue; in JSON, -2 means earliest and -1
latest (Kafka's convention). Queue offsets are dense and only grow, and a queue's latest
offset is the version of a Delta application transaction committed atomically with its rows,
so reading up to it never skips or duplicates a message, whatever writers do meanwhile.

A store of several shards has one CommitLog, its root's, which every shard publishes into
(queue ids are global: shard ``k``'s start at ``k * SHARD_QUEUE_STRIDE``), so its offsets are
read as a store of one shard's are, shards made later included (:func:`stored_offsets`).

Here too: what a subscription may name (the store's queues and topics), and how far a
micro-batch goes (:func:`admit`: ``maxMessagesPerTrigger``, ``maxBytesPerTrigger``).
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import numpy as np
import pyarrow as pa

from rmq_spark.model.errors import DataLossError, InvalidOptionError
from rmq_spark.model.messages import SHARD_QUEUE_STRIDE, shard_of_queue
from rmq_spark.store.facade import Store

log = logging.getLogger(__name__)

#: Per-topic, per-queue offsets. Queue ids are strings in JSON, ints here.
Offsets = dict[str, dict[int, int]]
#: A queue: (topic, queue id).
Queue = tuple[str, int]

EARLIEST, LATEST = -2, -1
_DIGITS = re.compile(r"[0-9]+", re.ASCII)
OFFSETS_EXAMPLE = '{"OrderEvents": {"0": 42, "1": -2}}'
#: The reader option that turns a missing topic from a warning into an error.
FAIL_ON_MISSING_TOPIC = "failOnMissingTopic"
#: Topics a missing-topic message names at most.
_TOPICS_NAMED = 20


def stored_offsets(store: Store) -> tuple[dict[Queue, int], dict[Queue, int]]:
    """The next offset of every queue that holds messages, and the earliest offset still
    stored of every queue retention has trimmed (absent: 0), in the store's CommitLog (every
    shard's queues), from one read of its latest snapshot (:meth:`Store.next_offsets`,
    :meth:`Store.earliest_stored`)."""
    commitlog = store.table("commitlog")
    return store.next_offsets(commitlog), store.earliest_stored(commitlog)


def latest_offsets(store: Store, topics: Sequence[str]) -> Offsets:
    """The next offset of every queue of ``topics`` (queues that have messages), in every
    shard of ``store`` (:func:`stored_offsets`)."""
    return _of_topics(topics, stored_offsets(store)[0])


def earliest_offsets(store: Store, topics: Sequence[str]) -> Offsets:
    """The earliest offset still stored in every queue of ``topics`` that has had messages (0
    unless retention removed some: :mod:`rmq_spark.store.retention`), in every shard of
    ``store`` (:func:`stored_offsets`)."""
    ends, trimmed = stored_offsets(store)
    return {
        topic: {q: trimmed.get((topic, q), 0) for q in queues}
        for topic, queues in _of_topics(topics, ends).items()
    }


def _of_topics(topics: Sequence[str], offsets: Mapping[Queue, int]) -> Offsets:
    result: Offsets = {topic: {} for topic in topics}
    for (topic, queue_id), offset in sorted(offsets.items()):
        if topic in result:
            result[topic][queue_id] = offset
    return result


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


def check_queues(
    spec: str | Offsets, option: str, queue_nums: int, latest: Offsets, shards: int = 1
) -> None:
    """Refuse a JSON spec naming a queue the store does not have.

    A store's queues are ``0 .. queue_nums - 1`` (``store.queue_nums``) in each of its
    ``shards``, shard ``k``'s numbered from ``k * SHARD_QUEUE_STRIDE``, plus any queue that
    already holds messages (a producer configured with more queues).
    """
    if not isinstance(spec, dict):
        return
    for topic, queues in sorted(spec.items()):
        for queue_id in sorted(queues):
            known = shard_of_queue(queue_id) < shards and queue_id % SHARD_QUEUE_STRIDE < queue_nums
            if not known and queue_id not in latest.get(topic, {}):
                has = f"queues 0 to {queue_nums - 1}"
                if shards > 1:
                    has = (
                        f"{shards} shards, shard k with queues k * {SHARD_QUEUE_STRIDE} + 0 to "
                        f"{queue_nums - 1}"
                    )
                raise InvalidOptionError(
                    f"option {option!r} names queue {queue_id} of topic {topic!r}, but the store "
                    f"has {has} (store.queue_nums = {queue_nums}) and that queue holds no "
                    f"messages. Name only the store's queues, or raise store.queue_nums in the "
                    f"settings if producers use more queues."
                )


def check_topics(topics: Sequence[str], stored: Sequence[str], root: str, fail: bool) -> None:
    """Warn (or with ``fail`` raise :class:`InvalidOptionError`) when one of ``topics`` has no
    messages among the store's topics ``stored``, naming them and a close match (a case typo).

    A topic exists once a message is published to it (the CommitLog's queues, read with the
    latest offsets); reading one that does not would return no rows, silently, for ever.
    """
    missing = [t for t in topics if t not in stored]
    if not missing:
        return
    by_lower: dict[str, str] = {}
    for topic in stored:
        by_lower.setdefault(topic.lower(), topic)
    hints = [
        f"{t!r}: did you mean {by_lower[close[0]]!r}?"
        for t in missing
        if (close := difflib.get_close_matches(t.lower(), by_lower, n=1, cutoff=0.8))
    ]
    named = ", ".join(stored[:_TOPICS_NAMED])
    if len(stored) > _TOPICS_NAMED:
        named += f" and {len(stored) - _TOPICS_NAMED} more"
    text = (
        f"topic(s) {', '.join(repr(t) for t in missing)} have no messages in the store at "
        f"{root!r}"
        + (f" ({'; '.join(hints)})" if hints else "")
        + (f"; its topics: {named}." if stored else "; it has no messages yet.")
    )
    if fail:
        raise InvalidOptionError(
            f"{text} Name the store's topics in option 'topic' (names are case-sensitive), or "
            f"set option {FAIL_ON_MISSING_TOPIC} to false to read them anyway (no rows until "
            "messages are published there)."
        )
    log.warning(
        "%s The read returns no rows from them until messages are published there (option "
        "%s true makes this an error).",
        text,
        FAIL_ON_MISSING_TOPIC,
    )


def to_json(offsets: Offsets) -> dict[str, dict[str, int]]:
    """Offsets as Spark wants them: plain dicts, string keys, sorted for determinism."""
    return {
        topic: {str(q): offsets[topic][q] for q in sorted(offsets[topic])}
        for topic in sorted(offsets)
    }


def admit(
    begin: Offsets,
    latest: Offsets,
    max_messages: int | None = None,
    max_bytes: int | None = None,
    files: Callable[[], pa.Table] | None = None,
) -> Offsets:
    """The end of a micro-batch starting at ``begin``: as far towards ``latest`` as the caps allow.

    Parameters
    ----------
    begin : Offsets
        Where the batch starts.
    latest : Offsets
        The latest offsets it may reach (every queue with messages).
    max_messages : int, optional
        Most messages in the batch (``maxMessagesPerTrigger``).
    max_bytes : int, optional
        Soft cap on the batch's bytes (``maxBytesPerTrigger``), estimated by
        :func:`stored_bytes` from ``files``.
    files : callable, optional
        Returns the CommitLog's add actions (:meth:`Store.data_files`); called only with
        ``max_bytes`` and messages to admit.

    Returns
    -------
    Offsets
        ``begin`` moved forward by each queue's share (:func:`share`). Whichever cap is hit
        first ends the batch, and a batch with messages available takes at least one, so a
        stream always progresses.
    """
    available = {
        (t, q): max(0, end - begin.get(t, {}).get(q, 0))
        for t, queues in latest.items()
        for q, end in queues.items()
    }
    cost = None
    if max_bytes is not None and files is not None and any(available.values()):
        starts = {k: begin.get(k[0], {}).get(k[1], 0) for k, n in available.items() if n}
        cost = stored_bytes(files(), starts, {k: starts[k] + available[k] for k in starts})
    grant = share(available, max_messages, max_bytes if cost is not None else None, cost)
    end: Offsets = {t: dict(qs) for t, qs in begin.items()}
    for (t, q), n in grant.items():
        end.setdefault(t, {})[q] = begin.get(t, {}).get(q, 0) + n
    return end


def share(
    available: Mapping[Queue, int],
    max_messages: int | None,
    max_bytes: int | None = None,
    cost: Mapping[Queue, Callable[[float], float]] | None = None,
) -> dict[Queue, int]:
    """Split a micro-batch's caps fairly over queues (water-filling), in messages and bytes.

    Every queue gets the same number of messages, up to what it has, as far as both caps allow;
    what is left goes one message at a time to the queues in sorted order, each as long as its
    next message fits. ``cost[queue](n)`` is the bytes of the queue's first ``n`` available
    messages (needed with ``max_bytes``). With messages available and neither cap reachable by
    one message, the first queue still gets one: the byte cap is soft, progress is sure.
    """
    if max_messages is None and max_bytes is None:
        return dict(available)
    grant = dict.fromkeys(available, 0)
    rows_left = math.inf if max_messages is None else max_messages
    bytes_left = math.inf if max_bytes is None else float(max_bytes)
    size = cost if max_bytes is not None and cost is not None else {}

    def more(key: Queue, n: int) -> float:
        """Bytes of raising ``key``'s grant to ``n``."""
        measure = size.get(key)
        return 0.0 if measure is None else measure(n) - measure(grant[key])

    def raise_to(level: int, keys: list[Queue]) -> tuple[dict[Queue, int], int, float]:
        raised = {k: min(available[k], max(grant[k], level)) for k in keys}
        rows = sum(n - grant[k] for k, n in raised.items())
        return raised, rows, sum(more(k, n) for k, n in raised.items())

    open_queues = sorted(k for k, n in available.items() if n > 0)
    while open_queues:
        low, high = 0, max(available[k] for k in open_queues)
        while low < high:  # the highest level both caps allow
            mid = (low + high + 1) // 2
            _, rows, size_of = raise_to(mid, open_queues)
            if rows <= rows_left and size_of <= bytes_left:
                low = mid
            else:
                high = mid - 1
        raised, rows, size_of = raise_to(low, open_queues)
        grant.update(raised)
        rows_left -= rows
        bytes_left -= size_of
        still_open = []
        for key in open_queues:
            if grant[key] < available[key] and rows_left >= 1:
                extra = more(key, grant[key] + 1)
                if extra <= bytes_left:
                    grant[key] += 1
                    rows_left -= 1
                    bytes_left -= extra
                    still_open.append(key)
        open_queues = [k for k in still_open if grant[k] < available[k]]
    waiting = sorted(k for k, n in available.items() if n > 0)
    if waiting and not any(grant.values()):
        grant[waiting[0]] = 1
    return grant


def stored_bytes(
    files: pa.Table, begin: Mapping[Queue, int], end: Mapping[Queue, int]
) -> dict[Queue, Callable[[float], float]]:
    """Per queue, the estimated stored bytes of its first ``n`` messages from ``begin``, as a
    function of ``n``, from the CommitLog's add actions alone (bodies are not read).

    A message at an offset costs the bytes per row (size over row count) of the data file whose
    statistics admit that queue and offset: the compressed bytes of all its columns, bodies
    the bulk of them. Where several files admit an offset (a file holding several queues admits
    their offset ranges together), their mean; offsets no file admits (removed by retention)
    cost nothing.
    """
    topics = np.array(files.column("partition.topic").to_pylist(), dtype=object)
    q_low, q_high = _stat(files, "min.queue_id", -np.inf), _stat(files, "max.queue_id", np.inf)
    o_low = _stat(files, "min.queue_offset", -np.inf)
    o_high = _stat(files, "max.queue_offset", np.inf)
    rows = np.maximum(_stat(files, "num_records", 1.0), 1.0)
    rate = _stat(files, "size_bytes", 0.0) / rows
    costs: dict[Queue, Callable[[float], float]] = {}
    for (topic, queue_id), first in begin.items():
        stop = end[(topic, queue_id)]
        admits = (
            (topics == topic)
            & (q_low <= queue_id)
            & (queue_id <= q_high)
            & (o_low < stop)
            & (o_high >= first)
        )
        breaks = np.array([first, stop], dtype=float)
        spent = np.zeros(2)
        if admits.any():
            lows = np.clip(o_low[admits], first, stop)
            edges = np.concatenate([lows, np.clip(o_high[admits] + 1, first, stop)])
            order = np.argsort(edges, kind="stable")
            ones = np.ones(len(lows))
            rates = np.concatenate([rate[admits], -rate[admits]])[order].cumsum()
            counts = np.concatenate([ones, -ones])[order].cumsum()
            breaks = np.unique(np.concatenate([breaks, edges]))
            at = np.searchsorted(edges[order], breaks, "right") - 1
            covering = np.where(at >= 0, counts[np.maximum(at, 0)], 0.0)
            total = np.where(at >= 0, rates[np.maximum(at, 0)], 0.0)
            each = np.divide(total, covering, out=np.zeros(len(breaks)), where=covering > 0.5)
            spent = np.concatenate([[0.0], np.cumsum(each[:-1] * np.diff(breaks))])
        costs[(topic, queue_id)] = partial(_interpolate, breaks - first, spent)
    return costs


def _interpolate(xs: np.ndarray, ys: np.ndarray, x: float) -> float:
    """The piecewise linear function through (``xs``, ``ys``) at ``x``."""
    return float(np.interp(x, xs, ys))


def _stat(files: pa.Table, column: str, missing: float) -> np.ndarray:
    """A column of the add actions as floats, ``missing`` where it is null."""
    values = files.column(column).to_pylist()
    return np.array([missing if v is None else v for v in values], dtype=float)
