"""Reading Delta tables as plain Arrow: data files read directly with pyarrow, snapshots' add
actions, SQL through DataFusion, and SQL literals."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from urllib.parse import unquote

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.fs as pafs
from deltalake import DeltaTable

from rmq_spark.delta.files import WrittenFiles
from rmq_spark.delta.storage import arrow_filesystem, filesystem

#: Data files read together up to this many bytes in all are each read whole, at once
#: (:func:`read_files`).
WHOLE_FILES_BYTES = 64 * 1024 * 1024


def _plain_type(dtype: pa.DataType) -> pa.DataType:
    """The same type with string/binary views replaced by plain strings/binaries."""
    if dtype == pa.string_view():
        return pa.string()
    if dtype == pa.binary_view():
        return pa.binary()
    if pa.types.is_map(dtype):
        return pa.map_(_plain_type(dtype.key_type), _plain_type(dtype.item_type))
    if pa.types.is_list(dtype) or pa.types.is_large_list(dtype):
        return pa.list_(_plain_type(dtype.value_type))
    return dtype


def read_arrow(stream: object) -> pa.Table:
    """Read an Arrow C stream (deltalake returns arro3 objects, with view types) as plain
    pyarrow types, which every compute kernel supports."""
    table = pa.RecordBatchReader.from_stream(stream).read_all()
    schema = pa.schema([f.with_type(_plain_type(f.type)) for f in table.schema])
    return table.cast(schema)


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Select and cast columns to ``schema`` (deltalake may hand back view/large types)."""
    columns = [table.column(f.name).cast(f.type) for f in schema]
    return pa.Table.from_arrays(columns, schema=schema)


def row_keys(rows: pa.Table, columns: Sequence[str]) -> pa.ChunkedArray:
    """One string per row of ``rows``, made of its ``columns``: equal for rows whose values
    in them are equal (nulls included)."""
    parts = [pc.cast(rows.column(c), pa.string()) for c in columns]
    return pc.binary_join_element_wise(
        *parts, "\x00", null_handling="replace", null_replacement="\x01"
    )


def once_per_key(rows: pa.Table, key: Sequence[str], newest: Sequence[str] = ()) -> pa.Table:
    """``rows`` with each value of the ``key`` columns once, in their order: of the rows of
    one key, the first whose ``newest`` columns (values that only grow as a row is updated in
    place; nulls least, in the order given) are greatest."""
    keys = row_keys(rows, key)
    if pc.count_distinct(keys, mode="all").as_py() == rows.num_rows:
        return rows
    order = np.arange(rows.num_rows)
    if newest:
        ranks: dict[str, object] = {}
        for i, name in enumerate(newest):  # a value first, then the greatest
            ranks[f"valid{i}"] = pc.is_valid(rows.column(name))
            ranks[f"value{i}"] = rows.column(name)
        ranks["at"] = order
        sorting = [(name, "descending") for name in ranks if name != "at"] + [("at", "ascending")]
        order = pa.table(ranks).sort_by(sorting).column("at").to_numpy()
    _, first = np.unique(keys.take(order).to_numpy(zero_copy_only=False), return_index=True)
    return rows.take(np.sort(order[first]))


def with_uris(table: DeltaTable, base: str) -> pa.Table:
    """The add actions of a snapshot (flattened statistics) plus each file's ``uri`` under the
    table URI ``base``."""
    files = read_arrow(table.get_add_actions(flatten=True))
    # An add action's path is a relative, percent-encoded URI (Delta protocol).
    uris = [f"{base.rstrip('/')}/{unquote(p)}" for p in files.column("path").to_pylist()]
    return files.append_column("uri", pa.array(uris, pa.string()))


def read_files(
    uris: Sequence[str],
    schema: pa.Schema,
    storage_options: Mapping[str, str],
    keep: Callable[[pa.Table], pa.ChunkedArray] | None = None,
    columns: Sequence[str] | None = None,
    sizes: Sequence[int] | None = None,
    kept: WrittenFiles | None = None,
) -> pa.Table:
    """Read Parquet data files of a table directly with pyarrow (multi-threaded).

    Parameters
    ----------
    uris : sequence of str
        File URIs, as ``DeltaTable.file_uris()`` or :func:`with_uris` give them.
    schema : pyarrow.Schema
        The files' schema (partition columns are not in the files).
    storage_options : mapping
        The store's ``storage_options`` (fsspec) for object stores.
    keep : callable, optional
        Returns a boolean mask of the rows to keep. The rows are copied only when some are
        dropped. (Not a dataset filter: files written by deltalake's MERGE carry view types,
        which pyarrow's statistics pruning cannot compare with plain literals.)
    columns : sequence of str, optional
        Read only these columns.
    sizes : sequence of int, optional
        The files' sizes (their add actions'). Files this small together
        (:data:`WHOLE_FILES_BYTES`) are each read whole, all at once: one request a file on
        an object store, where pyarrow makes three one after the other (the size, the
        footer, the data), 20 to 50 ms each.
    kept : WrittenFiles, optional
        Files read whole that this process wrote and kept are taken from there (their rows as
        written: no request, no decode).
    """
    if columns is not None:
        schema = pa.schema([schema.field(c) for c in columns])
    if not uris:
        return schema.empty_table()
    paths = [fsspec.core.strip_protocol(uri) for uri in uris]
    names = list(columns) if columns is not None else None
    if sizes is not None and sum(sizes) <= WHOLE_FILES_BYTES:
        held = kept.take(paths) if kept is not None else {}
        missing = [p for p in paths if p not in held]
        whole = filesystem(uris[0], storage_options)[0].cat(missing) if missing else {}
        parquet = pads.ParquetFileFormat()
        parts, run = [], []  # in the order of ``paths``; a run of files read is decoded at once
        for path in [*paths, None]:
            if path in whole:
                run.append(parquet.make_fragment(pa.BufferReader(whole[path])))
                continue
            if run:
                dataset = pads.FileSystemDataset(run, schema, parquet, pafs.LocalFileSystem())
                parts.append(dataset.to_table(columns=names))
                run = []
            if path is not None:
                part = held[path]
                parts.append(part if part.schema.equals(schema) else conform(part, schema))
        rows = pa.concat_tables(parts)
    else:
        dataset = pads.dataset(
            paths,
            schema=schema,
            format="parquet",
            filesystem=arrow_filesystem(uris[0], storage_options),
        )
        rows = dataset.to_table(columns=names)
    if keep is None:
        return rows
    mask = keep(rows)
    return rows if pc.all(mask).as_py() and not mask.null_count else rows.filter(mask)


def sql_string(value: str) -> str:
    """``value`` as a SQL string literal (for SQL conditions over a table)."""
    return "'" + value.replace("'", "''") + "'"


def sql_time(moment: datetime) -> str:
    """``moment`` as a SQL timestamp literal (for SQL conditions over a table)."""
    return f"TIMESTAMP '{moment.isoformat()}'"
