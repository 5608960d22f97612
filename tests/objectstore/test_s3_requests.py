"""The GETs and PUTs rmq-spark signs itself (:mod:`rmq_spark.delta.s3requests`), against a real
S3 server (MinIO): what s3fs would do for the same calls, with s3fs's own client as the witness."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest
import s3fs

from rmq_spark.delta.s3requests import S3Error, S3FileSystem, S3Requests
from rmq_spark.delta.storage import filesystem
from rmq_spark.model.errors import StorageConfigError
from rmq_spark.serve.tls import self_signed
from tests import minio as minio_server
from tests.latency_proxy import LatencyProxy

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
    # Reads of several that return errors as values still raise this one: it is the store's,
    # not an object's (a log read would call it a damaged entry).
    fs, path = filesystem(minio.root(), options)
    with pytest.raises(PermissionError, match="403"):
        fs.cat([f"{path}/a.json", f"{path}/b.json"], on_error="return")


def test_a_dead_keep_alive_connection_is_replaced(minio) -> None:
    """The server (or a load balancer) dropped the thread's idle connection: the next request
    goes out on a new one."""
    requests = S3Requests(minio.storage_options)
    root = minio.root().removeprefix("s3://")
    requests.put(f"{root}/a.json", b"a")
    (conn,) = requests._local.conns.values()
    dead = conn.sock
    dead.shutdown(socket.SHUT_RDWR)
    assert requests.get(f"{root}/a.json") == b"a"
    assert conn.sock is not None and conn.sock is not dead


def test_an_https_endpoint_is_verified_against_the_ca_bundle(minio, tmp_path: Path) -> None:
    """Requests to an HTTPS endpoint go over TLS, the server's certificate checked against
    ``AWS_CA_BUNDLE``; a certificate no root vouches for is refused, naming the option."""
    key, cert, _ = self_signed("127.0.0.1")
    certs = tmp_path / "certs"
    certs.mkdir()
    (certs / "private.key").write_bytes(key)
    (certs / "public.crt").write_bytes(cert)
    server = minio_server.start(tmp_path / "data", certs)
    try:
        assert server.endpoint.startswith("https://")
        trusting = {**server.storage_options, "AWS_CA_BUNDLE": str(certs / "public.crt")}
        root = server.root().removeprefix("s3://")
        requests = S3Requests(trusting)
        requests.put(f"{root}/a.json", b"over TLS", if_absent=True)
        assert requests.get(f"{root}/a.json") == b"over TLS"
        with pytest.raises(S3Error, match="certificate verify failed.*AWS_CA_BUNDLE"):
            S3Requests(server.storage_options).get(f"{root}/a.json")
    finally:
        server.stop()


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
    ("endpoint", "virtual", "bucket", "region", "expected"),
    [
        (
            None,
            False,
            "my-bucket",
            "eu-west-1",
            ("my-bucket.s3.eu-west-1.amazonaws.com", "/k/a%20b.json", True),
        ),
        (
            None,
            False,
            "my.dotted.bucket",
            "eu-west-1",
            ("s3.eu-west-1.amazonaws.com", "/my.dotted.bucket/k/a%20b.json", True),
        ),
        (
            None,
            False,
            "my-bucket",
            "cn-north-1",
            ("my-bucket.s3.cn-north-1.amazonaws.com.cn", "/k/a%20b.json", True),
        ),
        (
            "http://127.0.0.1:9000",
            False,
            "b1",
            "eu-west-1",
            ("127.0.0.1:9000", "/b1/k/a%20b.json", False),
        ),
        (
            "https://gw.example/s3",
            False,
            "b1",
            "eu-west-1",
            ("gw.example", "/s3/b1/k/a%20b.json", True),
        ),
        (
            "https://b1.oss.example",
            True,
            "b1",
            "eu-west-1",
            ("b1.oss.example", "/k/a%20b.json", True),
        ),
    ],
)
def test_addresses(
    endpoint: str | None, virtual: bool, bucket: str, region: str, expected: tuple
) -> None:
    """AWS: virtual-hosted addresses for buckets that can be host names, path style for the
    others, China's domain in its regions; a configured endpoint: path style under its own
    path, or with virtual-hosted requests the endpoint as the bucket's host (deltalake's
    reading of the option)."""
    options = {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s"}
    if endpoint:
        options["AWS_ENDPOINT_URL"] = endpoint
    if virtual:
        options["AWS_VIRTUAL_HOSTED_STYLE_REQUEST"] = "true"
    assert S3Requests(options)._address(bucket, "k/a b.json", region) == expected


class _LosesFirstAnswer:
    """A TCP proxy to MinIO that passes the first connection's request on, waits for the
    answer and closes the connection without passing it back (a request timed out after it
    was carried out); later connections pass both ways."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.first = True
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            upstream = socket.create_connection(("127.0.0.1", self.target))
            first, self.first = self.first, False
            threading.Thread(target=_pipe, args=(client, upstream), daemon=True).start()
            if first:
                upstream.recv(65536)  # the answer came: lose it
                for sock in (client, upstream):
                    sock.shutdown(socket.SHUT_RDWR)
                    sock.close()
            else:
                threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass


def test_a_put_if_absent_whose_answer_was_lost_knows_it_wrote(minio) -> None:
    """The put landed, its answer was lost, its retry is refused (412): the object holds its
    own bytes, so it wrote them (a log entry taken for a rival's would be committed again at
    the next version: its messages twice). Another writer's bytes there still refuse it."""
    proxy = _LosesFirstAnswer(int(minio.endpoint.rsplit(":", 1)[1]))
    options = dict(minio.storage_options, AWS_ENDPOINT_URL=f"http://127.0.0.1:{proxy.port}")
    requests = S3Requests(options)
    root = minio.root().removeprefix("s3://")
    requests.put(f"{root}/00000000000000000007.json", b"mine", if_absent=True)
    assert _witness(minio).cat_file(f"{root}/00000000000000000007.json") == b"mine"
    with pytest.raises(FileExistsError):
        requests.put(f"{root}/00000000000000000007.json", b"a rival's", if_absent=True)


def test_large_objects_are_put_only_if_absent_too(minio) -> None:
    fs, path = filesystem(minio.root(), minio.storage_options)
    big = os.urandom(9 * 1024 * 1024)
    fs.pipe_file(f"{path}/big", big, mode="create")
    with pytest.raises(FileExistsError):
        fs.pipe_file(f"{path}/big", b"small", mode="create")
    assert fs.cat_file(f"{path}/big") == big


def test_no_credentials_is_a_clear_error(minio, no_aws_credentials) -> None:
    """No keys in the options and none anywhere botocore looks: an error that says what to
    set, not unsigned requests refused one by one; a public bucket is asked for by name."""
    options = {"AWS_ENDPOINT_URL": minio.endpoint}
    root = minio.root().removeprefix("s3://")
    requests = S3Requests(options)
    for _ in range(2):  # the second time without asking the chain again
        with pytest.raises(StorageConfigError, match="no AWS credentials"):
            requests.put(f"{root}/x.json", b"x")
    with pytest.raises(StorageConfigError, match="no AWS credentials"):
        filesystem(minio.root(), options)[0].cat([f"{root}/x.json"], on_error="return")
    with pytest.raises(StorageConfigError, match=r"profile \(nope\) could not be found"):
        S3Requests({**options, "AWS_PROFILE": "nope"}).put(f"{root}/x.json", b"x")
    with pytest.raises(PermissionError, match="403"):
        S3Requests({**options, "AWS_SKIP_SIGNATURE": "true"}).put(f"{root}/x.json", b"x")


def test_behind_an_http_proxy_s3fs_makes_the_requests(minio, monkeypatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    fs, _ = filesystem(minio.root(), minio.storage_options)
    assert type(fs) is s3fs.S3FileSystem


def test_unknown_names_are_not_mistaken_for_objects(minio) -> None:
    """A GET of a key that is a prefix of others (a folder) is a missing object, as in s3fs."""
    fs, path = filesystem(minio.root(), minio.storage_options)
    fs.pipe_file(f"{path}/folder/inside.json", b"x")
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{path}/folder")


@pytest.mark.parametrize("gathered", [True, False], ids=["one-put", "past-the-limit"])
def test_data_files_are_put_whole_or_streamed_past_the_limit(minio, monkeypatch, gathered) -> None:
    """A small data file is one signed PUT of bytes gathered in memory; one past
    ``GATHERED_BYTES`` goes on through arrow's stream. Either reads back whole, and a write
    that fails before its file is closed stores nothing of a gathered file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rmq_spark.delta import files
    from rmq_spark.delta.files import write_files

    assert files._signed_put(minio.root(), minio.storage_options) is not None
    if not gathered:
        monkeypatch.setattr(files, "GATHERED_BYTES", 1024)
    schema = pa.schema([("id", pa.int64()), ("body", pa.binary())])
    rows = pa.table({"id": list(range(200)), "body": [os.urandom(64) for _ in range(200)]})
    uri = f"{minio.root()}/table"
    (add,) = write_files(uri, iter([rows]), schema, None, minio.storage_options)
    witness = _witness(minio)
    path = f"{uri.removeprefix('s3://')}/{add.path}"
    assert witness.size(path) == add.size
    with witness.open(path, "rb") as f:
        assert pq.read_table(f).equals(rows.cast(schema))

    def failing():
        yield rows
        raise RuntimeError("the rows ran out")

    with pytest.raises(RuntimeError):
        write_files(f"{uri}-failed", failing(), schema, None, minio.storage_options)
    left = witness.find(f"{uri.removeprefix('s3://')}-failed")
    assert left == [] if gathered else len(left) <= 1


def test_objects_named_are_deleted_a_thousand_a_request(minio) -> None:
    """``rm`` of objects by name: one DeleteObjects request a thousand keys (s3fs made one
    through aiobotocore, ten times the CPU); keys XML must escape, and absent ones, are fine."""
    proxy = LatencyProxy(int(minio.endpoint.rsplit(":", 1)[1]), 0, record=True).start()
    try:
        options = dict(minio.storage_options, AWS_ENDPOINT_URL=proxy.endpoint)
        fs, path = filesystem(minio.root(), options)
        odd = [f"{path}/a&b<c>'d\"e.json", f"{path}/ünï çødé.json"]
        many = [f"{path}/many/{i:04d}" for i in range(1001)]
        for name in [*odd, *many[::100], f"{path}/kept.json"]:
            fs.pipe_file(name, b"x")
        proxy.requests.clear()  # type: ignore[union-attr]
        fs.rm([*odd, *many, f"{path}/never-written.json"])
        posts = [t for m, t in proxy.requests or [] if m == "POST"]
        assert len(posts) == 2 and all(t.endswith("?delete=") for t in posts)
        witness = _witness(minio)
        assert witness.find(path) == [f"{path}/kept.json"]
        fs.rm(f"{path}/kept.json")
        assert not _witness(minio).exists(f"{path}/kept.json")
        proxy.refuse("?delete", 403, "AccessDenied")
        with pytest.raises(PermissionError, match="403 AccessDenied"):
            fs.rm([f"{path}/x.json"])
    finally:
        proxy.stop()
