"""Status benchmark: do ``rmqtx status`` and its views answer in about a second on a store that
has grown for days, and does their time follow the work rather than the history?

Builds two stores directly with deltalake (bulk appends, not through the producer):
* **history**: a CommitLog of M messages in 100 topics stored over the last 4 days (a topic's
  messages an hour apart from the next's, so the last hour holds few files), H transactions
  decided two days ago and published, in ``half`` and ``op``, the ``pending`` table brought up
  to date (as the check-back job keeps it), then P new pending transactions and a consumer
  group's progress;
* **baseline**: the same P pending transactions and consumer group, and a CommitLog of 100
  messages a topic.
Then times the overview (``rmqtx status``) and each view (``status groups | transactions |
topics | store``), and the same through ``rmqtx ui``'s JSON API, on each store, the best of
--repeat runs, and prints them with the ratio history / baseline (the issue's bar: about a
second with M = H = 5,000,000).

Usage: python bench/status_bench.py [--messages 500000] [--history 500000] [--pending 10000]
       (the issue's size: --messages 5000000 --history 5000000)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
from checkback_history_bench import build_history as build_decided
from checkback_history_bench import half_rows
from deltalake import write_deltalake
from publish_bench import build_history as build_commitlog

from rmq_spark import Store
from rmq_spark.checkback.pending import update_pending
from rmq_spark.model.config import RetentionSettings
from rmq_spark.model.messages import new_ids
from rmq_spark.model.schema import CONSUMER_OFFSETS_SCHEMA
from rmq_spark.ops.status import store_status
from rmq_spark.ops.ui.server import Dashboard, make_server
from rmq_spark.ops.views import VIEWS

TOPICS = [f"Topic{i:03d}" for i in range(100)]


def build(root: Path, messages: int, history: int, pending: list[str]) -> Store:
    store = Store.open(root)
    now = datetime.now(UTC)
    stored = [now - timedelta(hours=len(TOPICS) - i) for i in range(len(TOPICS))]
    build_commitlog(store, messages, TOPICS, stored)
    if history:
        build_decided(store, history, now - timedelta(days=2))
    update_pending(store)  # as the check-back job keeps it
    write_deltalake(store.table_uri("half"), half_rows(pending, b"y" * 100), mode="append")
    ends = store.next_offsets()
    rows = [
        {
            "consumer_group": "billing",
            "topic": topic,
            "queue_id": queue,
            "next_offset": max(0, end - 10),
            "updated_timestamp": now,
        }
        for (topic, queue), end in ends.items()
    ]
    write_deltalake(
        store.table_uri("consumer_offsets"),
        pa.Table.from_pylist(rows, CONSUMER_OFFSETS_SCHEMA),
        mode="append",
    )
    return store


def timings(store: Store, repeat: int) -> dict[str, float]:
    """Best of ``repeat`` runs of the overview and each view, in seconds; then of the same
    through ``rmqtx ui``'s JSON API (HTTP on loopback, JSON encoding included)."""
    calls = {"status": lambda: store_status(store)}
    calls |= {
        f"status {name}": (lambda v=view: v(store, RetentionSettings()))
        for name, view in VIEWS.items()
    }
    server = make_server(Dashboard(store, RetentionSettings(), 60.0), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/api/"
    calls |= {
        f"ui /api/{name}": (lambda n=name: json.load(urllib.request.urlopen(url + n)))
        for name in ("status", *VIEWS)
    }
    best = {}
    for name, call in calls.items():
        runs = []
        for _ in range(repeat):
            started = time.perf_counter()
            call()
            runs.append(time.perf_counter() - started)
        best[name] = min(runs)
    server.shutdown()
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=500_000)
    parser.add_argument("--history", type=int, default=500_000)
    parser.add_argument("--pending", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    pending = new_ids(args.pending).to_pylist()
    with tempfile.TemporaryDirectory(prefix="rmq-status-bench-") as tmp:
        started = time.perf_counter()
        big = build(Path(tmp) / "history", args.messages, args.history, pending)
        base = build(Path(tmp) / "baseline", 100 * len(TOPICS), 0, pending)
        print(
            f"status benchmark: {args.messages:,} messages in {len(TOPICS)} topics and "
            f"{args.history:,} decided transactions, against none; {args.pending:,} pending "
            f"each (built in {time.perf_counter() - started:.0f} s); best of {args.repeat}"
        )
        on_big, on_base = timings(big, args.repeat), timings(base, args.repeat)
        for name in on_big:
            print(
                f"  {name + ':':<22} history {on_big[name]:6.3f} s, baseline "
                f"{on_base[name]:6.3f} s, ratio {on_big[name] / on_base[name]:5.2f}x"
            )


if __name__ == "__main__":
    main()
