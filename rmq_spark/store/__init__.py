"""The store: the broker semantics (prepare, decide, publish, offsets, maintenance) over Delta."""
