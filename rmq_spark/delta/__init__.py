"""The Delta layer: data files, hand-written log commits, log reading, storage options."""
