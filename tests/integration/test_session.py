"""get_spark under a real spark-submit: what the user set wins, the rest is filled in and
logged, and the UI is on unless turned off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from rmq_spark.spark.session import DELTA_CATALOG, DELTA_EXTENSION, delta_jars
from tests.lifetime import die_with_parent

REPO = Path(__file__).resolve().parents[2]
LOG4J2 = REPO / "rmq_spark" / "log4j2.properties"

CHILD = textwrap.dedent(
    """
    import json, logging
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("rmq_spark").setLevel(logging.INFO)
    from rmq_spark import get_spark

    spark = get_spark("session-test")
    keys = ["spark.sql.shuffle.partitions", "spark.sql.session.timeZone",
            "spark.default.parallelism", "spark.driver.memory", "spark.sql.extensions",
            "spark.sql.catalog.spark_catalog", "spark.ui.enabled"]
    conf = {k: spark.conf.get(k, None) for k in keys}
    again = get_spark(extra_conf={"spark.sql.shuffle.partitions": "9"})
    print(json.dumps({"conf": conf, "ui": spark.sparkContext.uiWebUrl, "same": again is spark,
                      "partitions_after": spark.conf.get("spark.sql.shuffle.partitions"),
                      "rows": spark.range(3).count()}), flush=True)
    spark.stop()
    """
)


def test_spark_submit_settings_win_and_the_rest_is_filled_in(tmp_path: Path) -> None:
    """``--conf`` beats the settings' ``[spark]`` and get_spark's defaults, spark-defaults.conf
    and ``--driver-memory`` are kept, ``[spark]`` beats the defaults where nothing was given,
    Delta is ensured, the UI is on; a second call on the running session changes nothing."""
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "rmq.toml").write_text(
        '[spark]\n"spark.sql.shuffle.partitions" = "5"\n"spark.default.parallelism" = "3"\n'
    )
    conf_dir = tmp_path / "sparkconf"
    conf_dir.mkdir()
    (conf_dir / "spark-defaults.conf").write_text("spark.sql.session.timeZone  Europe/Paris\n")
    env = {k: v for k, v in os.environ.items() if k != "PYSPARK_SUBMIT_ARGS"}
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(REPO),
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
        SPARK_CONF_DIR=str(conf_dir),
        RMQ_SPARK_CONF=str(tmp_path / "rmq.toml"),
    )
    args = [str(Path(sys.executable).parent / "spark-submit"), "--master", "local[1]"]
    args += ["--jars", ",".join(delta_jars()), "--driver-memory", "1g"]
    args += ["--driver-java-options", f"-Dlog4j2.configurationFile=file:{LOG4J2}"]
    args += ["--conf", "spark.sql.shuffle.partitions=7", "child.py"]
    proc = subprocess.run(
        args,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=die_with_parent,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    # spark-submit's Python runner sends the child's stderr to its stdout.
    lines = (proc.stdout + proc.stderr).splitlines()
    out = json.loads(next(line for line in lines if line.startswith("{")))
    assert out["conf"] == {
        "spark.sql.shuffle.partitions": "7",  # --conf, over [spark]'s 5 and the default 4
        "spark.sql.session.timeZone": "Europe/Paris",  # spark-defaults.conf, over UTC
        "spark.default.parallelism": "3",  # [spark], over the default 4
        "spark.driver.memory": "1g",  # --driver-memory, over 4g
        "spark.sql.extensions": DELTA_EXTENSION,
        "spark.sql.catalog.spark_catalog": DELTA_CATALOG,
        "spark.ui.enabled": None,  # Spark's default: on
    }
    assert out["ui"] and out["ui"].startswith("http")
    assert (out["same"], out["partitions_after"], out["rows"]) == (True, "7", 3)

    ours = [line for line in lines if "rmq_spark.spark.session" in line]
    assert not [line for line in ours if line.startswith("WARNING")], ours
    [filled] = [line for line in ours if "get_spark set" in line]
    assert "(anything set by spark-submit is kept)" in filled
    for item in (
        "spark.default.parallelism=3",
        "spark.databricks.delta.snapshotPartitions=2",
        f"spark.sql.extensions={DELTA_EXTENSION}",
        f"spark.sql.catalog.spark_catalog={DELTA_CATALOG}",
    ):
        assert item in filled, filled
    for left in ("shuffle.partitions", "timeZone", "driver.memory", "ui.enabled", "spark.jars"):
        assert left not in filled, filled
    kept = "\n".join(line for line in ours if "get_spark kept" in line)
    assert "spark.sql.shuffle.partitions=7 as set by spark-submit, not 5" in kept
    assert "spark.sql.shuffle.partitions=7 as set by the running SparkSession, not 9" in kept


def test_a_local_session_loads_delta_s_jars_where_they_are(spark) -> None:
    """Through spark.jars, a local session copied every jar (S3A's bundle is 0.7 GB) into its
    temporary folder, which each killed driver left behind until /tmp was full."""
    import os

    assert spark.range(3).count() == 3  # a task ran: the executor fetched what it is given
    root = spark.sparkContext._jvm.org.apache.spark.SparkFiles.getRootDirectory()
    assert not [name for name in os.listdir(root) if name.endswith(".jar")]
    assert spark.sparkContext._jvm.org.apache.spark.util.Utils.classIsLoadable(DELTA_EXTENSION)


def test_the_suite_s_shared_session_runs_without_ui(spark) -> None:
    """tests/conftest.py turns the UI off, as a user can; the shuffle stays small."""
    assert spark.sparkContext.uiWebUrl is None
    assert spark.sparkContext.master == "local[2]"
    assert int(spark.conf.get("spark.sql.shuffle.partitions")) <= 4
