"""``rmqtx serve``: RocketMQ 5's gRPC client protocol (producer side) in front of a store, so
that unchanged RocketMQ 5 clients send normal and transactional messages into it.

Needs the ``serve`` extra (``pip install 'rmq-spark[serve]'``): ``grpcio`` and the official
Python client's generated protocol code (``rocketmq-python-client``). See
:mod:`rmq_spark.serve.service` for how each call maps onto the store, and
:mod:`rmq_spark.serve.recovery` for check-back through the clients.
"""

from rmq_spark.serve.server import ServeOptions, ServeSummary, serve

__all__ = ["ServeOptions", "ServeSummary", "serve"]
