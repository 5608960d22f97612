"""End-to-end demo on the embedded default store: `make demo` (or python jobs/demo.py --help).

An order service sends OrderCreated events in transactions; some commit, some roll back, some
end UNKNOWN. The summary is read back from the Delta tables with Spark (delta-spark).
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from pathlib import Path

from pyspark.sql import functions as F

from rmq_spark import Store, get_spark, load_settings
from rmq_spark.config import configure_logging
from rmq_spark.demo import PRODUCER_GROUP, OrderService, make_orders, place_orders
from rmq_spark.report import state_counts, transaction_states


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", help="store root (default: store.path from conf, 'storage')")
    parser.add_argument("--orders", type=int, default=40, help="orders to place (default 40)")
    args = parser.parse_args()
    settings = load_settings()
    configure_logging(settings.log_level)

    store = Store.open(args.path, settings=settings)
    print(f"\nrmq-spark demo on store {store.root}")
    with tempfile.TemporaryDirectory(prefix="rmq-orders-") as tmp:
        service = OrderService(Path(tmp) / "orders.sqlite")
        orders = make_orders(args.orders)
        results = place_orders(store, service, orders)
    answers = Counter(r.local_transaction_state.value for r in results)
    print(
        f"order service sent {len(results)} transactional messages; local transactions "
        f"answered {dict(sorted(answers.items()))}\n"
    )

    spark = get_spark("rmq-spark-demo", settings=settings)
    run_ids = spark.createDataFrame([(r.transaction_id,) for r in results], "transaction_id string")
    states = transaction_states(spark, store).join(run_ids, "transaction_id")
    print("This run, read back from the Delta tables with Spark:")
    state_counts(states).show(truncate=False)
    print("Committed events, as consumers see them in the CommitLog:")
    (
        states.where("visible")
        .select("keys", "topic", "queue_offset", "state")
        .orderBy("keys")
        .show(5, truncate=False)
    )
    totals = transaction_states(spark, store).groupBy("state").agg(F.count("*").alias("messages"))
    print("Whole store (all runs):")
    totals.orderBy("state").show(truncate=False)
    print(f"Producer group {PRODUCER_GROUP!r}: PENDING messages wait for the check-back job.")
    spark.stop()


if __name__ == "__main__":
    main()
