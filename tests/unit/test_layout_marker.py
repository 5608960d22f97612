"""The store's marker (:mod:`rmq_spark.store.layout`) when the processes that write it race:
a maker or a raiser stopped (SIGSTOP) between reading the marker and writing it must not take
back what another process wrote meanwhile: a lower layout lets an older rmq-spark open a store
it would damage, a lower shard count hides a shard removed by hand."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rmq_spark import Store
from rmq_spark.model.config import StoreSettings
from rmq_spark.model.errors import CorruptStoreError, StoreError
from rmq_spark.store import layout
from rmq_spark.store.layout import LAYOUT_VERSION, MARKER_FILE, OBJECTS_LAYOUT, raise_layout

REPO = Path(__file__).resolve().parents[2]


def stopped_at(failpoint: str, script: str, *args: str, tmp_path: Path) -> subprocess.Popen:
    """A child running ``script`` (with ``args``), once it has stopped itself at ``failpoint``."""
    marker = tmp_path / f"stopped-{failpoint}"
    child = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        env={
            **os.environ,
            "PYTHONPATH": str(REPO),
            "RMQ_SPARK_FAILPOINT": f"{failpoint}:stop",
            "RMQ_SPARK_FAILPOINT_MARKER": str(marker),
        },
    )
    for _ in range(600):
        if marker.exists() and Path(f"/proc/{child.pid}/stat").read_text().split()[2] == "T":
            return child
        assert child.poll() is None, "the child ended before the failpoint"
        time.sleep(0.1)
    child.kill()
    raise AssertionError(f"the child did not reach {failpoint}")


def resumed(child: subprocess.Popen, after: float) -> threading.Timer:
    """Resume ``child`` (SIGCONT) ``after`` seconds from now, from another thread: meanwhile
    this one may wait for what the child holds."""
    timer = threading.Timer(after, os.kill, (child.pid, signal.SIGCONT))
    timer.start()
    return timer


def finished(child: subprocess.Popen) -> None:
    """Resume ``child`` (if still stopped) and check that it ends well."""
    os.kill(child.pid, signal.SIGCONT)
    assert child.wait(timeout=120) == 0


def marker(root: Path) -> dict:
    return json.loads((root / MARKER_FILE).read_text())


RAISE = (
    "import sys\nfrom rmq_spark import Store\nfrom rmq_spark.store.layout import raise_layout\n"
    "raise_layout(Store.open(sys.argv[1])._tables, version=int(sys.argv[2]))\n"
)


def test_a_raise_stalled_after_its_read_does_not_lower_a_racing_raise(tmp_path: Path) -> None:
    """A process deciding by objects (layout 4) reads the marker of a new store and stops; one
    staging intake objects raises it to 5 meanwhile. Resumed, the first must not write back
    its 4: a layout-4 rmq-spark would then open the store and decide transactions whose half
    messages wait in intake objects it does not read."""
    root = tmp_path / "store"
    Store.open(root)
    child = stopped_at("layout.read", RAISE, str(root), str(OBJECTS_LAYOUT), tmp_path=tmp_path)
    timer = resumed(child, 2.0)
    try:
        raise_layout(Store.open(root)._tables, version=LAYOUT_VERSION)
    finally:
        timer.join()
        finished(child)
    assert marker(root)["layout_version"] == LAYOUT_VERSION


def test_a_maker_stalled_before_its_marker_does_not_undo_the_store_made_meanwhile(
    tmp_path: Path,
) -> None:
    """Two processes make the same store; the first stops with its marker staged. The second
    makes the store, and its first object-decided transaction raises the layout. Resumed, the
    first must find the marker there, not replace it with a new store's."""
    root = tmp_path / "store"
    child = stopped_at(
        "layout.staged",
        "import sys\nfrom rmq_spark import Store\nStore.open(sys.argv[1])\n",
        str(root),
        tmp_path=tmp_path,
    )
    try:
        raise_layout(Store.open(root)._tables, version=LAYOUT_VERSION)
    finally:
        finished(child)
    assert marker(root)["layout_version"] == LAYOUT_VERSION
    assert not [p for p in root.iterdir() if p.name.endswith(".tmp")]


def test_a_layout_raise_stalled_across_a_grow_does_not_lower_the_shard_count(
    tmp_path: Path,
) -> None:
    """A process raising the layout (its first object-decided prepare) reads the marker and
    stops before rewriting it; meanwhile another grows the store to three shards (it waits for
    the first to go on). The count must end at three: it is what makes a shard removed by hand
    an error instead of its messages silently gone."""
    root = tmp_path / "store"
    Store.open(root)
    child = stopped_at(
        "layout.read",
        "import sys\nfrom rmq_spark import Message, Store\n"
        "Store.open(sys.argv[1]).prepare([Message('T', b'x')], 'pg')\n",
        str(root),
        tmp_path=tmp_path,
    )
    timer = resumed(child, 2.0)
    try:
        Store.open(settings=StoreSettings(path=str(root), queue_nums=2, shards=3))
    finally:
        timer.join()
        finished(child)
    assert marker(root)["shards"] == 3
    shutil.rmtree(root / "shards" / "2")
    with pytest.raises(CorruptStoreError, match=r"shard\(s\) \[2\]"):
        Store.open(root).shard_numbers(refresh=True)


def test_a_raise_waits_for_a_stopped_holder_of_the_marker_lock_a_bounded_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A raiser stopped (SIGSTOP) while it holds the marker's lock held up every other raise
    for as long, and with it the first object-decided send of every process that opened the
    store: a wait with no end and no word. The wait ends with an error naming the lock."""
    root = tmp_path / "store"
    Store.open(root)
    child = stopped_at("layout.read", RAISE, str(root), str(OBJECTS_LAYOUT), tmp_path=tmp_path)
    monkeypatch.setattr(layout, "_LOCK_WAIT_SECONDS", 1.0)
    try:
        started = time.monotonic()
        with pytest.raises(StoreError, match=r"_rmqtx_store\.json\.lock.*stopped"):
            raise_layout(Store.open(root)._tables, version=LAYOUT_VERSION)
        assert time.monotonic() - started < 30
    finally:
        finished(child)
    raise_layout(Store.open(root)._tables, version=LAYOUT_VERSION)  # the holder is gone
    assert marker(root)["layout_version"] == LAYOUT_VERSION


def test_the_marker_lock_is_as_writable_as_the_store_whatever_the_umask(tmp_path: Path) -> None:
    """The lock file is the one file every writer of a store opens for writing: made with its
    first raiser's umask (077, a service account's), it locked out every other account that
    may write the store. It takes the store folder's read and write bits instead."""
    root = tmp_path / "store"
    Store.open(root)
    root.chmod(0o770)  # a store shared by a group
    group = 4242 if os.geteuid() == 0 else root.stat().st_gid  # root may hand it to any group
    os.chown(root, -1, group)
    old = os.umask(0o077)
    try:
        raise_layout(Store.open(root)._tables, version=LAYOUT_VERSION)
    finally:
        os.umask(old)
    lock = root / f"{MARKER_FILE}.lock"
    assert lock.stat().st_mode & 0o777 == 0o660
    assert lock.stat().st_gid == group
    assert sorted(p.name for p in root.iterdir() if ".lock." in p.name) == []  # nothing aside


@pytest.mark.parametrize("kind", ["link", "fifo", "folder"])
def test_a_marker_lock_that_is_not_a_file_is_refused_and_left_alone(
    tmp_path: Path, kind: str
) -> None:
    """Anyone who may write the store's folder could make the lock file a link to a file of the
    account that raises (a key, the settings with the secret keys): opened through the link and
    given the folder's bits, that file became readable by all. A FIFO would hold the raise in
    its open. A lock that is not a regular file is refused, naming it, and a link's target
    keeps its mode."""
    root = tmp_path / "store"
    Store.open(root)
    root.chmod(0o775)
    secret = tmp_path / "secret.toml"
    secret.write_text("secret_key = 'x'\n")
    secret.chmod(0o600)
    lock = root / f"{MARKER_FILE}.lock"
    if kind == "link":
        lock.symlink_to(secret)
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.mkdir()
    with pytest.raises(StoreError, match=r"_rmqtx_store\.json\.lock.*not a regular file"):
        raise_layout(Store.open(root)._tables, version=LAYOUT_VERSION)
    assert secret.stat().st_mode & 0o777 == 0o600
    assert secret.read_text() == "secret_key = 'x'\n"


@pytest.mark.parametrize("filesystem", ["without hard links", "racing maker"])
def test_the_marker_lock_made_without_a_link_or_by_another_maker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, filesystem: str
) -> None:
    """Where a filesystem refuses hard links the lock is made in place, with the folder's bits
    all the same; where another process put its lock in place first, that one is kept (it
    may be held) and used."""
    root = tmp_path / "store"
    Store.open(root)
    root.chmod(0o770)
    lock = root / f"{MARKER_FILE}.lock"
    theirs = b"another maker's lock"

    def link(src: str, dst: str) -> None:
        if filesystem == "without hard links":
            raise OSError(errno.EPERM, "Operation not permitted")
        Path(dst).write_bytes(theirs)
        raise FileExistsError(errno.EEXIST, "File exists", dst)

    monkeypatch.setattr(layout.os, "link", link)
    old = os.umask(0o077)
    try:
        raise_layout(Store.open(root)._tables, version=LAYOUT_VERSION)
    finally:
        os.umask(old)
    if filesystem == "without hard links":
        assert lock.stat().st_mode & 0o777 == 0o660
        assert lock.read_bytes() == b""
    else:
        assert lock.read_bytes() == theirs
    assert [p.name for p in root.iterdir() if ".lock." in p.name] == []
    assert marker(root)["layout_version"] == LAYOUT_VERSION
