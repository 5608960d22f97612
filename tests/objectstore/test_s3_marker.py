"""The store's marker on S3 when the processes that write it race: compared and swapped
(``If-Match``), made only if absent (``If-None-Match``), against a real S3 server (MinIO). The
same races on local disk: :mod:`tests.unit.test_layout_marker`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rmq_spark import Store
from rmq_spark.delta.s3requests import ObjectChanged, S3Requests
from rmq_spark.model.config import StoreSettings
from rmq_spark.store.layout import LAYOUT_VERSION, MARKER_FILE, OBJECTS_LAYOUT, raise_layout
from tests.unit.test_layout_marker import finished, stopped_at

pytestmark = pytest.mark.objectstore

OPEN = (
    "import json, sys\nfrom rmq_spark import Store\nfrom rmq_spark.model.config import "
    "StoreSettings\nfrom rmq_spark.store.layout import raise_layout\n"
    "store = Store.open(settings=StoreSettings(path=sys.argv[1], "
    "storage_options=json.loads(sys.argv[2])))\n"
)


def _store(minio, root: str) -> Store:  # noqa: ANN001
    return Store.open(settings=StoreSettings(path=root, storage_options=minio.storage_options))


def _marker(minio, root: str) -> dict:  # noqa: ANN001
    path = f"{root.removeprefix('s3://')}/{MARKER_FILE}"
    return json.loads(S3Requests(minio.storage_options).get(path))


def test_a_put_if_match_refuses_an_object_changed_or_removed(minio) -> None:
    requests = S3Requests(minio.storage_options)
    name = f"{minio.root().removeprefix('s3://')}/m.json"
    requests.put(name, b"1")
    _, tag = requests.get_tagged(name)
    requests.put(name, b"2", if_match=tag)
    with pytest.raises(ObjectChanged):
        requests.put(name, b"3", if_match=tag)
    assert requests.get(name) == b"2"
    with pytest.raises(ObjectChanged):
        requests.put(f"{name}.gone", b"3", if_match=tag)


def test_a_raise_stalled_after_its_read_does_not_lower_a_racing_raise(
    minio, tmp_path: Path
) -> None:
    root = minio.root()
    _store(minio, root)
    options = json.dumps(minio.storage_options)
    child = stopped_at(
        "layout.read",
        OPEN + f"raise_layout(store._tables, version={OBJECTS_LAYOUT})\n",
        root,
        options,
        tmp_path=tmp_path,
    )
    try:
        raise_layout(_store(minio, root)._tables, version=LAYOUT_VERSION)
    finally:
        finished(child)
    assert _marker(minio, root)["layout_version"] == LAYOUT_VERSION


def test_a_maker_stalled_before_its_marker_does_not_undo_the_store_made_meanwhile(
    minio, tmp_path: Path
) -> None:
    root = minio.root()
    child = stopped_at(
        "layout.table", OPEN, root, json.dumps(minio.storage_options), tmp_path=tmp_path
    )
    try:
        raise_layout(_store(minio, root)._tables, version=LAYOUT_VERSION)
    finally:
        finished(child)
    assert _marker(minio, root)["layout_version"] == LAYOUT_VERSION
