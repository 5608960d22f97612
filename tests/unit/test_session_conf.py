"""What get_spark fills in, decided from what is already set (no Spark)."""

from __future__ import annotations

import os
from pathlib import Path

from rmq_spark.spark.session import (
    DELTA_CATALOG,
    DELTA_EXTENSION,
    LOCAL_SPARK_CONF,
    _shown,
    jars_key,
    plan_spark_conf,
    properties_conf,
    submit_conf,
)

DELTA = {"spark.sql.extensions": DELTA_EXTENSION, "spark.sql.catalog.spark_catalog": DELTA_CATALOG}


def test_nothing_set_fills_the_defaults_and_delta_and_leaves_the_ui_on() -> None:
    plan = plan_spark_conf(LOCAL_SPARK_CONF, {}, {})
    assert plan.fill == {**LOCAL_SPARK_CONF, **DELTA}
    assert "spark.ui.enabled" not in plan.fill
    assert (plan.kept, plan.overruled, plan.extended, plan.warnings) == ({}, {}, {}, [])


def test_what_is_set_is_kept_over_defaults_and_chosen_settings() -> None:
    defaults = {"spark.sql.shuffle.partitions": "4", "spark.sql.session.timeZone": "UTC"}
    chosen = {"spark.sql.shuffle.partitions": "5", "spark.default.parallelism": "3"}
    existing = {"spark.sql.shuffle.partitions": "7", "spark.ui.enabled": "false"}
    plan = plan_spark_conf(defaults, chosen, existing)
    assert plan.fill == {
        "spark.sql.session.timeZone": "UTC",
        "spark.default.parallelism": "3",
        **DELTA,
    }
    assert plan.kept == {"spark.sql.shuffle.partitions": "7"}
    assert plan.overruled == {"spark.sql.shuffle.partitions": "5"}


def test_the_same_value_asked_for_is_not_overruled() -> None:
    plan = plan_spark_conf({}, {"spark.ui.enabled": "false"}, {"spark.ui.enabled": "false"})
    assert plan.kept == {"spark.ui.enabled": "false"}
    assert plan.overruled == {}


def test_delta_s_extension_is_added_to_the_user_s_list() -> None:
    plan = plan_spark_conf({}, {}, {"spark.sql.extensions": "com.example.Ext"})
    assert plan.fill["spark.sql.extensions"] == f"com.example.Ext,{DELTA_EXTENSION}"
    assert plan.extended == {"spark.sql.extensions": DELTA_EXTENSION}
    assert plan.warnings == []
    listed = plan_spark_conf({}, {}, {"spark.sql.extensions": f"a.B, {DELTA_EXTENSION}"})
    assert listed.kept == {"spark.sql.extensions": f"a.B, {DELTA_EXTENSION}"}
    assert "spark.sql.extensions" not in listed.fill


def test_another_catalog_is_kept_with_a_warning() -> None:
    plan = plan_spark_conf({}, {}, {"spark.sql.catalog.spark_catalog": "org.example.Catalog"})
    assert plan.kept == {"spark.sql.catalog.spark_catalog": "org.example.Catalog"}
    assert "spark.sql.catalog.spark_catalog" not in plan.fill
    (warning,) = plan.warnings
    assert "'org.example.Catalog'" in warning and DELTA_CATALOG in warning
    from_config = plan_spark_conf({}, {"spark.sql.catalog.spark_catalog": "x.Y"}, {})
    assert from_config.fill["spark.sql.catalog.spark_catalog"] == "x.Y"
    assert len(from_config.warnings) == 1


def test_a_running_session_without_delta_is_a_warning_not_a_change() -> None:
    fixed = {"spark.sql.extensions", "spark.sql.catalog.spark_catalog", "spark.driver.memory"}
    plan = plan_spark_conf({"spark.driver.memory": "4g"}, {}, {}, fixed=fixed)
    assert plan.fill == {}
    assert plan.skipped == {"spark.driver.memory": "4g"}
    assert len(plan.warnings) == 2
    assert DELTA_EXTENSION in plan.warnings[0] and "cannot be added" in plan.warnings[0]
    assert DELTA_CATALOG in plan.warnings[1]


def test_jars_are_added_to_the_user_s() -> None:
    jars = ["/j/delta-spark_4.2_2.13-4.4.0.jar", "/j/delta-storage-4.4.0.jar"]
    plan = plan_spark_conf({}, {}, {}, jars=jars)
    assert plan.fill["spark.jars"] == ",".join(jars)
    assert "spark.jars" not in plan.extended
    mine = plan_spark_conf({}, {}, {"spark.jars": "/x/mine.jar"}, jars=jars)
    assert mine.fill["spark.jars"] == ",".join(["/x/mine.jar", *jars])
    assert mine.extended == {"spark.jars": ",".join(jars)}
    assert _shown("spark.jars", mine.fill["spark.jars"]) == (
        "spark.jars=mine.jar,delta-spark_4.2_2.13-4.4.0.jar,delta-storage-4.4.0.jar"
    )


def test_a_local_master_s_jars_go_on_the_driver_s_class_path() -> None:
    jars = ["/j/delta-spark_4.2_2.13-4.4.0.jar", "/j/delta-storage-4.4.0.jar"]
    key = "spark.driver.extraClassPath"
    plan = plan_spark_conf({}, {}, {key: "/x/mine.jar"}, jars=jars, jars_into=key)
    assert plan.fill[key] == os.pathsep.join(["/x/mine.jar", *jars])
    assert "spark.jars" not in plan.fill
    assert _shown(key, plan.fill[key]) == (
        f"{key}=mine.jar{os.pathsep}delta-spark_4.2_2.13-4.4.0.jar{os.pathsep}delta-storage-4.4.0.jar"
    )


def test_only_a_master_in_the_driver_s_jvm_takes_the_jars_on_its_class_path() -> None:
    key = "spark.driver.extraClassPath"
    assert jars_key("local[2]", {}) == jars_key("local", {}) == key
    assert jars_key("local-cluster[2,1,1024]", {}) == "spark.jars"  # executors: JVMs of their own
    assert jars_key("spark://h:7077", {}) == "spark.jars"
    assert jars_key("local[2]", {key: "/x/mine.jar"}) == "spark.jars"  # $PYSPARK_SUBMIT_ARGS' wins


def test_credentials_are_not_shown() -> None:
    assert (
        _shown("spark.hadoop.fs.s3a.secret.key", "s3cr3t") == "spark.hadoop.fs.s3a.secret.key=***"
    )
    assert _shown("spark.hadoop.fs.s3a.session.token", "t0k") == (
        "spark.hadoop.fs.s3a.session.token=***"
    )
    assert _shown("spark.hadoop.fs.s3a.endpoint", "http://h:9") == (
        "spark.hadoop.fs.s3a.endpoint=http://h:9"
    )


def test_submit_args_options_win_over_conf_over_files(tmp_path: Path) -> None:
    (tmp_path / "spark-defaults.conf").write_text(
        "spark.sql.session.timeZone  Europe/Paris\nspark.driver.memory 8g\nspark.ui.enabled true\n"
    )
    args = (
        "--master local[3] --conf spark.ui.enabled=false -c spark.sql.shuffle.partitions=7 "
        "--conf=spark.driver.memory=2g --driver-memory 1g --verbose "
        "--driver-java-options '-Da=1 -Db=2' pyspark-shell --conf spark.not.mine=1"
    )
    assert submit_conf(args, tmp_path) == {
        "spark.sql.session.timeZone": "Europe/Paris",
        "spark.ui.enabled": "false",
        "spark.sql.shuffle.partitions": "7",
        "spark.driver.memory": "1g",
        "spark.master": "local[3]",
        "spark.driver.extraJavaOptions": "-Da=1 -Db=2",
    }
    assert submit_conf("pyspark-shell", tmp_path / "missing") == {}
    assert submit_conf("pyspark-shell", None) == {}


def test_a_properties_file_replaces_spark_defaults_unless_asked_to_load_them(
    tmp_path: Path,
) -> None:
    (tmp_path / "spark-defaults.conf").write_text("spark.a 1\nspark.b 1\n")
    props = tmp_path / "mine.conf"
    props.write_text("spark.b=2\n")
    assert submit_conf(f"--properties-file {props} pyspark-shell", tmp_path) == {"spark.b": "2"}
    loaded = submit_conf(f"--load-spark-defaults --properties-file {props} x", tmp_path)
    assert loaded == {"spark.a": "1", "spark.b": "2"}


def test_properties_format() -> None:
    text = (
        "# a comment\n"
        "! another\n"
        "\n"
        "spark.master   local[4]  \n"
        "spark.ui.enabled=false\n"
        "spark.app.name: my app\n"
        "  spark.driver.extraJavaOptions -Da=1 \\\n"
        "      -Db=2\n"
        "log4j.rootCategory INFO\n"
        "spark.flag\n"
    )
    assert properties_conf(text) == {
        "spark.master": "local[4]",
        "spark.ui.enabled": "false",
        "spark.app.name": "my app",
        "spark.driver.extraJavaOptions": "-Da=1 -Db=2",
        "spark.flag": "",
    }
