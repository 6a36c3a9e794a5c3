"""The commands beside training: the `toolkit` CLI (dummy data, preflight, inspect-data, export, plot)."""
