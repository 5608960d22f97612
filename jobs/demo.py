"""End-to-end demo on the embedded default store: `make demo` (or python jobs/demo.py --help).

An order service sends OrderCreated events in transactions; some commit, some roll back, some
end UNKNOWN. The check-back job then asks the order service about the UNKNOWN ones and
resolves them. Every summary is read back from the Delta tables with Spark (delta-spark).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from pathlib import Path

from pyspark.sql import functions as F

from rmq_spark import Store, get_spark, load_settings
from rmq_spark.checkback import CallableChecker, CheckBackJob
from rmq_spark.model.config import configure_logging
from rmq_spark.ops.demo import PRODUCER_GROUP, OrderService, make_orders, place_orders
from rmq_spark.ops.report import read_table, state_counts, transaction_states


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", help="store root (default: store.path from conf, 'storage')")
    parser.add_argument("--orders", type=int, default=40, help="orders to place (default 40)")
    parser.add_argument(
        "--master",
        default="local[2]",
        help="Spark master URL (default local[2]; spark-submit's wins)",
    )
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

        spark = get_spark(
            "rmq-spark-demo",
            master=args.master,
            settings=settings,
            # A demo of seconds has no use for the UI; PYSPARK_SUBMIT_ARGS or spark-submit can
            # still turn it on.
            extra_conf={"spark.ui.enabled": "false"},
            store_root=store.root,
        )
        run_ids = spark.createDataFrame(
            [(r.transaction_id,) for r in results], "transaction_id string"
        )

        def show_states(title: str) -> None:
            states = transaction_states(spark, store).join(run_ids, "transaction_id")
            print(title)
            state_counts(states).show(truncate=False)

        show_states("This run, read back from the Delta tables with Spark:")
        # The check-back job asks the order service about the UNKNOWN ones. Its first round
        # starts their clocks; after transactionTimeOut they are due.
        job = CheckBackJob(
            spark,
            store,
            {PRODUCER_GROUP: CallableChecker(service.check_local_transaction)},
            settings.transaction,
            skip_unrouted=True,
        )
        job.run_once()
        wait = settings.transaction.transaction_timeout
        print(f"waiting {wait:.0f} s (transactionTimeOut) before checking back ...\n")
        time.sleep(wait)
        job.run_once()  # logs its summary
        show_states("\nThis run after check-back:")

    print("Committed events, as consumers see them in the CommitLog:")
    (
        read_table(spark, store, "commitlog")
        .join(run_ids, "transaction_id")
        .select("keys", "topic", "queue_id", "queue_offset", "tags", "store_timestamp")
        .orderBy("keys")
        .show(5, truncate=False)
    )
    totals = transaction_states(spark, store).groupBy("state").agg(F.count("*").alias("messages"))
    print("Whole store (all runs):")
    totals.orderBy("state").show(truncate=False)
    spark.stop()


if __name__ == "__main__":
    main()
