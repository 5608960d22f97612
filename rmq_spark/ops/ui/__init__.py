"""``rmqtx ui``: the operator's web dashboard (:mod:`rmq_spark.ops.ui.server`)."""
