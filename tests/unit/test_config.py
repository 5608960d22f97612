from __future__ import annotations

import os
from pathlib import Path

import pytest

from rmq_spark import InvalidOptionError
from rmq_spark.model.config import CONF_ENV, load_settings, parse_duration

REPO = Path(__file__).resolve().parents[2]


def test_shipped_conf_file_matches_rocketmq_defaults() -> None:
    settings = load_settings(REPO / "conf" / "rmq-spark.toml")
    tx = settings.transaction
    assert (tx.transaction_timeout, tx.transaction_check_interval) == (6.0, 30.0)
    assert (tx.transaction_check_max, tx.max_check_age) == (15, 72 * 3600.0)
    assert settings.store.max_body_bytes == 4 * 1024 * 1024
    assert settings.store.path == "storage"
    assert settings.store.publish_max_messages == 10_000
    assert settings.store.publish_max_bytes == 64 * 1024 * 1024


def test_overrides_and_durations(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text(
        '[store]\npath = "/data/rmq"\nqueue_nums = 8\npublish_linger = "50ms"\n'
        '[transaction]\ntransaction_timeout = "500ms"\nmax_check_age = "12h"\n'
        '[spark]\n"spark.sql.shuffle.partitions" = 2\n[logging]\nlevel = "debug"\n'
    )
    settings = load_settings(conf)
    assert settings.store.path == "/data/rmq" and settings.store.queue_nums == 8
    assert settings.store.publish_linger == 0.05
    assert settings.transaction.transaction_timeout == 0.5
    assert settings.transaction.max_check_age == 12 * 3600
    assert settings.spark == {"spark.sql.shuffle.partitions": "2"}
    assert settings.log_level == "DEBUG"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[store]\nqueue_num = 4\n", r"unknown setting\(s\) queue_num in \[store\]; valid: "),
        ("[stor]\n", r"unknown section\(s\) stor"),
        ("[store]\nqueue_nums = 0\n", "queue_nums needs to be an integer from 1 to 1000 but got 0"),
        (
            '[store]\npublish_max_bytes = "64MiB"\n',
            "store.publish_max_bytes needs to be an integer >= 1 but got '64MiB'",
        ),
        ('[transaction]\ntransaction_timeout = "soon"\n', "needs a duration such as"),
        ('[logging]\nlevel = "VERBOSE"\n', "logging.level 'VERBOSE' is not a level; use one of"),
        ("not toml = = 1", "cannot read settings file"),
    ],
)
def test_bad_settings_are_clear_errors(tmp_path: Path, text: str, match: str) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text(text)
    with pytest.raises(InvalidOptionError, match=match):
        load_settings(conf)


def test_parse_duration_units() -> None:
    assert parse_duration("72h", "x") == 259200
    assert parse_duration("500ms", "x") == 0.5
    assert parse_duration(0, "x") == parse_duration("0", "x") == 0.0
    with pytest.raises(InvalidOptionError, match="needs a duration"):
        parse_duration(-1, "x")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[retention]\nfile_reserved_time = 72\n", "fileReservedTime is in hours: .* '72h'"),
        (
            "[transaction]\ntransaction_timeout = 6000\n",
            "transactionTimeOut is in milliseconds: .* '6000ms'",
        ),
        ('[store]\npublish_lease = "10"\n', "store.publish_lease = '10' has no unit; .* '10s'"),
        ('[store]\npublish_linger = "1m"\n', "publish_linger is how long .* up to '10s'"),
    ],
)
def test_a_duration_without_a_unit_is_refused(tmp_path: Path, text: str, match: str) -> None:
    """A bare number's unit would be a guess: RocketMQ's ``fileReservedTime = 72`` is hours,
    and read as seconds it expired every message (#48)."""
    conf = tmp_path / "c.toml"
    conf.write_text(text)
    with pytest.raises(InvalidOptionError, match=match):
        load_settings(conf)


@pytest.mark.parametrize("planted", ["other owner", "world-writable", "writable folder"])
def test_a_settings_file_planted_in_the_working_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: str
) -> None:
    """With no --conf, conf/rmq-spark.toml was read from whatever the working directory was:
    a file there can load JVM classes ([spark]), import checker modules and send the store and
    its credentials elsewhere. Like git's safe.directory, one that someone else owns or may
    change is refused, naming the way to use it on purpose."""
    conf = tmp_path / "conf" / "rmq-spark.toml"
    conf.parent.mkdir()
    conf.write_text('[store]\npath = "/elsewhere"\n')
    if planted == "other owner":
        os.chown(conf, os.getuid() + 4242, -1)
    elif planted == "world-writable":
        conf.chmod(0o666)
    else:
        conf.parent.chmod(0o777)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(CONF_ENV, raising=False)
    with pytest.raises(InvalidOptionError, match=r"conf/rmq-spark\.toml.*RMQ_SPARK_CONF"):
        load_settings()
    assert load_settings(conf).store.path == "/elsewhere"  # named on purpose: read


def test_the_settings_file_used_is_named_at_info(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    conf = tmp_path / "conf" / "rmq-spark.toml"
    conf.parent.mkdir()
    conf.write_text('[store]\npath = "/mine"\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(CONF_ENV, raising=False)
    with caplog.at_level("INFO", logger="rmq_spark"):
        assert load_settings().store.path == "/mine"
    assert f"settings from {conf}" in caplog.text
