"""The one place that builds a correctly configured SparkSession (Delta + rmq-spark).

:func:`get_spark` fills in only what nobody set: a setting given to ``spark-submit`` (``--conf``,
``--driver-memory``, ``spark-defaults.conf``), in ``$PYSPARK_SUBMIT_ARGS``, or in a running
SparkSession is never changed. What it fills in is logged at INFO, what it left at DEBUG.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pyspark import SparkConf, SparkContext
from pyspark.sql import SparkSession

from rmq_spark.delta.storage import hadoop_settings, is_s3
from rmq_spark.model.config import Settings, load_settings
from rmq_spark.model.errors import RmqSparkError
from rmq_spark.spark.source import register

log = logging.getLogger(__name__)

JARS_ENV = "RMQ_SPARK_JARS"
_LOG4J2_CONF = Path(__file__).parents[1] / "log4j2.properties"
_REQUIRED_JARS = ("delta-spark_", "delta-storage-")
#: Settings that hold credentials (kept off the driver's command line, and out of the logs).
_CREDENTIAL_KEYS = (".access.key", ".secret.key", ".session.token")

DELTA_EXTENSION = "io.delta.sql.DeltaSparkSessionExtension"
DELTA_CATALOG = "org.apache.spark.sql.delta.catalog.DeltaCatalog"
_EXTENSIONS = "spark.sql.extensions"
_CATALOG = "spark.sql.catalog.spark_catalog"
_JARS = "spark.jars"
_CLASS_PATH = "spark.driver.extraClassPath"
#: Where a user hands Spark the jars (checked for Delta's and S3A's before adding ours).
_JAR_KEYS = (_JARS, "spark.jars.packages", _CLASS_PATH)
#: How each of the keys ours go to separates its entries.
_JAR_SEPARATORS = {_JARS: ",", _CLASS_PATH: os.pathsep}
#: Read when the driver JVM starts: nothing can change them once it runs.
_LAUNCH_ONLY = frozenset({"spark.driver.memory", "spark.driver.extraJavaOptions", _CLASS_PATH})

#: Defaults for what the user leaves unset (Delta's extension and catalog are always ensured):
#: small machines, few shuffle partitions. The UI stays Spark's default (on).
LOCAL_SPARK_CONF = {
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    # Delta rebuilds table snapshots with this many tasks (default 50: slow on small tables).
    "spark.databricks.delta.snapshotPartitions": "2",
    "spark.default.parallelism": "4",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.driver.memory": "4g",
    # A driver killed while writing a query's first offsets leaves Hadoop's hidden temporary
    # file in offsets/, and with this check Spark 4.2 refuses to restart the query until the
    # checkpoint is cleaned by hand. Restarting after a kill is what the sink is built for.
    "spark.sql.streaming.verifyCheckpointDirectoryEmptyOnStart": "false",
}

#: spark-submit options that stand for a Spark setting (they win over its ``--conf``).
_SUBMIT_OPTIONS = {
    "--master": "spark.master",
    "--deploy-mode": "spark.submit.deployMode",
    "--name": "spark.app.name",
    "--jars": "spark.jars",
    "--packages": "spark.jars.packages",
    "--exclude-packages": "spark.jars.excludes",
    "--repositories": "spark.jars.repositories",
    "--py-files": "spark.submit.pyFiles",
    "--files": "spark.files",
    "--archives": "spark.archives",
    "--driver-memory": "spark.driver.memory",
    "--driver-java-options": "spark.driver.extraJavaOptions",
    "--driver-library-path": "spark.driver.extraLibraryPath",
    "--driver-class-path": "spark.driver.extraClassPath",
    "--driver-cores": "spark.driver.cores",
    "--executor-memory": "spark.executor.memory",
    "--executor-cores": "spark.executor.cores",
    "--total-executor-cores": "spark.cores.max",
    "--num-executors": "spark.executor.instances",
    "--queue": "spark.yarn.queue",
    "--principal": "spark.kerberos.principal",
    "--keytab": "spark.kerberos.keytab",
    "--remote": "spark.remote",
}
#: Other spark-submit options that take a value.
_SUBMIT_VALUED = frozenset({"--class", "--proxy-user", "--kill", "--status"})


def submit_conf(submit_args: str, conf_dir: Path | None) -> dict[str, str]:
    """The Spark settings spark-submit gives a driver JVM started with ``submit_args``.

    This is what PySpark's launcher passes on when it starts the JVM itself (outside
    ``spark-submit``): ``$PYSPARK_SUBMIT_ARGS``, then the properties file.

    Parameters
    ----------
    submit_args : str
        spark-submit's arguments, as in ``$PYSPARK_SUBMIT_ARGS``
        (e.g. ``"--driver-memory 2g --conf spark.ui.enabled=false pyspark-shell"``).
    conf_dir : Path, optional
        The folder of ``spark-defaults.conf`` (``$SPARK_CONF_DIR``, else ``$SPARK_HOME/conf``).

    Returns
    -------
    dict
        ``{key: value}`` with spark-submit's precedence: its options (``--driver-memory``)
        over ``--conf``, over ``--properties-file``, over ``spark-defaults.conf`` (read when no
        properties file is given, or with ``--load-spark-defaults``).
    """
    options: dict[str, str] = {}
    confs: dict[str, str] = {}
    properties_file: str | None = None
    load_defaults = False
    tokens = shlex.split(submit_args)
    i = 0
    while i < len(tokens):
        name, eq, inline = tokens[i].partition("=")
        takes_value = name in ("--conf", "-c", "--properties-file") or name in _SUBMIT_OPTIONS
        if takes_value or name in _SUBMIT_VALUED:
            value = inline if eq else (tokens[i + 1] if i + 1 < len(tokens) else "")
            i += 1 if eq else 2
            if name in ("--conf", "-c"):
                key, _, conf_value = value.partition("=")
                confs[key] = conf_value
            elif name == "--properties-file":
                properties_file = value
            elif name in _SUBMIT_OPTIONS:
                options[_SUBMIT_OPTIONS[name]] = value
        elif tokens[i].startswith("-"):
            load_defaults = load_defaults or tokens[i] == "--load-spark-defaults"
            i += 1
        else:
            break  # the primary resource (pyspark-shell): what follows is the application's
    files: dict[str, str] = {}
    defaults_file = conf_dir / "spark-defaults.conf" if conf_dir else None
    if defaults_file and (properties_file is None or load_defaults):
        files.update(_read_properties(defaults_file))
    if properties_file:
        files.update(_read_properties(Path(properties_file)))
    return {**files, **confs, **options}


def properties_conf(text: str) -> dict[str, str]:
    """The ``spark.*`` settings of a properties file such as ``spark-defaults.conf``.

    Reads the Java properties format as spark-submit uses it: one ``key value`` (or
    ``key=value``, ``key: value``) a line, ``#`` and ``!`` comments, a trailing backslash
    continues a line; values are stripped; keys not starting with ``spark.`` are ignored.
    """
    conf: dict[str, str] = {}
    lines = iter(text.splitlines())
    for raw in lines:
        line = raw.strip()
        if not line or line[0] in "#!":
            continue
        while line.endswith("\\"):
            line = line[:-1] + next(lines, "").strip()
        end = next((n for n, ch in enumerate(line) if ch in " \t=:"), len(line))
        key, rest = line[:end], line[end:].lstrip()
        if rest[:1] in ("=", ":"):
            rest = rest[1:]
        if key.startswith("spark."):
            conf[key] = rest.strip()
    return conf


def _read_properties(path: Path) -> dict[str, str]:
    """:func:`properties_conf` of a file; empty when it does not exist."""
    try:
        return properties_conf(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}


@dataclass(frozen=True)
class SparkConfPlan:
    """What :func:`get_spark` sets, and what it leaves as the user set it."""

    #: Settings to set: nobody set them (or, for ``spark.sql.extensions`` and the jars' key,
    #: the user's list with Delta Lake's entries added).
    fill: dict[str, str] = field(default_factory=dict)
    #: Of ``fill``, the lists the user set that get Delta Lake's entries: ``{key: added}``.
    extended: dict[str, str] = field(default_factory=dict)
    #: Settings get_spark would set, left as already set: ``{key: value as set}``.
    kept: dict[str, str] = field(default_factory=dict)
    #: Of ``kept``, those the settings' ``[spark]`` or ``extra_conf`` asked otherwise for:
    #: ``{key: value asked for}``.
    overruled: dict[str, str] = field(default_factory=dict)
    #: Unset settings that cannot be set any more (the JVM or the session runs).
    skipped: dict[str, str] = field(default_factory=dict)
    #: Why Delta Lake may not work in this session, one message each.
    warnings: list[str] = field(default_factory=list)


def plan_spark_conf(
    defaults: Mapping[str, str],
    chosen: Mapping[str, str],
    existing: Mapping[str, str],
    *,
    fixed: Collection[str] = (),
    jars: Sequence[str] = (),
    jars_into: str = _JARS,
) -> SparkConfPlan:
    """Decide which settings :func:`get_spark` sets: only those nobody set.

    Parameters
    ----------
    defaults : mapping
        get_spark's own defaults (:data:`LOCAL_SPARK_CONF`, the master, the app name).
    chosen : mapping
        Settings asked for in code or configuration (``[spark]`` of the settings,
        ``extra_conf``): over ``defaults``, under ``existing``.
    existing : mapping
        Settings already set (by spark-submit, ``$PYSPARK_SUBMIT_ARGS``, ``spark-defaults.conf``
        or a running session): never changed.
    fixed : collection of str, optional
        Keys that cannot be set any more (read at JVM start, or static in a running session).
    jars : sequence of str, optional
        Jars to add (Delta Lake's, when the user gives none).
    jars_into : str, default ``"spark.jars"``
        Where they go: ``spark.jars``, or ``spark.driver.extraClassPath`` for a local master,
        whose one JVM then loads them where they are.

    Returns
    -------
    SparkConfPlan
        Delta Lake's extension and catalog are always in ``fill`` unless already set. A
        ``spark.sql.extensions`` without Delta's gets it added; any other
        ``spark.sql.catalog.spark_catalog`` is kept, with a warning.
    """
    fill: dict[str, str] = {}
    extended: dict[str, str] = {}
    kept: dict[str, str] = {}
    skipped: dict[str, str] = {}
    warnings: list[str] = []
    special = {_EXTENSIONS, _CATALOG} | ({jars_into} if jars else set())
    for key, value in {**defaults, **chosen}.items():
        if key in special:
            continue
        if key in existing:
            kept[key] = existing[key]
        elif key in fixed:
            skipped[key] = value
        else:
            fill[key] = value

    extensions = existing.get(_EXTENSIONS, chosen.get(_EXTENSIONS))
    if extensions and DELTA_EXTENSION in [e.strip() for e in extensions.split(",")]:
        (kept if _EXTENSIONS in existing else fill)[_EXTENSIONS] = extensions
    elif _EXTENSIONS in fixed:
        warnings.append(_NO_EXTENSION.format(value=f" ({extensions})" if extensions else ""))
    else:
        fill[_EXTENSIONS] = f"{extensions},{DELTA_EXTENSION}" if extensions else DELTA_EXTENSION
        if extensions:
            extended[_EXTENSIONS] = DELTA_EXTENSION

    catalog = existing.get(_CATALOG, chosen.get(_CATALOG))
    if catalog is None and _CATALOG in fixed:
        warnings.append(_NO_CATALOG)
    elif catalog is None:
        fill[_CATALOG] = DELTA_CATALOG
    else:
        (kept if _CATALOG in existing else fill)[_CATALOG] = catalog
        if catalog != DELTA_CATALOG:
            warnings.append(_OTHER_CATALOG.format(value=catalog))

    if jars:
        given = existing.get(jars_into, chosen.get(jars_into))
        separator = _JAR_SEPARATORS[jars_into]
        fill[jars_into] = separator.join([given, *jars] if given else jars)
        if given:
            extended[jars_into] = separator.join(jars)

    overruled = {
        k: v for k, v in chosen.items() if k in existing and k in kept and existing[k] != v
    }
    return SparkConfPlan(fill, extended, kept, overruled, skipped, warnings)


_NO_EXTENSION = (
    f"the running SparkSession was built without Delta Lake's {DELTA_EXTENSION} in "
    "spark.sql.extensions{value}, and it cannot be added to a running session: Delta tables' "
    "SQL commands will fail. Build the session with it (docs/deployment.md: 'Using your own "
    "SparkSession'), or call get_spark() before any other SparkSession is made."
)
_NO_CATALOG = (
    f"the running SparkSession has no spark.sql.catalog.spark_catalog; Delta Lake needs "
    f"{DELTA_CATALOG}, and it cannot be set in a running session. Build the session with it "
    "(docs/deployment.md: 'Using your own SparkSession'), or call get_spark() before any other "
    "SparkSession is made."
)
_OTHER_CATALOG = (
    "spark.sql.catalog.spark_catalog is set to {value!r}; rmq-spark leaves it as you set it, "
    f"but Delta Lake needs {DELTA_CATALOG} there and Delta operations may fail. Unset it, or "
    "use a catalog that delegates Delta tables to Delta Lake."
)
_NO_DELTA_JAR = (
    f"Delta Lake's {DELTA_EXTENSION} is not on the driver's class path, and jars cannot be "
    "added once the JVM runs: start it with them (spark-submit --packages "
    "io.delta:delta-spark_4.2_2.13:4.4.0, or --jars with the delta-spark and delta-storage "
    "jars that 'make setup' fetches into .jars/), or call get_spark() before any other "
    "SparkSession is made."
)


def _shown(key: str, value: str) -> str:
    """``key=value`` for a log line: credentials hidden, jars by file name."""
    if key.endswith(_CREDENTIAL_KEYS):
        value = "***"
    elif key in _JAR_SEPARATORS:
        separator = _JAR_SEPARATORS[key]
        value = separator.join(Path(j).name for j in value.split(separator))
    return f"{key}={value}"


def _running_session() -> SparkSession | None:
    """The session ``SparkSession.builder.getOrCreate()`` would return, if one runs."""
    session = SparkSession._instantiatedSession
    return session if session is not None and session._sc._jsc is not None else None


def _already_set(session: SparkSession | None) -> tuple[dict[str, str], str]:
    """The Spark settings already set when get_spark runs, and who set them."""
    if session is not None:
        conf = dict(session.sparkContext.getConf().getAll())
        return {**conf, **session.conf.getAll}, "the running SparkSession"
    context = SparkContext._active_spark_context
    if context is not None:
        return dict(context.getConf().getAll()), "the running SparkContext"
    if os.environ.get("PYSPARK_GATEWAY_PORT") is not None:
        # Under spark-submit the driver JVM runs already; its --conf, --driver-memory ... and
        # spark-defaults.conf are its system properties, which a JVM-backed SparkConf loads.
        SparkContext._ensure_initialized()
        return dict(SparkConf().getAll()), "spark-submit"
    from pyspark.find_spark_home import _find_spark_home

    conf_dir = os.environ.get("SPARK_CONF_DIR") or Path(_find_spark_home()) / "conf"
    submit_args = os.environ.get("PYSPARK_SUBMIT_ARGS", "pyspark-shell")
    return submit_conf(submit_args, Path(conf_dir)), "PYSPARK_SUBMIT_ARGS or spark-defaults.conf"


def _fixed(session: SparkSession | None, jvm_runs: bool, keys: Collection[str]) -> set[str]:
    """Of ``keys``, those that cannot be set any more."""
    if session is None:
        return set(_LAUNCH_ONLY & set(keys)) if jvm_runs else set()
    # Delta registers its runtime settings when first used, so they may not be known yet;
    # spark.hadoop.* settings go to the context's Hadoop configuration.
    settable = ("spark.databricks.delta.", "spark.hadoop.")
    return {k for k in keys if not k.startswith(settable) and not session.conf.isModifiable(k)}


def jars_key(master: str, existing: Mapping[str, str]) -> str:
    """Where :func:`get_spark` adds its jars for ``master``: ``spark.driver.extraClassPath``
    when the executors run in the driver's JVM (``local``, ``local[4]``; not
    ``local-cluster[...]``, whose executors are JVMs of their own), which loads them where they
    are; else ``spark.jars``, whose jars each session copies. A class path set already
    (``existing``) is left as set: one from ``$PYSPARK_SUBMIT_ARGS`` would replace the
    builder's when spark-submit starts."""
    local = master == "local" or master.startswith("local[")
    return _CLASS_PATH if local and _CLASS_PATH not in existing else _JARS


def _gives(conf: Mapping[str, str], artifact: str) -> bool:
    """Whether the user's jars or packages name ``artifact`` (``delta-spark``, ``hadoop-aws``)."""
    return any(artifact in conf.get(key, "") for key in _JAR_KEYS)


def _jars_folder() -> Path:
    """``$RMQ_SPARK_JARS``, else ``.jars/`` of the source checkout (``make setup`` fills it)."""
    return Path(os.environ.get(JARS_ENV) or Path(__file__).resolve().parents[2] / ".jars")


def delta_jars() -> list[str]:
    """Paths of the delta-spark jars fetched by ``make setup``.

    Looked up in ``$RMQ_SPARK_JARS``, else in ``.jars/`` of the source checkout.

    Raises
    ------
    RmqSparkError
        When the jars are missing, with the command that fetches them.
    """
    folder = _jars_folder()
    jars = sorted(str(p) for p in folder.glob("*.jar")) if folder.is_dir() else []
    missing = [j for j in _REQUIRED_JARS if not any(Path(p).name.startswith(j) for p in jars)]
    if missing:
        raise RmqSparkError(
            f"the delta-spark jars are not in {str(folder)!r} (missing {', '.join(missing)}*). "
            f"Run 'make setup' in the rmq-spark checkout, or point ${JARS_ENV} at a folder "
            "holding delta-spark_4.2_2.13 and delta-storage."
        )
    return jars


def s3_jars() -> list[str]:
    """Paths of Hadoop's S3A jars fetched by ``make objectstore`` (``$RMQ_SPARK_JARS/s3``).

    Raises
    ------
    RmqSparkError
        When they are missing, with the command that fetches them and the packages option
        that gives them on a cluster.
    """
    folder = _jars_folder() / "s3"
    jars = sorted(str(p) for p in folder.glob("*.jar")) if folder.is_dir() else []
    if not any(Path(p).name.startswith("hadoop-aws-") for p in jars):
        raise RmqSparkError(
            f"a store on S3 needs Hadoop's S3A jars, and {str(folder)!r} has none. Run 'make "
            "objectstore' in the rmq-spark checkout, or submit with spark-submit --packages "
            "org.apache.hadoop:hadoop-aws:3.5.0."
        )
    return jars


def get_spark(
    app_name: str = "rmq-spark",
    *,
    master: str = "local[2]",
    settings: Settings | None = None,
    extra_conf: dict[str, str] | None = None,
    store_root: str | None = None,
) -> SparkSession:
    """Get or create a SparkSession with Delta Lake, with ``format("rmqtx")`` registered.

    It never overrides a setting you made: what was given to ``spark-submit`` (``--conf``,
    ``--master``, ``--driver-memory``, ``spark-defaults.conf``), to PySpark's own launch
    (``$PYSPARK_SUBMIT_ARGS``, ``spark-defaults.conf``), or set in the SparkSession already
    running is kept. It fills in the rest, the first of these that has a value winning:

    1. ``extra_conf``, then the ``[spark]`` section of the settings;
    2. the S3A settings translated from ``[store] storage_options``, when the store is on S3;
    3. its defaults for a small machine, :data:`LOCAL_SPARK_CONF`:
       ``spark.sql.shuffle.partitions=4``, ``spark.default.parallelism=4``,
       ``spark.driver.memory=4g``, ``spark.sql.session.timeZone=UTC``, Arrow on, no console
       progress bar, Delta snapshots in 2 tasks, no empty-checkpoint check on restart; and
       ``app_name``, ``master`` and Spark's log4j2 settings from rmq-spark.

    The Spark UI is left to Spark: on, unless ``spark.ui.enabled=false`` is set (``--conf``,
    ``[spark]`` or ``extra_conf``).

    What rmq-spark needs is always ensured: Delta Lake's SQL extension is added to
    ``spark.sql.extensions`` (after yours, if you set some), ``spark.sql.catalog.spark_catalog``
    is Delta's catalog unless you set another (kept, with a WARNING), and outside
    ``spark-submit`` the delta-spark jars of ``$RMQ_SPARK_JARS`` (``make setup``) are added
    unless your jars or packages have delta-spark: to ``spark.driver.extraClassPath`` for a
    ``local`` master (no copy per session) unless you set that already, else to
    ``spark.jars``. Under ``spark-submit``, a
    driver without Delta's jar is a WARNING. Settings read when the JVM starts
    (``spark.driver.memory``), or static in a running session, are not filled in then.

    One INFO line of the ``rmq_spark.spark.session`` logger lists what was filled in (names
    and values, credentials as ``***``), another each ``[spark]`` or ``extra_conf`` value that
    a setting already made overruled; DEBUG lists what was left as set.

    Parameters
    ----------
    app_name : str
        The Spark application name, if not set (under ``spark-submit``: ``--name``, else
        the script's name).
    master : str, default ``"local[2]"``
        The Spark master URL, if not set. Under ``spark-submit``, its ``--master`` is used.
    settings : Settings, optional
        Its ``spark`` section is applied over the defaults, and its store's S3 settings;
        defaults to :func:`rmq_spark.model.config.load_settings`.
    extra_conf : dict, optional
        Spark configuration over the settings' ``spark`` section (the caller's choices, still
        under what is already set).
    store_root : str, optional
        The store the session reads (default ``store.path`` of the settings). On S3, Spark
        gets the S3A settings translated from ``[store] storage_options`` (and, outside
        spark-submit, the S3A jars).

    Returns
    -------
    SparkSession

    Raises
    ------
    RmqSparkError
        Outside ``spark-submit``, when the delta-spark jars are needed and missing (with the
        command that fetches them).

    Examples
    --------
    >>> spark = get_spark()  # doctest: +SKIP
    >>> spark = get_spark(extra_conf={"spark.ui.enabled": "false"})  # no UI  # doctest: +SKIP

    Under ``spark-submit --conf spark.sql.shuffle.partitions=16 job.py``, ``get_spark()`` keeps
    16 and logs ``get_spark set spark.databricks.delta.snapshotPartitions=2, ...
    (anything set by spark-submit is kept)``.
    """
    settings = settings or load_settings()
    on_s3 = is_s3(store_root or settings.store.path)
    storage = hadoop_settings(settings.store.storage_options) if on_s3 else {}
    chosen = {**storage, **settings.spark, **(extra_conf or {})}
    under_submit = os.environ.get("PYSPARK_GATEWAY_PORT") is not None
    session = _running_session()
    existing, source = _already_set(session)
    jvm_runs = under_submit or SparkContext._jvm is not None
    defaults = {"spark.app.name": app_name, **LOCAL_SPARK_CONF}
    if not under_submit:
        defaults["spark.master"] = master
        defaults["spark.driver.extraJavaOptions"] = (
            f"-Dlog4j2.configurationFile=file:{_LOG4J2_CONF}"
        )
    jars: list[str] = []
    if not jvm_runs:
        asked = {**chosen, **existing}
        jars += [] if _gives(asked, "delta-spark") else delta_jars()
        jars += s3_jars() if on_s3 and not _gives(asked, "hadoop-aws") else []
    keys = {*defaults, *chosen, _EXTENSIONS, _CATALOG}
    # A local master's executors share the driver's JVM: on its class path the jars are
    # loaded where they are. Through spark.jars each session would copy them (S3A's are
    # 0.7 GB) into a temporary folder that a killed driver leaves behind.
    plan = plan_spark_conf(
        defaults,
        chosen,
        existing,
        fixed=_fixed(session, jvm_runs, keys),
        jars=jars,
        jars_into=jars_key(
            existing.get("spark.master", chosen.get("spark.master", master)), existing
        ),
    )
    if jvm_runs and not SparkContext._jvm.org.apache.spark.util.Utils.classIsLoadable(
        DELTA_EXTENSION
    ):
        plan.warnings.append(_NO_DELTA_JAR)
    _report(plan, source)
    if not under_submit:
        # Python workers run this interpreter (and so see rmq_spark), not whatever python3
        # comes first on PATH.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    # Credentials are set once the JVM is up: the builder's settings reach spark-submit as
    # command-line arguments, which anyone on the host can read (ps). In a running context,
    # the builder's spark.hadoop.* settings would not reach its Hadoop configuration.
    context_runs = session is not None or SparkContext._active_spark_context is not None
    hadoop_later = {
        k: plan.fill.pop(k)
        for k in list(plan.fill)
        if k.endswith(_CREDENTIAL_KEYS) or (context_runs and k.startswith("spark.hadoop."))
    }
    builder = SparkSession.builder
    for key, value in plan.fill.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    hadoop = spark.sparkContext._jsc.hadoopConfiguration()
    for key, value in hadoop_later.items():
        hadoop.set(key.removeprefix("spark.hadoop."), value)
    spark.sparkContext.setLogLevel("WARN")
    register(spark)
    return spark


def _report(plan: SparkConfPlan, source: str) -> None:
    """Log what get_spark sets (INFO), what it leaves (DEBUG), and what may break (WARNING)."""
    for warning in plan.warnings:
        log.warning(warning)
    filled = [
        _shown(key, plan.extended[key]).replace("=", "+=", 1)
        if key in plan.extended
        else _shown(key, value)
        for key, value in sorted(plan.fill.items())
    ]
    if filled:
        log.info("get_spark set %s (anything set by %s is kept)", ", ".join(filled), source)
    for key, asked in sorted(plan.overruled.items()):
        log.info(
            "get_spark kept %s as set by %s, not %s from the settings or extra_conf",
            _shown(key, plan.kept[key]),
            source,
            _shown(key, asked).partition("=")[2],
        )
    if plan.kept:
        kept = ", ".join(_shown(k, v) for k, v in sorted(plan.kept.items()))
        log.debug("get_spark left as set by %s: %s", source, kept)
    if plan.skipped:
        skipped = ", ".join(_shown(k, v) for k, v in sorted(plan.skipped.items()))
        log.debug("get_spark cannot set these in a running JVM or session: %s", skipped)
