"""Translation of one storage configuration for deltalake, fsspec and Hadoop."""

import pytest

from rmq_spark.delta.storage import (
    StorageConfigError,
    deltalake_options,
    fsspec_options,
    hadoop_settings,
)

MINIO = {
    "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
    "AWS_ALLOW_HTTP": "true",
    "AWS_ACCESS_KEY_ID": "ak",
    "AWS_SECRET_ACCESS_KEY": "sk",
    "AWS_REGION": "us-east-1",
}


def test_s3fs_kwargs_have_no_aws_keys():
    kw = fsspec_options("s3://b/root", MINIO)
    assert kw == {
        "use_listings_cache": False,
        "key": "ak",
        "secret": "sk",
        "endpoint_url": "http://127.0.0.1:9000",
        "client_kwargs": {"region_name": "us-east-1"},
        "max_concurrency": 1,
    }


def test_a_public_bucket_and_a_ca_bundle_reach_s3fs():
    kw = fsspec_options(
        "s3://b/root", {"AWS_SKIP_SIGNATURE": "true", "AWS_CA_BUNDLE": "/etc/ca.pem"}
    )
    assert kw["anon"] is True
    assert kw["client_kwargs"] == {"verify": "/etc/ca.pem"}


def test_local_root_gets_no_fsspec_kwargs():
    assert fsspec_options("/tmp/store", MINIO) == {}


def test_hadoop_settings():
    conf = hadoop_settings(MINIO)
    assert conf["spark.hadoop.fs.s3.impl"] == "org.apache.hadoop.fs.s3a.S3AFileSystem"
    assert conf["spark.hadoop.fs.s3a.endpoint"] == "http://127.0.0.1:9000"
    assert conf["spark.hadoop.fs.s3a.access.key"] == "ak"
    assert conf["spark.hadoop.fs.s3a.secret.key"] == "sk"
    assert conf["spark.hadoop.fs.s3a.path.style.access"] == "true"
    assert conf["spark.hadoop.fs.s3a.connection.ssl.enabled"] == "false"


def test_deltalake_options_pass_through():
    assert deltalake_options(MINIO) == MINIO
    assert deltalake_options({}) is None


@pytest.mark.parametrize(
    "key,value",
    [("AWS_S3_LOCKING_PROVIDER", "dynamodb"), ("aws_s3_allow_unsafe_rename", "true")],
)
def test_options_disabling_conditional_writes_are_refused(key, value):
    with pytest.raises(StorageConfigError, match="conditional writes"):
        deltalake_options({**MINIO, key: value})


def test_reader_and_writer_storage_options_go_over_the_configured_ones():
    from rmq_spark.model.config import StoreSettings, split_storage_options

    given = {"topic": "Orders", "storage.aws_region": "eu-west-1", "Storage.AWS_ENDPOINT_URL": "x"}
    others, storage = split_storage_options(given)
    assert others == {"topic": "Orders"}
    assert storage == {"AWS_REGION": "eu-west-1", "AWS_ENDPOINT_URL": "x"}
    configured = StoreSettings(
        storage_options={"AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "a"}
    )
    merged = configured.with_storage_options(storage).storage_options
    assert merged == {"AWS_REGION": "eu-west-1", "AWS_ACCESS_KEY_ID": "a", "AWS_ENDPOINT_URL": "x"}
    assert configured.with_storage_options({}) is configured


def test_spark_gets_the_endpoint_from_the_environment(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://s3.example.com")
    conf = hadoop_settings({})
    assert conf["spark.hadoop.fs.s3a.endpoint"] == "https://s3.example.com"
    assert conf["spark.hadoop.fs.s3a.connection.ssl.enabled"] == "true"
    assert "spark.hadoop.fs.s3a.access.key" not in conf  # S3A's own credential chain


def test_gcs_and_adls_options():
    gcs = fsspec_options("gs://b/root", {"google_service_account_path": "/k.json"})
    assert gcs == {"use_listings_cache": False, "token": "/k.json"}
    adls = {"AZURE_STORAGE_ACCOUNT_NAME": "acct", "AZURE_STORAGE_ACCOUNT_KEY": "k"}
    assert fsspec_options("abfss://c@acct.dfs.core.windows.net/r", adls) == {
        "use_listings_cache": False,
        "account_name": "acct",
        "account_key": "k",
    }


def test_a_missing_filesystem_package_names_the_extra():
    from rmq_spark.delta.storage import filesystem

    # gcsfs is not a dependency of the test environment: the error says how to install it.
    with pytest.raises(StorageConfigError, match=r"pip install 'rmq-spark\[gcs\]'"):
        filesystem("gs://bucket/root", {})


def test_an_unreachable_object_store_is_a_clear_error() -> None:
    """No S3 endpoint at the configured address gave a botocore traceback (rmqtx: exit 1)."""
    from rmq_spark import Store
    from rmq_spark.model.config import Settings, StoreSettings

    options = {**MINIO, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}  # nothing listens on port 9
    settings = Settings(store=StoreSettings(path="s3://b/root", storage_options=options))
    with pytest.raises(StorageConfigError, match="cannot reach the store at 's3://b/root'"):
        Store.open(settings=settings, create=False)


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("AWS_SECRET_ACCES_KEY", "AWS_SECRET_ACCESS_KEY"),
        ("AWS_ENDPOINT_ULR", "AWS_ENDPOINT_URL"),
        ("aws_acess_key_id", "AWS_ACCESS_KEY_ID"),
        ("AWS_REGOIN", "AWS_REGION"),
    ],
)
def test_a_misspelt_storage_option_names_the_one_meant(tmp_path, typo: str, meant: str) -> None:
    """A typo in a credential's name on an existing S3 store was reported as CORRUPT_STORE
    ('missing or unreadable'), as if the store were damaged."""
    from rmq_spark import Store
    from rmq_spark.model.config import Settings, StoreSettings

    options = {k: v for k, v in MINIO.items() if k != meant} | {typo: "value"}
    settings = Settings(store=StoreSettings(path="s3://b/root", storage_options=options))
    with pytest.raises(StorageConfigError, match=f"'{typo}'.*did you mean '{meant}'"):
        Store.open(settings=settings, create=False)


def test_s3_credential_errors_are_the_stores_and_a_forked_child_looks_them_up(
    monkeypatch, no_aws_credentials
):
    """A credential chain that fails (a key without its secret) is a StorageConfigError, not
    an error of each object read; a child forked while another thread of its parent held the
    credentials' lock looks them up all the same (its copy of the lock is never released)."""
    import os
    import signal

    from rmq_spark.delta.s3requests import S3Requests

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "only-the-key")
    with pytest.raises(StorageConfigError, match="credentials"):
        S3Requests({"AWS_REGION": "us-east-1"})._resolved()

    requests = S3Requests({**MINIO})
    with requests._credentials_lock:  # held by "another thread" at the fork
        child = os.fork()
        if child == 0:
            signal.alarm(10)  # a hang ends the child, which the parent sees
            os._exit(0 if requests._resolved().access_key == "ak" else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_public_bucket_is_read_unsigned_by_pyarrow_even_with_keys_set():
    from rmq_spark.delta.storage import arrow_filesystem

    fs = arrow_filesystem("s3://b/root", {**MINIO, "AWS_SKIP_SIGNATURE": "true"})
    assert fs.type_name == "s3"
