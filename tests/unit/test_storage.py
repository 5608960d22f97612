"""Translation of one storage configuration for deltalake, fsspec and Hadoop."""

import pytest

from rmq_spark.storage import (
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
    }


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
