"""A streaming pipeline run as its own process by the sink fault tests (killed by failpoints).

Usage: python -m tests.sink_child {stream|foreach|batch} STORE INPUT CHECKPOINT BUSINESS_TABLE
"""

from __future__ import annotations

import sys

from rmq_spark import get_spark, publish_with_delta_write


def main(mode: str, store: str, source: str, checkpoint: str, business: str) -> None:
    # Up to 2 attempts per task, so a task failing after staging is retried.
    spark = get_spark("sink-child", master="local[2,2]")
    if mode == "batch":
        rows = spark.read.format("delta").load(source).selectExpr("body", "keys")
        rows.write.format("rmqtx").mode("append").option("path", store).option(
            "topic", "Orders"
        ).option("producerGroup", "pipeline").save()
        spark.stop()
        return
    rows = spark.readStream.format("delta").option("maxFilesPerTrigger", 1).load(source)
    if mode == "stream":
        writer = (
            rows.selectExpr("body", "keys")
            .writeStream.format("rmqtx")
            .option("path", store)
            .option("topic", "Orders")
            .option("producerGroup", "pipeline")
        )
    else:

        def process(batch, batch_id: int) -> None:
            publish_with_delta_write(
                batch.select("order_id"),
                business,
                batch.selectExpr("body", "keys"),
                app_id="orders-pipeline",
                version=batch_id,
                producer_group="pipeline",
                topic="Orders",
                path=store,
            )

        writer = rows.writeStream.foreachBatch(process)
    query = writer.option("checkpointLocation", checkpoint).trigger(availableNow=True).start()
    query.awaitTermination()
    spark.stop()


if __name__ == "__main__":
    main(*sys.argv[1:])
