"""Requests benchmark: what one transaction costs an object store, every request counted.

One producer on an ``s3://`` store (MinIO on loopback, behind :mod:`tests.latency_proxy`, which
counts every request) sends --transactions transactional messages one after the other, each
ended with COMMIT (``end_transaction``, durable when it returns); then it waits until every
COMMIT is published and the checkpoints and maintenance asked for are done. Counted: every
request of the run, per transaction, by kind and by table and object (log entry, checkpoint,
data file). One sender at a time makes each commit carry one transaction, so the count is the
same from run to run: the number to follow as the send path and its background work change
(S3 bills per request).

Baseline, same run: a plain deltalake append of one row per message (``write_deltalake``, one
commit each, with deltalake's own checkpoints), through the same proxy. A transaction needs
three commits (its half message, its decision, its publish); the physical minimum is two PUTs
(the half message and the decision durable).

Usage: python bench/requests_bench.py [--transactions 300] [--delay-ms 0]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
from deltalake import write_deltalake

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from scale_bench import BODY, EndedLater  # noqa: E402

from rmq_spark import LocalTransactionState, Message, Store, TransactionMQProducer  # noqa: E402
from rmq_spark.delta.storage import deltalake_options  # noqa: E402
from rmq_spark.model.config import StoreSettings  # noqa: E402
from tests import minio  # noqa: E402
from tests.latency_proxy import LatencyProxy  # noqa: E402


def kind_of(method: str, target: str, root: str) -> tuple[str, str, str]:
    """(method, table, object) of a request under ``root`` (the bucket's key prefix)."""
    path, _, query = target.partition("?")
    if method == "LIST":
        prefix = re.search(r"prefix=([^&]*)", query)
        path = "/" + (prefix.group(1).replace("%2F", "/") if prefix else "")
    table = re.search(rf"/{re.escape(root)}/([a-z_]+)(?:/|$)", path)
    name = path.rsplit("/", 1)[-1]
    if method == "LIST":
        what = "listing"
    elif name.endswith(".json"):
        what = "log entry"
    elif "checkpoint" in name:
        what = "checkpoint"
    elif name.endswith(".parquet"):
        what = "data file"
    else:
        what = name or "other"
    return method, table.group(1) if table else "-", what


def counted(proxy: LatencyProxy, root: str, work: int) -> Counter[tuple[str, str, str]]:
    """The requests the proxy recorded since it was last cleared, per unit of ``work``."""
    found = Counter(kind_of(m, t, root) for m, t in proxy.requests or [])
    proxy.requests.clear()  # type: ignore[union-attr]
    return Counter({k: v / work for k, v in found.items()})


def transactions(options: dict[str, str], root: str, n: int, proxy: LatencyProxy) -> float:
    """Send ``n`` transactions one after the other (on a store made first, not counted);
    return the seconds they took."""
    made = StoreSettings(path=f"s3://{minio.BUCKET}/{root}", storage_options=options)
    store = Store.open(settings=made)
    proxy.requests.clear()  # type: ignore[union-attr]
    start = time.perf_counter()
    with TransactionMQProducer("bench", EndedLater(), store=store) as producer:
        for i in range(n):
            sent = producer.send_message_in_transaction(Message("Bench", BODY, keys=f"k{i}"))
            producer.end_transaction(sent, LocalTransactionState.COMMIT)
            if (i + 1) % max(n // 5, 1) == 0:
                print(f"  {i + 1} of {n} transactions", flush=True)
        producer.flush()
    store.finish_maintenance()
    published = store.read("commitlog", ["msg_id"]).num_rows
    assert published == n, (published, n)
    return time.perf_counter() - start


def appends(options: dict[str, str], root: str, n: int, proxy: LatencyProxy) -> float:
    """Append ``n`` rows one commit each with deltalake (to a table made first, not counted);
    return the seconds they took."""
    uri, opts = f"s3://{minio.BUCKET}/{root}", deltalake_options(options)
    row = pa.table({"key": ["k"], "body": [BODY]})
    write_deltalake(uri, row, storage_options=opts)
    proxy.requests.clear()  # type: ignore[union-attr]
    start = time.perf_counter()
    for _ in range(n):
        write_deltalake(uri, row, mode="append", storage_options=opts)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transactions", type=int, default=300)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    args = parser.parse_args()
    n = args.transactions
    with tempfile.TemporaryDirectory(prefix="rmq-requests-") as tmp:
        server = minio.start(Path(tmp) / "minio" / "data")
        proxy = LatencyProxy(int(server.endpoint.rsplit(":", 1)[1]), args.delay_ms, record=True)
        proxy.start()
        options = dict(server.storage_options, AWS_ENDPOINT_URL=proxy.endpoint)
        try:
            print(f"requests on s3:// (MinIO, +{args.delay_ms:g} ms a request), {n} of each")
            seconds = appends(options, "plain", n, proxy)
            plain = counted(proxy, "plain", n)
            print(f"baseline: deltalake append, one row a commit: {seconds / n * 1000:.0f} ms each")
            seconds = transactions(options, "store", n, proxy)
            ours = counted(proxy, "store", n)
            print(f"rmq-spark: one transaction after the other: {seconds / n * 1000:.0f} ms each")
        finally:
            proxy.stop()
            server.stop()
    total, base = sum(ours.values()), sum(plain.values())
    print(f"\n{'requests':>22} {'a transaction':>14} {'a plain append':>15}")
    for method in sorted({k[0] for k in ours} | {k[0] for k in plain}):
        mine = sum(v for k, v in ours.items() if k[0] == method)
        theirs = sum(v for k, v in plain.items() if k[0] == method)
        print(f"{method:>22} {mine:14.2f} {theirs:15.2f}")
    print(f"{'all':>22} {total:14.2f} {base:15.2f}   ratio {total / base:.2f}x")
    print("\nthe transaction's, by table and object:")
    for (method, table, what), v in sorted(ours.items(), key=lambda kv: -kv[1]):
        if v >= 0.05:
            print(f"  {method:6} {table:12} {what:12} {v:6.2f}")


if __name__ == "__main__":
    main()
