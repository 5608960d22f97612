"""Configuration: defaults in code, overridden by ``conf/rmq-spark.toml`` (or ``$RMQ_SPARK_CONF``).

Names follow RocketMQ's broker settings in snake_case (``transactionTimeOut`` becomes
``transaction_timeout``) so a RocketMQ operator recognises every knob.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import stat
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from rmq_spark.model.errors import InvalidOptionError
from rmq_spark.model.messages import DEFAULT_MAX_BODY_BYTES, MAX_SHARDS, SHARD_QUEUE_STRIDE

log = logging.getLogger(__name__)

CONF_ENV = "RMQ_SPARK_CONF"
#: Settings files this process has named at INFO (later loads name them at DEBUG).
_announced: set[Path] = set()
DEFAULT_CONF_FILE = Path("conf") / "rmq-spark.toml"

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
#: The levels ``[logging] level`` takes (Python's).
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: RocketMQ's settings whose bare numbers mean something else than seconds, by our name:
#: (RocketMQ's name, its unit, that unit here).
_ROCKETMQ_UNITS = {
    "file_reserved_time": ("fileReservedTime", "hours", "h"),
    "transaction_timeout": ("transactionTimeOut", "milliseconds", "ms"),
    "transaction_check_interval": ("transactionCheckInterval", "milliseconds", "ms"),
}


def parse_duration(value: object, name: str) -> float:
    """Parse a duration with its unit (``"500ms"``, ``"6s"``, ``"30m"``, ``"72h"``, ``"7d"``)
    into seconds. A bare number other than 0 is refused: its unit would be a guess (RocketMQ's
    ``fileReservedTime`` is in hours, its ``transactionTimeOut`` in milliseconds), and a
    retention read in the wrong unit expires every message."""
    if isinstance(value, bool):
        raise InvalidOptionError(f"{name} needs a duration such as '6s' but got {value!r}.")
    match = _DURATION.match(str(value)) if isinstance(value, str | int | float) else None
    if not match:
        raise InvalidOptionError(
            f"{name} needs a duration such as '500ms', '6s', '30m' or '72h' but got {value!r}."
        )
    number, unit = float(match.group(1)), match.group(2)
    if unit is None and number != 0:
        raise InvalidOptionError(_bare_number(value, name, number))
    return number * _UNIT_SECONDS[unit or "s"]


def format_duration(seconds: float | None) -> str:
    """A duration as a person reads it, the one way every command writes ages and times:
    ``850 ms``, ``42 s``, ``14 min``, ``3.5 h``, ``72 h``, ``9.5 d`` (``-`` for none)."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    hours = seconds / 3600
    if hours < 10:
        return f"{hours:.1f} h"
    return f"{hours:.0f} h" if hours < 100 else f"{seconds / 86400:.1f} d"


def _bare_number(value: object, name: str, number: float) -> str:
    """Why a bare number is refused as ``name``, and what the user likely meant."""
    known = _ROCKETMQ_UNITS.get(name.rsplit(".", 1)[-1])
    if known is None:
        return (
            f"{name} = {value!r} has no unit; write it with one (ms, s, m, h or d), "
            f"e.g. '{number:g}s'."
        )
    rocketmq, units, unit = known
    return (
        f"{name} = {value!r} has no unit. RocketMQ's {rocketmq} is in {units}: for the same, "
        f"write '{number:g}{unit}' (units: ms, s, m, h, d)."
    )


def parse_positive_duration(value: object, name: str) -> float:
    """:func:`parse_duration`, refusing zero."""
    seconds = parse_duration(value, name)
    if seconds == 0:
        raise InvalidOptionError(f"{name} needs a duration above zero such as '1s' but got 0.")
    return seconds


def parse_linger(value: object, name: str) -> float:
    """:func:`parse_duration`, at most 10 s (the publisher waits that long for more COMMITs
    before it publishes everyone's)."""
    seconds = parse_duration(value, name)
    if seconds > 10:
        raise InvalidOptionError(
            f"{name} is how long the publisher waits for more COMMITs; it needs a duration up "
            f"to '10s' (such as '200ms') but got {value!r}."
        )
    return seconds


def parse_bool(value: object, name: str) -> bool:
    """A TOML boolean (``true`` or ``false``)."""
    if not isinstance(value, bool):
        raise InvalidOptionError(f"{name} needs true or false but got {value!r}.")
    return value


def parse_uris(value: object, name: str) -> tuple[str, ...]:
    """Parse a list of table URIs (or URI prefixes)."""
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v for v in value):
        raise InvalidOptionError(
            f'{name} needs a list of table URIs such as ["s3://lake/orders"] but got {value!r}.'
        )
    return tuple(value)


def parse_int(value: object, name: str, minimum: int, maximum: int | None = None) -> int:
    """Parse an integer option that must be at least ``minimum`` (and at most ``maximum``)."""
    try:
        number = int(str(value).strip()) if not isinstance(value, bool) else None
    except ValueError:
        number = None
    if number is None or number < minimum or (maximum is not None and number > maximum):
        bounds = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise InvalidOptionError(f"{name} needs to be an integer {bounds} but got {value!r}.")
    return number


#: Reader and writer options named ``storage.<KEY>`` are storage options (for example
#: ``storage.AWS_ENDPOINT_URL``), applied over ``[store] storage_options``.
STORAGE_OPTION_PREFIX = "storage."


def split_storage_options(given: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Split reader or writer options into the others and the ``storage.`` ones (prefix
    removed, upper-cased as deltalake spells them)."""
    others, storage = {}, {}
    for key, value in given.items():
        if key.lower().startswith(STORAGE_OPTION_PREFIX):
            storage[key[len(STORAGE_OPTION_PREFIX) :].upper()] = str(value)
        else:
            others[key] = value
    return others, storage


#: Options of Spark's Kafka connector, as Kafka spells them: the rmq-spark option to use
#: instead, or what to do when there is none.
KAFKA_OPTIONS: dict[str, tuple[str | None, str]] = {
    "subscribe": ("topic", ""),
    "assign": ("topic", ""),
    "subscribePattern": (
        None,
        "a pattern of topics is not supported; name the topics in 'topic', separated by commas",
    ),
    "maxOffsetsPerTrigger": ("maxMessagesPerTrigger", ""),
    "kafka.bootstrap.servers": ("path", ""),
    "kafka.group.id": ("consumerGroup", ""),
    "groupIdPrefix": ("consumerGroup", ""),
    "startingOffsetsByTimestamp": ("startingTimestamp", ""),
    "endingOffsetsByTimestamp": ("endingTimestamp", ""),
    "includeHeaders": (
        None,
        "not needed: every row has the message's properties (Kafka's headers) in its "
        "'properties' column",
    ),
    "minPartitions": (
        None,
        "a read has one Spark partition per queue; for more, give topics more queues "
        "([store] queue_nums)",
    ),
    "minOffsetsPerTrigger": (
        None,
        "not supported: a trigger reads what is committed, up to maxMessagesPerTrigger",
    ),
    "maxTriggerDelay": (None, "not supported (it goes with minOffsetsPerTrigger)"),
}
_KAFKA_BY_LOWER = {k.lower(): k for k in KAFKA_OPTIONS}


def reject_unknown(given: Iterable[str], allowed: Sequence[str], usage: str) -> None:
    """Raise if a (lower-cased) option name is not one of ``allowed``, listing the valid ones,
    and saying which one is meant for a Kafka connector option (named as Kafka spells it) or
    a near miss."""
    unknown = sorted(set(given) - {o.lower() for o in allowed})
    if not unknown:
        return
    by_lower = {o.lower(): o for o in allowed}
    hints = []
    for name in unknown:
        kafka = _KAFKA_BY_LOWER.get(name)
        meant, advice = KAFKA_OPTIONS[kafka] if kafka else (None, "")
        if meant in allowed:
            hints.append(f"{kafka!r} is Spark's Kafka option; use {meant!r}")
        elif advice:
            hints.append(f"{kafka!r} is Spark's Kafka option: {advice}")
        elif close := difflib.get_close_matches(name, by_lower, n=1, cutoff=0.8):
            hints.append(f"{name!r}: did you mean {by_lower[close[0]]!r}?")
    shown = [_KAFKA_BY_LOWER.get(u, u) for u in unknown]
    raise InvalidOptionError(
        f"unknown option(s) {', '.join(repr(u) for u in shown)} for {usage}"
        + (f" ({'; '.join(hints)})" if hints else "")
        + f"; valid options: {', '.join(allowed)}."
    )


@dataclass(frozen=True)
class StoreSettings:
    """Where the store lives and how messages are laid out."""

    #: Store root: a local path, ``file://`` URI, or object store URI (``s3://...``).
    path: str = "storage"
    #: Queues per topic (RocketMQ ``defaultTopicQueueNums``), per shard; at most 1000.
    queue_nums: int = 4
    #: Shards of the store (``rmq_spark.store.shards``): complete stores under the root, so
    #: that producer processes on many hosts each append to logs of their own. A process
    #: opening the store with more shards than it has creates the missing ones; a store never
    #: loses a shard. One per producer process (host) that sends at the same time is a good
    #: count on an object store.
    shards: int = 1
    #: Body size limit (RocketMQ ``maxMessageSize``).
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    #: Object-store settings in deltalake's vocabulary (``AWS_ENDPOINT_URL``, ``AWS_REGION``,
    #: credentials, ...); rmq_spark.delta.storage translates them for fsspec and Spark's S3A.
    storage_options: dict[str, str] = field(default_factory=dict)
    #: Business Delta tables off the store's filesystem (URIs or prefixes) that check-back may
    #: open with ``storage_options`` to learn whether a ``publish_with_delta_write`` landed.
    delta_tables: tuple[str, ...] = ()
    #: Most messages in one publish commit: a backlog is published in commits of this size.
    publish_max_messages: int = 10_000
    #: Most body bytes in one publish commit (a single decision larger than either limit is
    #: published in one commit of its own).
    publish_max_bytes: int = 64 * 1024 * 1024
    #: How often a producer process holding the publisher lease publishes every producer's
    #: COMMITs (and at once after one of its own): about how long a COMMIT takes to be visible.
    publish_interval: float = 0.1
    #: How long the holder of the publisher lease waits after one of its process's COMMITs
    #: before it publishes, so that the COMMITs of that moment go out in one commit (Kafka's
    #: ``linger.ms``), at most 10 s. Unset: ``rmq_spark.store.publish_loop.LOCAL_LINGER`` (50
    #: ms) on a local filesystem, ``OBJECT_STORE_LINGER`` (200 ms) on an object store, where every
    #: publish commit is about six billed requests.
    publish_linger: float | None = None
    #: The publisher lease: held by one producer process at a time, renewed every third of it,
    #: taken over by another within half of it after it ends (its holder stopped renewing it).
    publish_lease: float = 10.0
    #: Half messages of a producer or ``rmqtx serve`` made durable in one put of an intake
    #: object each send (batch), landed in ``half`` in the background
    #: (``rmq_spark.store.intake``): one round trip instead of a Delta commit's three on S3,
    #: and on local disk one file written instead of a data file and a log entry (a sender's
    #: send p50 1.5 against 4.2 ms, the same throughput at 64 senders). Off: each send
    #: (batch) is a ``half`` commit.
    intake: bool = True
    #: How long the Delta log entries of the internal tables (all but the CommitLog) that a
    #: lagging check-back job still needs are kept (15 min); entries nobody needs go after ten
    #: seconds. On a local filesystem every commit lists the whole log, so its cost would grow
    #: with the store's age.
    log_retention: float = 900.0

    def with_storage_options(self, extra: Mapping[str, str]) -> StoreSettings:
        """These settings with ``extra`` storage options over the configured ones."""
        if not extra:
            return self
        return replace(self, storage_options={**self.storage_options, **extra})


@dataclass(frozen=True)
class TransactionSettings:
    """Check-back settings, named after RocketMQ's broker configuration."""

    #: ``transactionTimeOut``: a half message younger than this is not checked.
    transaction_timeout: float = 6.0
    #: ``transactionCheckInterval``: pause between check-back rounds (RocketMQ 5: 30 s).
    transaction_check_interval: float = 30.0
    #: ``transactionCheckMax``: unanswered checks before a message is rolled back and discarded.
    transaction_check_max: int = 15
    #: Maximum check age: older half messages are skipped and reported (file retention, 72 h).
    max_check_age: float = 72 * 3600.0


@dataclass(frozen=True)
class RetentionSettings:
    """What maintenance (``rmqtx maintain``, and the check-back loop) removes, and when."""

    #: ``fileReservedTime``: committed messages older than this leave the CommitLog (72 h).
    file_reserved_time: float = 72 * 3600.0
    #: Half and op rows of transactions decided (and, for COMMIT, published) longer ago than
    #: this are removed. Undecided ones never are, nor discards and re-driven transactions.
    transaction_reserved_time: float = 72 * 3600.0
    #: Files the CommitLog no longer uses are deleted from storage (VACUUM) this long after
    #: their removal (a reader may still be reading them). The internal tables keep theirs for
    #: their ``deletedFileRetentionDuration`` (2 h). See :mod:`rmq_spark.delta.vacuum`.
    deleted_file_retention: float = 7 * 86400.0
    #: How often ``rmqtx check`` runs maintenance between rounds; 0 turns that off. Keep it
    #: under the tables' 2 h of tombstones, or some removed files stay in storage.
    maintenance_interval: float = 3600.0


@dataclass(frozen=True)
class Settings:
    """All rmq-spark settings."""

    store: StoreSettings = field(default_factory=StoreSettings)
    transaction: TransactionSettings = field(default_factory=TransactionSettings)
    retention: RetentionSettings = field(default_factory=RetentionSettings)
    #: Extra Spark configuration applied by :func:`rmq_spark.spark.session.get_spark`.
    spark: dict[str, str] = field(default_factory=dict)
    #: Log level for the ``rmq_spark`` loggers in jobs and the CLI.
    log_level: str = "INFO"
    #: ``[checkers.<producer group>]`` sections, built by
    #: :func:`rmq_spark.checkback.checkers.checkers_from_config`.
    checkers: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: The ``[serve]`` section of ``rmqtx serve`` (its accounts, read by
    #: :func:`rmq_spark.serve.accounts.accounts_from_settings`).
    serve: dict[str, Any] = field(default_factory=dict)


def _section(data: dict[str, Any], cls: type, name: str, parsers: dict[str, Any]) -> Any:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise InvalidOptionError(
            f"unknown setting(s) {', '.join(unknown)} in [{name}]; "
            f"valid: {', '.join(sorted(known))}."
        )
    values = {k: parsers.get(k, lambda v, _n: v)(v, f"{name}.{k}") for k, v in data.items()}
    return replace(cls(), **values)


def _check_trusted(found: Path) -> None:
    """Refuse a settings file found in the working directory that someone else owns or may
    change (the file or its folder), as git's ``safe.directory`` does: it can load JVM classes
    (``[spark]``), import checker modules and point the store and its credentials elsewhere."""
    for item in (found, found.parent):
        info = item.stat()
        if info.st_uid != os.getuid() or info.st_mode & stat.S_IWOTH:
            why = (
                f"is owned by uid {info.st_uid}, not you (uid {os.getuid()})"
                if info.st_uid != os.getuid()
                else "may be changed by any user"
            )
            raise InvalidOptionError(
                f"{str(item)!r} {why}, so the settings file {str(found)!r} found in the working "
                f"directory {str(Path.cwd())!r} is not read: it can load code and send the "
                f"store's credentials elsewhere. Name the file you mean with --conf or "
                f"${CONF_ENV}, or make it yours and not writable by every user."
            )


def load_settings(path: str | os.PathLike[str] | None = None) -> Settings:
    """Load settings from a TOML file over the built-in defaults.

    Parameters
    ----------
    path : str or path-like, optional
        The file to read. Defaults to ``$RMQ_SPARK_CONF``, else ``conf/rmq-spark.toml`` in the
        working directory if it exists (and is yours, not writable by every user), else the
        built-in defaults. The file used is logged at INFO.

    Raises
    ------
    InvalidOptionError
        For an unreadable file, unknown sections or keys, or malformed values; and for a
        ``conf/rmq-spark.toml`` found in the working directory that another user owns or every
        user may change (the file or its folder): it could load code and redirect credentials.
    """
    chosen = path or os.environ.get(CONF_ENV)
    if chosen is None:
        if not DEFAULT_CONF_FILE.exists():
            return Settings()
        _check_trusted(DEFAULT_CONF_FILE)
        chosen = DEFAULT_CONF_FILE
    resolved = Path(chosen).resolve()
    log.log(logging.DEBUG if resolved in _announced else logging.INFO, "settings from %s", resolved)
    _announced.add(resolved)
    try:
        data = tomllib.loads(Path(chosen).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InvalidOptionError(f"cannot read settings file {str(chosen)!r}: {exc}") from exc
    sections = {"store", "transaction", "retention", "spark", "logging", "checkers", "serve"}
    unknown = sorted(set(data) - sections)
    if unknown:
        raise InvalidOptionError(
            f"unknown section(s) {', '.join(unknown)} in {str(chosen)!r}; "
            f"valid: {', '.join(sorted(sections))}."
        )
    store = _section(
        data.get("store", {}),
        StoreSettings,
        "store",
        {
            "queue_nums": lambda v, n: parse_int(v, n, 1, SHARD_QUEUE_STRIDE),
            "shards": lambda v, n: parse_int(v, n, 1, MAX_SHARDS),
            "max_body_bytes": lambda v, n: parse_int(v, n, 1),
            "publish_max_messages": lambda v, n: parse_int(v, n, 1),
            "publish_max_bytes": lambda v, n: parse_int(v, n, 1),
            "publish_interval": parse_positive_duration,
            "publish_lease": parse_positive_duration,
            "publish_linger": parse_linger,
            "intake": parse_bool,
            "log_retention": parse_duration,
            "path": lambda v, n: str(v),
            "storage_options": lambda v, n: {str(k): str(x) for k, x in dict(v).items()},
            "delta_tables": parse_uris,
        },
    )
    transaction = _section(
        data.get("transaction", {}),
        TransactionSettings,
        "transaction",
        {
            "transaction_timeout": parse_duration,
            "transaction_check_interval": parse_duration,
            "max_check_age": parse_duration,
            "transaction_check_max": lambda v, n: parse_int(v, n, 1),
        },
    )
    retention = _section(
        data.get("retention", {}),
        RetentionSettings,
        "retention",
        {f.name: parse_duration for f in fields(RetentionSettings)},
    )
    logging_section = data.get("logging", {})
    if set(logging_section) - {"level"}:
        raise InvalidOptionError("the [logging] section only takes 'level'.")
    level = str(logging_section.get("level", "INFO")).upper()
    if level not in _LOG_LEVELS:
        raise InvalidOptionError(
            f"logging.level {logging_section['level']!r} is not a level; use one of "
            f"{', '.join(_LOG_LEVELS)}."
        )
    return Settings(
        store=store,
        transaction=transaction,
        retention=retention,
        spark={str(k): str(v) for k, v in data.get("spark", {}).items()},
        log_level=level,
        checkers={str(k): dict(v) for k, v in data.get("checkers", {}).items()},
        serve=dict(data.get("serve", {})),
    )


def configure_logging(level: str) -> None:
    """Log ``rmq_spark`` messages to stderr at ``level`` (jobs, CLI and demo use this)."""
    import logging

    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s"
    )
    logging.getLogger("rmq_spark").setLevel(level)
