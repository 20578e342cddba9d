"""The Redis store: its key layout, its scripts and its reads, in one place."""
