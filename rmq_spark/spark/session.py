"""The one place that builds a correctly configured local SparkSession (Delta + rmq-spark)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pyspark.sql import SparkSession

from rmq_spark.delta.storage import hadoop_settings, is_s3
from rmq_spark.model.config import Settings, load_settings
from rmq_spark.model.errors import RmqSparkError
from rmq_spark.spark.source import register

JARS_ENV = "RMQ_SPARK_JARS"
_LOG4J2_CONF = Path(__file__).parents[1] / "log4j2.properties"
_REQUIRED_JARS = ("delta-spark_", "delta-storage-")
#: Settings that hold credentials (kept off the driver's command line).
_CREDENTIAL_KEYS = (".access.key", ".secret.key", ".session.token")

#: Local-mode defaults: small machines, no UI, few shuffle partitions.
LOCAL_SPARK_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    "spark.ui.enabled": "false",
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

    Parameters
    ----------
    app_name : str
        The Spark application name.
    master : str, default ``"local[2]"``
        The Spark master URL. Under ``spark-submit``, its ``--master`` and jars are used.
    settings : Settings, optional
        Its ``spark`` section is applied over the local defaults; defaults to
        :func:`rmq_spark.model.config.load_settings`.
    extra_conf : dict, optional
        Spark configuration applied last (highest precedence).
    store_root : str, optional
        The store the session reads (default ``store.path`` of the settings). On S3, Spark
        gets the S3A settings translated from ``[store] storage_options`` (and, outside
        spark-submit, the S3A jars).

    Returns
    -------
    SparkSession
    """
    settings = settings or load_settings()
    on_s3 = is_s3(store_root or settings.store.path)
    storage = hadoop_settings(settings.store.storage_options) if on_s3 else {}
    conf = {**LOCAL_SPARK_CONF, **storage, **settings.spark, **(extra_conf or {})}
    builder = SparkSession.builder.appName(app_name)
    if os.environ.get("PYSPARK_GATEWAY_PORT") is None:
        # Not under spark-submit, whose --master and --jars/--packages are respected as given.
        conf["spark.jars"] = ",".join(delta_jars() + (s3_jars() if on_s3 else []))
        conf.setdefault(
            "spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{_LOG4J2_CONF}"
        )
        # Python workers run this interpreter (and so see rmq_spark), not whatever python3
        # comes first on PATH.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        builder = builder.master(master)
    # Credentials are set once the JVM is up: the builder's settings reach spark-submit as
    # command-line arguments, which anyone on the host can read (ps).
    secrets = {k: conf.pop(k) for k in list(conf) if k.endswith(_CREDENTIAL_KEYS)}
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    hadoop = spark.sparkContext._jsc.hadoopConfiguration()
    for key, value in secrets.items():
        hadoop.set(key.removeprefix("spark.hadoop."), value)
    spark.sparkContext.setLogLevel("WARN")
    register(spark)
    return spark
