"""A real S3-compatible server for the object-store tier: MinIO on loopback.

``make objectstore`` builds the binary into ``.tools/bin/minio`` (``$RMQ_SPARK_MINIO``). A
test session starts one server on a free port with its data in a temporary folder, and every
test gets a store root of its own in one bucket.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from tests.lifetime import die_with_parent

ACCESS_KEY = "rmqspark"
SECRET_KEY = "rmqspark-secret"
BUCKET = "rmqtx"
REGION = "us-east-1"
DEFAULT_BINARY = Path(__file__).resolve().parents[1] / ".tools" / "bin" / "minio"
#: MinIO refuses every write (``XMinioStorageFull``) once a write would leave less than 1% of
#: its drive free (``diskFillFraction``); a test session writes well under this margin.
FREE_MARGIN_BYTES = 2 << 30


def binary() -> Path:
    """Where ``make objectstore`` put the MinIO server."""
    return Path(os.environ.get("RMQ_SPARK_MINIO") or DEFAULT_BINARY)


def free_port() -> int:
    """A TCP port free on loopback just now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Minio:
    """A running MinIO server and the settings that reach it."""

    endpoint: str
    process: subprocess.Popen
    log: Path

    @property
    def storage_options(self) -> dict[str, str]:
        """The store's ``storage_options`` (deltalake's vocabulary) for this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
        }

    def root(self, name: str = "store") -> str:
        """A store root of its own: ``s3://rmqtx/<name>-<random>``."""
        return f"s3://{BUCKET}/{name}-{uuid.uuid4().hex[:12]}"

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL)."""
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def check_free_space(data: Path) -> None:
    """Fail before starting when the drive under ``data`` is too full for MinIO to accept
    writes: otherwise every object-store test fails later with ``XMinioStorageFull``."""
    usage = shutil.disk_usage(data)
    needed = usage.total // 100 + FREE_MARGIN_BYTES
    if usage.free < needed:
        raise RuntimeError(
            f"the drive holding {str(data)!r} has {usage.free / 2**30:.1f} GiB free, and MinIO "
            f"refuses writes below 1% of it plus what is written ({needed / 2**30:.1f} GiB "
            "here): free some space (old pytest temporary folders, benchmark stores, clones) "
            "and run again"
        )


class PortTaken(RuntimeError):
    """MinIO could not bind the port it was given."""


def _serve(data: Path, certs: Path | None, port: int) -> Minio:
    """MinIO on ``port``, once it answers its readiness check."""
    log = data.parent / "minio.log"
    env = {
        **os.environ,
        "MINIO_ROOT_USER": ACCESS_KEY,
        "MINIO_ROOT_PASSWORD": SECRET_KEY,
        "MINIO_BROWSER": "off",
        "MINIO_UPDATE": "off",
        "MINIO_REGION": REGION,
    }
    argv = [str(binary()), "server", "--quiet", "--address", f"127.0.0.1:{port}", str(data)]
    argv += ["--certs-dir", str(certs)] if certs is not None else []
    with log.open("wb") as out:
        process = subprocess.Popen(
            argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
    server = Minio(f"http{'s' if certs else ''}://127.0.0.1:{port}", process, log)
    trusted = ssl.create_default_context(cafile=certs / "public.crt") if certs else None
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            said = log.read_text()[-2000:]
            taken = "port is already in use" in said
            raise (PortTaken if taken else RuntimeError)(
                f"MinIO exited with {process.returncode}: {said}"
            )
        try:
            ready = f"{server.endpoint}/minio/health/ready"
            with urllib.request.urlopen(ready, timeout=2, context=trusted):
                return server
        except OSError as exc:
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"MinIO not ready in 60 s: {log.read_text()[-2000:]}") from exc
            time.sleep(0.2)


def start(data: Path, certs: Path | None = None) -> Minio:
    """Start MinIO on a free loopback port with its data under ``data``; make the bucket. With
    ``certs``, a folder holding ``public.crt`` and ``private.key``, it speaks HTTPS only."""
    data.mkdir(parents=True, exist_ok=True)
    check_free_space(data)
    # A port found free here can be taken before MinIO binds it: MinIO then exits, and the
    # next port is tried.
    for attempt in range(3):
        try:
            server = _serve(data, certs, free_port())
            break
        except PortTaken:
            if attempt == 2:
                raise
    import s3fs

    s3fs.S3FileSystem(
        key=ACCESS_KEY,
        secret=SECRET_KEY,
        endpoint_url=server.endpoint,
        client_kwargs={
            "region_name": REGION,
            "verify": str(certs / "public.crt") if certs else None,
        },
    ).mkdir(BUCKET)
    return server
