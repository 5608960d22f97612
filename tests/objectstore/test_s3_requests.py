"""The GETs and PUTs rmq-spark signs itself (:mod:`rmq_spark.delta.s3requests`), against a real
S3 server (MinIO): what s3fs would do for the same calls, with s3fs's own client as the witness."""

from __future__ import annotations

import os
import socket

import pytest
import s3fs

from rmq_spark.delta.s3requests import S3FileSystem, S3Requests
from rmq_spark.delta.storage import filesystem

pytestmark = pytest.mark.objectstore


def _witness(minio) -> s3fs.S3FileSystem:  # noqa: ANN001
    """s3fs's own client, not ours."""
    opts = minio.storage_options
    return s3fs.S3FileSystem(
        key=opts["AWS_ACCESS_KEY_ID"],
        secret=opts["AWS_SECRET_ACCESS_KEY"],
        endpoint_url=opts["AWS_ENDPOINT_URL"],
        skip_instance_cache=True,
    )


def test_reads_and_writes_what_s3fs_reads_and_writes(minio) -> None:
    fs, path = filesystem(minio.root(), minio.storage_options)
    assert isinstance(fs, S3FileSystem)
    witness = _witness(minio)
    # Keys as a store's prefix may spell them: spaces, unicode, reserved characters.
    names = ["plain.json", "with space/and+plus=eq&amp.json", "ünï/çødé~1.json"]
    for name in names:
        fs.pipe_file(f"{path}/{name}", name.encode())
        assert witness.cat_file(f"{path}/{name}") == name.encode()
        witness.pipe_file(f"{path}/{name}", b"from s3fs " + name.encode())
        assert fs.cat_file(f"{path}/{name}") == b"from s3fs " + name.encode()
    missing = f"{path}/missing.json"
    with pytest.raises(FileNotFoundError):
        fs.cat_file(missing)
    found = fs.cat([f"{path}/{names[0]}", missing], on_error="return")
    assert found[f"{path}/{names[0]}"] == b"from s3fs plain.json"
    assert isinstance(found[missing], FileNotFoundError)
    assert fs.cat([f"{path}/{names[0]}", missing], on_error="omit") == {
        f"{path}/{names[0]}": b"from s3fs plain.json"
    }
    with pytest.raises(FileNotFoundError):
        fs.cat([f"{path}/{names[0]}", missing])


def test_a_put_if_absent_never_overwrites(minio) -> None:
    fs, path = filesystem(minio.root(), minio.storage_options)
    name = f"{path}/decided.json"
    fs.pipe_file(name, b"first", mode="create")
    with pytest.raises(FileExistsError):
        fs.pipe_file(name, b"second", mode="create")
    assert _witness(minio).cat_file(name) == b"first"


def test_wrong_credentials_are_a_clear_error_and_write_nothing(minio) -> None:
    options = dict(minio.storage_options, AWS_SECRET_ACCESS_KEY="not-the-secret")
    requests = S3Requests(options)
    root = minio.root().removeprefix("s3://")
    with pytest.raises(PermissionError, match=r"403 SignatureDoesNotMatch"):
        requests.put(f"{root}/x.json", b"x")
    assert not _witness(minio).exists(f"{root}/x.json")


def test_a_dead_keep_alive_connection_is_replaced(minio) -> None:
    """The server (or a load balancer) dropped the thread's idle connection: the next request
    goes out on a new one."""
    requests = S3Requests(minio.storage_options)
    root = minio.root().removeprefix("s3://")
    requests.put(f"{root}/a.json", b"a")
    (conn,) = requests._local.conns.values()
    conn.sock.shutdown(socket.SHUT_RDWR)
    assert requests.get(f"{root}/a.json") == b"a"
    assert next(iter(requests._local.conns.values())) is not conn


def test_a_forked_child_makes_its_own_connection(minio) -> None:
    """A child forked after the parent's requests does not write on the parent's socket (the
    two would read each other's answers)."""
    requests = S3Requests(minio.storage_options)
    root = minio.root().removeprefix("s3://")
    requests.put(f"{root}/parent.json", b"parent")
    (parents,) = requests._local.conns.values()
    pid = os.fork()
    if pid == 0:  # the child: its own connection, the right answers
        ok = False
        try:
            requests.put(f"{root}/child.json", b"child")
            (mine,) = requests._local.conns.values()
            ok = mine is not parents and requests.get(f"{root}/parent.json") == b"parent"
        finally:
            os._exit(0 if ok else 1)
    assert os.waitpid(pid, 0)[1] == 0
    assert requests.get(f"{root}/child.json") == b"child"
    assert next(iter(requests._local.conns.values())) is parents


@pytest.mark.parametrize(
    ("endpoint", "bucket", "expected"),
    [
        (None, "my-bucket", ("my-bucket.s3.eu-west-1.amazonaws.com", "/k/a%20b.json", True)),
        (
            None,
            "my.dotted.bucket",
            ("s3.eu-west-1.amazonaws.com", "/my.dotted.bucket/k/a%20b.json", True),
        ),
        ("http://127.0.0.1:9000", "b1", ("127.0.0.1:9000", "/b1/k/a%20b.json", False)),
        ("https://gw.example/s3", "b1", ("gw.example", "/s3/b1/k/a%20b.json", True)),
    ],
)
def test_addresses(endpoint: str | None, bucket: str, expected: tuple) -> None:
    """AWS: virtual-hosted addresses for buckets that can be host names, path style for the
    others; a configured endpoint: path style under its own path."""
    options = {"AWS_REGION": "eu-west-1", "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s"}
    if endpoint:
        options["AWS_ENDPOINT_URL"] = endpoint
    assert S3Requests(options)._address(bucket, "k/a b.json") == expected


def test_unknown_names_are_not_mistaken_for_objects(minio) -> None:
    """A GET of a key that is a prefix of others (a folder) is a missing object, as in s3fs."""
    fs, path = filesystem(minio.root(), minio.storage_options)
    fs.pipe_file(f"{path}/folder/inside.json", b"x")
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{path}/folder")
