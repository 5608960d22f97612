"""The Spark side: ``format("rmqtx")`` (source, read planning, offsets), the sink, epochs and
sessions."""
