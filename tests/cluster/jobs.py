"""Driver programs the cluster tests submit with spark-submit (one per run).

    spark-submit ... tests/cluster/jobs.py batch-sink ROOT ROWS
    spark-submit ... tests/cluster/jobs.py relay ROOT CHECKPOINT

The store's storage options come from the settings file named by ``$RMQ_SPARK_CONF``, as an
operator's job would get them; nothing is passed in the driver's memory.

``batch-sink`` writes ROWS messages to topic Orders with ``df.write.format("rmqtx")`` from 4
partitions; each carries as properties the process id and working directory of the executor
process that made it, and the driver prints its own process id, so a test can tell them
apart.
``relay`` streams topic Orders with ``readStream.format("rmqtx")`` into topic Copies with
``writeStream.format("rmqtx")`` (Trigger.AvailableNow, one micro-batch per 20 messages), with
its checkpoint at CHECKPOINT (on S3): a restart reads on from the checkpoint.
"""

from __future__ import annotations

import json
import os
import sys

from rmq_spark import get_spark


def batch_sink(root: str, rows: int) -> None:
    spark = get_spark("cluster-batch-sink", store_root=root)

    def on_executor(ids):
        # Each message carries the process and working directory that produced it.
        for i in ids:
            yield (str(i), str(i), str(os.getpid()), os.getcwd())

    df = spark.sparkContext.parallelize(range(rows), 4).mapPartitions(on_executor)
    df.toDF(["body", "keys", "pid", "cwd"]).write.format("rmqtx").mode("append").option(
        "path", root
    ).option("topic", "Orders").option("producerGroup", "pipeline").option(
        "extraColumnsAsProperties", "true"
    ).save()
    print(json.dumps({"driver_pid": os.getpid()}), flush=True)
    spark.stop()


def relay(root: str, checkpoint: str) -> None:
    spark = get_spark("cluster-relay", store_root=root)
    query = (
        spark.readStream.format("rmqtx")
        .option("path", root)
        .option("topic", "Orders")
        .option("maxMessagesPerTrigger", 20)
        .load()
        .selectExpr("body", "keys")
        .writeStream.format("rmqtx")
        .option("path", root)
        .option("topic", "Copies")
        .option("producerGroup", "relay")
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    spark.stop()


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "batch-sink":
        batch_sink(args[0], int(args[1]))
    else:
        relay(*args)
